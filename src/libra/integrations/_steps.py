"""Plans for a training step that a trainer runs, made before each new kind of step runs (NOTE [Trainer steps]).

NOTE [Trainer steps]: a trainer calls one training step (forward and backward of one micro-batch) again and again;
what changes between calls is the input signature (a batch padded to another length) and the static memory: after
the first optimizer step the optimizer holds its state, and with gradient accumulation every micro-batch after the
first starts with the gradients of the ones before. Before a step with a new input signature runs, the callback
profiles it on fake tensors (NOTE [Fake profiles] in profiler/fake.py: no eager memory, nothing trained, the RNG
untouched), so the step itself already runs under a plan. For static memory that grew since the profile (gradients
and optimizer state held on the model's device), the same profile is planned again with the growth held over the
ops that hold it (``Planning(held=...)``): each op of the step then holds at most that much more than in the profiled
step (a gradient that exists is accumulated in place, one that does not is allocated, so growth never lowers the
curve). Optimizer state is held through the step; so are gradients the step accumulates into, but gradients the
loop sets to None between the forward and the backward (Lightning, at the first micro-batch of each accumulation
window) are held through the forward only, and the backward makes new ones, as the profiled step did: counted
through the step instead, they made a plan planned for a peak in the backward one gradient set more cautious than
it needed to be. Planning is pure, so this costs no step. Plans are cached per (signature, growth): a run has a
handful. A step that cannot run fake (a data-dependent op) is profiled for real, once per signature, with a warning:
that step runs eagerly.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import torch

from libra._ops import input_signature, storage_key
from libra.errors import BudgetInfeasibleError, LibraError
from libra.planner import Planning, plan as make_plan
from libra.planner.types import Decision, Plan
from libra.api import profile
from libra.profiler import model_device
from libra.profiler.types import Profile
from libra.api import apply
from libra.units import format_bytes, parse_bytes

log = logging.getLogger("libra")

__all__ = ["AppliedPlan", "StepPlans", "held_bytes"]


def held_bytes(model: torch.nn.Module, optimizer, device: torch.device) -> int:
    """Bytes of the gradients of ``model``'s parameters and of ``optimizer``'s state on ``device`` (distinct
    storages): the static memory a training loop adds between steps."""
    return sum(_held(model, optimizer, device))


def _held(model: torch.nn.Module, optimizer, device: torch.device) -> tuple[int, int]:
    """:func:`held_bytes` as (gradients, optimizer state), a storage both hold counted once, with the gradients."""
    seen: dict[int, int] = {}
    parts = [0, 0]

    def add(t, part: int) -> None:
        if isinstance(t, torch.Tensor) and t.device == device:
            key = storage_key(t)
            if key is not None and key not in seen:
                seen[key] = t.untyped_storage().nbytes()
                parts[part] += seen[key]

    for p in model.parameters():
        add(p.grad, 0)
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict):
                for value in entry.values():
                    add(value, 1)
    return parts[0], parts[1]


class AppliedPlan:
    """The ``libra.apply`` block a trainer's steps run in, kept open while the plan stays the same."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self._context = None

    def enter(self, model: torch.nn.Module, plan: Plan) -> None:
        if self.plan is not plan:
            self.leave()
            context = apply(model, plan)
            context.__enter__()
            self._context, self.plan = context, plan

    def leave(self) -> None:
        context, self._context, self.plan = self._context, None, None
        if context is not None:
            context.__exit__(None, None, None)


class _Profiled:
    __slots__ = ("profile", "held", "plans")

    def __init__(self, profile: Profile, held: tuple[int, int]) -> None:
        self.profile = profile
        self.held = held  # (gradients, optimizer state) bytes when it was profiled
        # by growth since then: (bytes held through the whole step, bytes held until the backward begins)
        self.plans: dict[tuple[int, int], Plan] = {}


