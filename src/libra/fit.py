"""What fits: the largest batch size whose plan fits a byte budget, found with a bounded number of profiles.

NOTE [Batch search]: a step's bytes grow about linearly in the batch size (activations and inputs scale with it,
parameters, gradients and optimizer state do not), so two profiles predict where a budget is crossed. A prediction
is only a candidate: each size is profiled and planned for real, and the answer is the largest size whose plan was
made, with the next size up profiled and found not to fit (``BatchFit.exact``). Between a size that fits and one
that does not, the search takes the secant through the last two sizes when it lands inside, else regula falsi
with the Illinois step (an end kept twice running counts half as far from the budget), so a curve that is not
quite linear still closes in a few profiles. Eager's largest batch comes from the same
profiles' measured eager peaks; the search then profiles around it too while profiles are left.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Callable

from libra.errors import BudgetInfeasibleError, LibraError
from libra.planner import Planning, plan
from libra.planner.types import Plan
from libra.api import profile
from libra.profiler.types import Profile
from libra.units import format_bytes, parse_bytes

__all__ = ["BatchFit", "max_batch"]

log = logging.getLogger("libra")

_DECISIONS = ("keep", "recompute", "offload")


@dataclass(frozen=True)
class BatchFit:
    """The answer of :func:`max_batch`.

    Attributes:
        batch_size: the largest batch size whose plan fits the budget.
        plan: the plan at that size (apply it to a model from ``make_step(batch_size)``).
        profile: the profile that plan was made from.
        predicted_ratio: the plan's predicted step time over eager's at that size.
        eager_max_batch: the largest batch size eager PyTorch fits in the same budget, from the same search's
            measured eager peaks; ``None`` when eager does not fit even ``start``.
        exact: ``batch_size + 1`` was profiled and does not fit (and likewise for ``eager_max_batch``); False when
            the profile limit ran out first, so the true answers may be larger.
        profiled: ``(batch size, eager peak bytes, smallest budget Libra plans for)`` of every profiled size.
    """

    batch_size: int
    plan: Plan = field(repr=False)
    profile: Profile = field(repr=False)
    predicted_ratio: float
    eager_max_batch: int | None
    exact: bool
    profiled: tuple[tuple[int, int, int], ...]


class _Bracket:
    """The search for the largest size that fits, over the sizes measured so far (NOTE [Batch search])."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.value: dict[int, int] = {}  # batch size -> the bytes that must fit the budget
        self.fits: dict[int, bool] = {}
        self.moves: list[bool] = []  # per measured size: did it fit (moved the lower end) or not (the upper end)
        self.order: list[int] = []  # sizes in the order measured

    def add(self, size: int, value: int | None, fits: bool) -> None:
        """Records one measured size; ``value`` None: its bytes are unknown (it ran out of device memory)."""
        self.fits[size] = fits
        self.moves.append(fits)
        if value is not None:
            self.value[size] = value
            self.order.append(size)

    @property
    def lo(self) -> int | None:
        return max((b for b, ok in self.fits.items() if ok), default=None)

    @property
    def hi(self) -> int | None:
        lo = self.lo or 0
        return min((b for b, ok in self.fits.items() if not ok and b > lo), default=None)

    @property
    def closed(self) -> bool:
        return self.lo is not None and self.hi == self.lo + 1

    def _line(self, b1: int, v1: float, b2: int, v2: float) -> int | None:
        """The size at which the line through two sizes' bytes reaches the budget (None: the line does not rise)."""
        slope = (v2 - v1) / (b2 - b1)
        if slope <= 0:
            return None
        return b1 + int((self.budget - v1) // slope)

    def next_size(self) -> int | None:
        """The next size to profile, or None when the answer is known."""
        lo, hi = self.lo, self.hi
        if lo is None or self.closed:
            return None
        if hi is None:
            below = [b for b in self.value if b < lo]  # lo always has a value: it fitted
            guess = self._line(lo, self.value[lo], max(below), self.value[max(below)]) if below else None
            return max(guess if guess is not None else 4 * lo, lo + 1)
        if hi not in self.value:  # hi ran out of device memory: nothing to interpolate
            return (lo + hi) // 2
        # the secant through the last two sizes measured (the nearest the crossing, and in the linear regime),
        # when it lands in the bracket; on lo itself it asks for lo + 1, the confirmation
        b1, b2 = self.order[-2:]
        guess = self._line(b1, self.value[b1], b2, self.value[b2])
        if guess is not None and lo <= guess < hi:
            return max(guess, lo + 1)
        # else regula falsi with the Illinois step: an end kept k > 1 times running counts 2**(1-k) as far away
        run = 0
        while run < len(self.moves) and self.moves[-1 - run] == self.moves[-1]:
            run += 1
        v_lo, v_hi = float(self.value[lo]), float(self.value[hi])
        if run >= 2 and self.moves[-1]:
            v_hi = self.budget + (v_hi - self.budget) / 2 ** (run - 1)
        elif run >= 2:
            v_lo = self.budget - (self.budget - v_lo) / 2 ** (run - 1)
        guess = self._line(lo, v_lo, hi, v_hi)
        if guess is None:
            guess = (lo + hi) // 2
        return min(max(guess, lo + 1), hi - 1)


def _profile_at(make_step: Callable, batch_size: int, warmup: int, fake=False,
                timing: str = "benchmark") -> Profile | None:
    """Profiles one step at ``batch_size`` after ``warmup`` plain steps (fake: on fake tensors, no warm-up); None
    when the device ran out of memory."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    try:
        made = make_step(batch_size)
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)
                and callable(made[1])):
            raise LibraError(
                f"libra.max_batch: make_step({batch_size}) should return (model, step), model a torch.nn.Module and "
                f"step a callable running one forward and backward; it returned {type(made).__name__}. Fix: return "
                "(model, step) for the given batch size."
            )
        model, step = made
        if fake is not False:
            return profile(model, step, fake=fake, timing=timing)
        for _ in range(warmup):
            step()
            model.zero_grad(set_to_none=True)
        return profile(model, step)
    except oom:
        log.warning("max_batch: batch %d ran out of device memory while profiling (the profiled step runs eagerly)",
                    batch_size)
        return None
    finally:
        made = model = step = None  # the model, its inputs and gradients go before the next size is built
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def max_batch(
    make_step: Callable[[int], tuple],
    budget: int | str,
    *,
    start: int = 1,
    max_profiles: int = 10,
    warmup: int = 1,
    solver: str = "greedy",
    host_bandwidth: float | None = None,
    decisions=None,
    progress: Callable[[str], None] | None = None,
    fake=False,
    timing: str = "benchmark",
) -> BatchFit:
    """Finds the largest batch size whose plan fits ``budget``, and eager's largest under the same budget.

    Profiles ``start``, ``2 * start``, extrapolates the bytes linearly in the batch size, then profiles and plans the
    predicted size and its neighbours until the largest fitting size is confirmed (NOTE [Batch search]).

    Each profile runs one real eager step at that size (after ``warmup`` plain steps), so on a GPU the device must
    hold eager's step at every profiled size: a size that runs out of device memory counts as not fitting. With
    ``fake=True`` each size is profiled on fake tensors instead (``libra.profile(..., fake=True)``), which needs no
    eager memory, so the answer is not capped by what eager can run; build optimizer state in ``make_step`` then
    (there is no warm-up step to create it).

    Args:
        make_step: ``make_step(batch_size)`` returns ``(model, step)``, as the factories of ``libra profile``;
            called once per profiled size. Build the model on the device you will train on.
        budget: peak live bytes allowed, an int or a string such as ``"6GiB"`` (see :func:`libra.plan`).
        start: the smallest batch size considered, and the first profiled.
        max_profiles: at most this many sizes are profiled (at least 2).
        warmup: plain steps before each profile, so optimizer state and first-call costs are the steady state.
        solver, host_bandwidth, decisions: as for :func:`libra.plan`.
        progress: called with one line per profiled size (the CLI prints them); the library itself never prints.
        fake: profile every size on fake tensors (no eager memory needed): ``True`` on the model's device, or a
            device such as ``"cpu"`` or ``"cuda:0"`` for a ``make_step`` that builds its model on ``meta``.
        timing: with ``fake``, ``"benchmark"`` or ``"estimate"`` (see :func:`libra.profile`); not ``"safe"``,
            which would run a real step at every size tried, beyond those that fit.

    Returns:
        A :class:`BatchFit`.

    Raises:
        BudgetInfeasibleError: even ``start`` does not fit; ``min_budget_bytes`` is the smallest budget Libra plans
            for at ``start``.
        LibraError: the arguments are invalid, ``make_step`` does not return ``(model, step)``, or ``start`` runs out
            of device memory while profiling.

    Example:
        >>> fit = libra.max_batch(lambda b: make(batch=b), "6GiB", start=8)
        >>> fit.batch_size >= (fit.eager_max_batch or 0)
        True
    """
    budget_bytes = parse_bytes(budget, what="libra.max_batch: budget")
    if not callable(make_step):
        raise LibraError(f"libra.max_batch: expected a callable make_step(batch_size), got {type(make_step).__name__}.")
    for name, value, least in (("start", start, 1), ("max_profiles", max_profiles, 2), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LibraError(f"libra.max_batch: {name} should be an int of at least {least}, got {value!r}.")
    if timing == "safe":
        raise LibraError("libra.max_batch: timing='safe' runs one real step at each batch size profiled, and the "
                         "search tries sizes beyond those that fit (on a GPU, an out-of-memory error). Fix: "
                         "timing='benchmark' (each op timed alone) or 'estimate'; profile the size found with "
                         "timing='safe' afterwards if its op times matter.")
    libra_search, eager_search = _Bracket(budget_bytes), _Bracket(budget_bytes)
    profiled: list[tuple[int, int, int]] = []
    best: tuple[int, Plan, Profile] | None = None

    def measure(size: int) -> None:
        nonlocal best
        prof = _profile_at(make_step, size, warmup, fake, timing)
        if prof is None:
            libra_search.add(size, None, False)
            eager_search.add(size, None, False)
            if progress:
                progress(f"batch {size}: out of device memory while profiling")
            return
        planning = Planning(prof, host_bandwidth, _DECISIONS if decisions is None else decisions)
        minimum = planning.min_budget_bytes()
        # the line is drawn through the lowest peak the planner reaches, not its minimum with eager's peak:
        # at small sizes, where nothing is worth evicting, that minimum is eager's and bends the line
        lowest = planning.lowest_peak_bytes()
        made = None
        if minimum <= budget_bytes:
            try:
                made = plan(planning, budget_bytes, solver=solver)
            except BudgetInfeasibleError:
                made = None
        if made is not None and (best is None or size > best[0]):
            best = (size, made, prof)
        libra_search.add(size, lowest, made is not None)
        eager_search.add(size, prof.eager_peak_bytes, prof.eager_peak_bytes <= budget_bytes)
        profiled.append((size, prof.eager_peak_bytes, minimum))
        if progress:
            verdict = (f"fits (predicted step x{made.predicted_step_seconds / made.eager_step_seconds:.2f})"
                       if made is not None else "does not fit")
            progress(f"batch {size}: eager peak {format_bytes(prof.eager_peak_bytes)}, Libra's minimum "
                     f"{format_bytes(minimum)}: {verdict}")

    measure(start)
    if best is None:
        if not profiled:
            raise LibraError(
                f"libra.max_batch: batch {start} ran out of device memory while profiling one eager step. Fix: pass a "
                "smaller start."
            )
        minimum = profiled[0][2]
        raise BudgetInfeasibleError(
            f"libra.max_batch: expected batch {start} to fit {format_bytes(budget_bytes)} ({budget_bytes} bytes); the "
            f"smallest budget Libra plans for at batch {start} is {format_bytes(minimum)} ({minimum} bytes). Fix: pass "
            f"a budget of at least {minimum} bytes, or a smaller start.",
            budget_bytes=budget_bytes,
            min_budget_bytes=minimum,
        )
    searching = libra_search
    while len(libra_search.fits) < max_profiles:
        size = searching.next_size()
        if size is None and searching is libra_search:
            searching = eager_search
            eager_search.moves.clear()  # its own steps only, not the ones made for Libra's search
            size = eager_search.next_size()
        if size is None:
            break
        measure(size)
    batch, made, prof = best
    eager = eager_search.lo
    exact = libra_search.closed and (eager is None or eager_search.closed)
    if not exact:
        log.warning("max_batch: stopped after %d profiles before the largest size was confirmed; the answers (%d, "
                    "eager %s) may be too small. Pass a larger max_profiles.", len(libra_search.fits), batch, eager)
    ratio = made.predicted_step_seconds / made.eager_step_seconds
    log.info("max_batch: batch %d fits %s under a plan (predicted step x%.2f); eager fits %s; %d profiles",
             batch, format_bytes(budget_bytes), ratio, eager, len(libra_search.fits))
    return BatchFit(
        batch_size=batch,
        plan=made,
        profile=prof,
        predicted_ratio=ratio,
        eager_max_batch=eager,
        exact=exact,
        profiled=tuple(sorted(profiled)),
    )