class StepPlans:
    """The plans of one training run, per input signature and static growth (NOTE [Trainer steps]).

    Args:
        budget: the peak allowed during one training step, static bytes included: bytes or a string like ``"20GiB"``.
        fake: profile new steps on fake tensors (default); ``False`` profiles them for real (the step runs eagerly).
        real_fallback: whether a step that cannot run fake may be profiled for real instead (it then runs only once, in
            its profile: the caller must not run it again); without, it raises :class:`LibraError`.
        solver: passed to :func:`libra.plan`.
        max_signatures: profiles kept; the least recently used is dropped past it.
        what: the name used in messages.
    """

    def __init__(self, budget, *, fake: bool = True, solver: str = "greedy", max_signatures: int = 8,
                 what: str = "LibraCallback", real_fallback: bool = True) -> None:
        self.what = what
        self.budget_bytes = parse_bytes(budget, what=f"{what}: budget")
        if solver not in ("greedy", "milp"):
            raise LibraError(f"{what}: expected solver \"greedy\" or \"milp\", got {solver!r}.")
        if not isinstance(max_signatures, int) or max_signatures < 1:
            raise LibraError(f"{what}: expected max_signatures >= 1, got {max_signatures!r}.")
        self.fake = bool(fake)
        self.real_fallback = real_fallback
        self.solver = solver
        self.max_signatures = max_signatures
        self.profiled: collections.OrderedDict[tuple[str, ...], _Profiled] = collections.OrderedDict()
        self.steps_planned = 0
        self.profiles_made = 0

    def _key(self, model, optimizer, args, kwargs) -> tuple[tuple[str, ...], tuple[int, int]]:
        return tuple(input_signature(args, kwargs)), _held(model, optimizer, model_device(model))

    def cached(self, model: torch.nn.Module, optimizer, args, kwargs, grads_freed: bool = False) -> Plan | None:
        """The plan for a step whose root call gets ``args`` and ``kwargs``, if one needs no profiling.
        ``grads_freed``: the loop sets the gradients to None between the forward and the backward (Lightning, at
        the first micro-batch of each accumulation window: NOTE [Trainer steps])."""
        signature, (grads, state) = self._key(model, optimizer, args, kwargs)
        entry = self.profiled.get(signature)
        if entry is None:
            return None
        self.profiled.move_to_end(signature)
        more_grads, more_state = max(grads - entry.held[0], 0), max(state - entry.held[1], 0)
        growth = (more_state, more_grads) if grads_freed else (more_state + more_grads, 0)
        plan = entry.plans.get(growth)
        if plan is None:
            plan = entry.plans[growth] = self._plan(entry.profile, growth, signature)
        return plan

    def plan_for(self, model: torch.nn.Module, optimizer, args, kwargs, run: Callable[[], object],
                 grads_freed: bool = False):
        """The plan for the step ``run()`` is about to be (its root call gets ``args`` and ``kwargs``), profiling it
        first if its signature is new. Nothing of Libra's may be applied to ``model`` while this runs.

        Returns ``(plan, None, False)``, or ``(None, result, True)`` when ``run()`` already ran while it was profiled
        for real (its result is ``result``).

        Raises:
            BudgetInfeasibleError: no plan fits the budget for this step; raised before the step allocates anything.
        """
        plan = self.cached(model, optimizer, args, kwargs, grads_freed)
        if plan is not None:
            return plan, None, False
        signature, held = self._key(model, optimizer, args, kwargs)
        prof, result, ran = self._profile(model, run, signature)
        self.profiled[signature] = _Profiled(prof, held)
        while len(self.profiled) > self.max_signatures:
            self.profiled.popitem(last=False)
        if self.profiles_made == 4 * self.max_signatures:
            log.warning("libra: %s: the training inputs changed shape %d times; each new shape is profiled "
                        "before it runs. Fix: pad batches to a few lengths (e.g. pad_to_multiple_of=64 in "
                        "the data collator).", self.what, self.profiles_made)
        if ran:
            return None, result, True
        return self.cached(model, optimizer, args, kwargs, grads_freed), None, False

    def _profile(self, model, run, signature) -> tuple[Profile, object, bool]:
        self.profiles_made += 1
        t0 = time.perf_counter()
        if self.fake:
            try:
                prof = profile(model, run, fake=True)
                log.info("libra: %s: profiled the training step with inputs %s on fake tensors in %.1f s",
                         self.what, list(signature), time.perf_counter() - t0)
                return prof, None, False
            except LibraError as e:
                if not self.real_fallback:
                    raise LibraError(
                        f"{self.what}: expected the training step to run on fake tensors, to plan it before it "
                        f"runs, but it cannot: {e}"
                    ) from e
                log.warning("libra: %s: the training step cannot run on fake tensors (%s); this step runs "
                            "eagerly, without a plan, while it is profiled (eager's memory).",
                            self.what, str(e).splitlines()[0])
        box = []
        prof = profile(model, lambda: box.append(run()))
        log.info("libra: %s: profiled the training step with inputs %s for real in %.1f s",
                 self.what, list(signature), time.perf_counter() - t0)
        return prof, box[0] if box else None, True

    def _plan(self, prof: Profile, growth: tuple[int, int], signature) -> Plan:
        """The plan for ``prof`` with ``growth``: bytes held through the whole step (optimizer state, gradients that
        are accumulated into), and bytes held until the backward begins (gradients the loop sets to None then)."""
        whole, until_backward = growth
        held = [(0, prof.n_ops, whole), (0, max(prof.first_backward_op - 1, 0), until_backward)]
        total = whole + until_backward
        planning = Planning(prof, held=held)
        try:
            plan = make_plan(planning, self.budget_bytes, solver=self.solver)
        except BudgetInfeasibleError as e:
            held_text = "" if not total else (
                f" (gradients and optimizer state added {format_bytes(total)} since the step was profiled: an "
                "optimizer like AdamW holds twice the parameters' bytes after its first step)")
            need = e.min_budget_bytes
            # the planner's own advice repeats the figure; the message gives it once, with what to do
            said = str(e).split("\nFix:")[0]
            raise BudgetInfeasibleError(
                f"{self.what}: expected the training step with inputs {list(signature)} to fit the budget "
                f"{format_bytes(self.budget_bytes)} ({self.budget_bytes} bytes), but the lowest peak Libra can plan "
                f"for it is {need} bytes ({format_bytes(need)}){held_text}. Fix: pass budget={need} or more, or lower "
                f"the batch size (libra.max_batch finds the largest that fits). The planner said: {said}",
                budget_bytes=self.budget_bytes, min_budget_bytes=need,
            ) from e
        self.steps_planned += 1
        log.info("libra: %s: planned the training step with inputs %s: budget %s%s, predicted peak %s, "
                 "%d recomputed / %d offloaded", self.what, list(signature), format_bytes(self.budget_bytes),
                 f" with {format_bytes(whole)} of gradients and optimizer state held through the step"
                 + (f" and {format_bytes(until_backward)} of gradients until its backward" if until_backward else "")
                 if total else "", format_bytes(plan.predicted_peak_bytes),
                 plan.counts[Decision.RECOMPUTE], plan.counts[Decision.OFFLOAD])
        if not plan.regions:
            log.info("libra: %s: the budget is above this step's peak: nothing to recompute or offload (a budget "
                     "below %s makes Libra save memory)", self.what, format_bytes(planning.eager.peak_bytes))
        return plan
