"""``libra.profile`` and ``libra.apply``: what joins the profiler, the planner and the runtime.

The flow is profiler -> Profile -> planner -> Plan -> runtime, and none of the three imports a later one; this
module sits above them. ``profile`` is the profiler's recording of one step with the runtime's calibrations added
(what a plan will cost to run on the device: the region executor's per-op cost, a clone's cost per byte, measured
by the runtime's own code). ``apply`` is the runtime's with a replanner: a step whose inputs no plan was made for
is recorded by the profiler and planned by the planner, as the plan in force was (NOTE [Plans per input
signature] in runtime/apply.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from libra.errors import BudgetInfeasibleError, LibraError
from libra.planner import Planning
from libra.planner import plan as make_plan
from libra.planner.types import Plan
from libra.profiler import FakeStep, StepRecording, dispatch_overhead_seconds, model_device, retime
from libra.profiler.fake import benchmark_ops
from libra.profiler.timed import StepTimer, align, first_difference
from libra.profiler.types import Profile
from libra.runtime.apply import apply as _runtime_apply
from libra.runtime.calibrate import step_calibrations
from libra.units import format_bytes

__all__ = ["profile", "apply"]

log = logging.getLogger("libra")


def profile(model: torch.nn.Module, step: Callable[[], object], *, fake: bool | str | torch.device = False,
            timing: str = "benchmark") -> Profile:
    """Runs ``step()`` once under recording and returns what it did.

    ``step`` is one training step's forward and backward (``loss_fn(model(x), y).backward()``); its gradients,
    buffer updates and RNG draws happen exactly as in a plain call. Profile after a warm-up step if the optimizer
    creates state lazily, so that the static bytes include it.

    With ``fake=True`` the step runs on fake tensors (NOTE [Fake profiles] in profiler/fake.py): it needs none of
    eager's memory, trains nothing (gradients, buffers and the RNG are left as they were), and each distinct op is
    then timed alone on real tensors of its recorded shapes, which also measures its temporary memory. Use it when
    the eager step does not fit, or to plan for input shapes before any step runs with them. ``fake="cpu"`` or
    ``fake="cuda:0"`` names the device: a model built on ``meta`` (no memory for its weights) is then profiled as if
    its parameters lived there.

    Args:
        model: the module whose submodules may later be recomputed.
        step: a callable running one forward and backward.
        fake: run the step on fake tensors: ``True`` on the model's device, or on the device named.
        timing: with ``fake``, how op times are found: ``"benchmark"`` (each distinct op run alone at its recorded
            shapes, which also measures its temporary memory) or ``"estimate"`` (from each op's floating-point
            operations and bytes at the device's measured rates, running nothing at those shapes: for steps too big
            to time op by op; NOTE [Estimated op times] in profiler/fake.py), or ``"safe"``: the step runs once for
            real under the fake profile's lowest-peak plan, every module call recomputed (about half of eager's
            activation memory), and each op takes its time and temporaries from there (NOTE [Safe timing] in
            profiler/timed.py). That step trains as a plain call would (gradients, buffers, the RNG); where its ops
            are not the fake step's, each op is benchmarked instead, with a warning.

    Returns:
        A :class:`Profile`.

    Raises:
        LibraError: ``model`` is not a module or ``step`` not callable; with ``fake=True``, an op of the step cannot
            run on fake tensors (named, with its module). Whatever ``step`` raises propagates unchanged, with every
            hook removed.

    Example:
        >>> prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
        >>> prof.eager_peak_bytes > prof.static_bytes
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise LibraError(f"libra.profile: expected a torch.nn.Module, got {type(model).__name__}.")
    if not callable(step):
        raise LibraError(f"libra.profile: expected a callable step, got {type(step).__name__}.")
    if timing not in ("benchmark", "estimate", "safe"):
        raise LibraError(f"libra.profile: timing should be 'benchmark', 'estimate' or 'safe', got {timing!r}.")
    device = model_device(model)
    if timing == "safe" and device.type == "meta":
        raise LibraError("libra.profile: timing='safe' runs the step once for real, and the model's parameters are on "
                         "'meta' (no values). Fix: build the model on its device, or pass timing='benchmark'.")
    if fake is not False and fake is not True:
        try:
            device = torch.device(fake)
        except (RuntimeError, TypeError) as e:
            raise LibraError(f"libra.profile: fake should be True or a device such as 'cpu' or 'cuda:0', got "
                             f"{fake!r} ({e}).") from e
    if device.type == "meta":
        raise LibraError(
            "libra.profile: the model's parameters are on 'meta' (no values, no device): expected the device the "
            "step will run on. Fix: profile it fake there, libra.profile(model, step, fake='cuda:0') or fake='cpu'."
        )
    if timing != "benchmark" and not fake:
        raise LibraError(f"libra.profile: timing={timing!r} is for fake profiles; a real step times its own ops. "
                         "Fix: pass fake=True, or leave timing as it is.")
    fake_step = None
    if fake is not False:
        dispatch_overhead_seconds()  # measured on real tensors, before the fake mode is entered
        fake_step = FakeStep(model, device, timing)
        fake_step.__enter__()
    recording = StepRecording(model, fake=fake_step, calibrate=step_calibrations)
    try:
        recording.start()
        step()
        recording.stop()
    except BaseException:
        recording.abort()
        raise
    finally:
        if fake_step is not None:
            fake_step.__exit__(None, None, None)
    prof = recording.finish()
    if timing == "safe":
        _time_safely(model, step, prof, recording)
    return prof


def _time_safely(model: torch.nn.Module, step: Callable[[], object], prof: Profile,
                 recording: StepRecording) -> None:
    """NOTE [Safe timing] in profiler/timed.py: op times (and temporaries) from one real step under the fake
    profile's lowest-peak recompute plan; where that step's ops are not the profile's, each op is benchmarked alone
    instead."""
    planning = Planning(prof, decisions=("recompute",))
    sel = planning.lowest
    state = sel.lowest_state
    result = sel.sim.run(state)
    lowest = planning.build(state, result.peak_bytes, result, "timing", 0.0, sel)
    timer = StepTimer(recording.device)
    with _runtime_apply(model, lowest, on_over_budget="raise", replanner=None):
        with timer:
            step()
    names = [o.name for o in prof.ops]
    found = align(names, timer)
    if found is None:
        log.warning("libra.profile(timing='safe'): the timed step's ops are not the fake step's (%s); timing each op "
                    "alone instead (timing='benchmark')", first_difference(names, timer))
        seconds, transient = benchmark_ops(recording.calls, recording.device)
        retime(prof, seconds, transient, "benchmark")
        return
    seconds, transient = found
    if transient is None:
        log.warning("libra.profile(timing='safe'): the allocator was not watched during the timed step (another "
                    "profiler is running?); kernels' temporary memory is not measured in this profile")
    retime(prof, seconds, transient, "safe")
    log.info("libra.profile: op times from one real step with every module call recomputed (peak %s predicted, "
             "eager's %s)", format_bytes(result.peak_bytes), format_bytes(prof.eager_peak_bytes))


class _Replanner:
    """Records a step with new inputs and plans it under the plan in force's budget, solver, allowed decisions and
    host link (``runtime.apply.Replanner``)."""

    def record(self, model: torch.nn.Module) -> StepRecording:
        return StepRecording(model, root_entered=True, calibrate=step_calibrations)

    def plan(self, recording: StepRecording, base: Plan, signature: list[str]) -> Plan:
        prof = recording.finish()
        # older plan files record no decisions or host link: the defaults
        how = {"solver": base.solver if base.solver in ("greedy", "milp") else "greedy",
               "decisions": base.allowed or None, "host_bandwidth": base.host_bandwidth or None,
               "granularity": base.granularity or None}
        try:
            return make_plan(prof, base.budget_bytes, **how)
        except BudgetInfeasibleError as e:
            log.warning("libra: with inputs %s no plan fits the budget %s; using the smallest peak the planner "
                        "reaches, %s.", signature, format_bytes(base.budget_bytes), format_bytes(e.min_budget_bytes))
            return make_plan(prof, e.min_budget_bytes, **how)


def apply(model: torch.nn.Module, plan, *, on_over_budget: str = "raise", replan: bool = True, max_plans: int = 4):
    """Runs the steps inside the ``with`` block under ``plan``.

    The model is the user's own: Libra replaces the ``forward`` of the planned modules by an instance attribute and
    adds a forward pre-hook and a forward hook to the root; all are removed on exit, also when the block raises.
    When the plan keeps everything, only the root hooks that check each step's inputs are installed (none with
    ``replan=False``). ``LIBRA_DISABLE=1`` makes it a no-op; ``LIBRA_DEBUG=1`` logs every op the planned modules
    run, in forward and in replay, and whether it was saved, offloaded, recomputed or taken from the cache.

    A step whose inputs differ in dtype or shape from those a plan was made for never runs under it. Pass one plan
    per input signature you train with (a list; plan the others ahead from ``libra.profile(..., fake=True)``, which
    needs no memory). A step with inputs none of them was made for raises :class:`UnplannedInputsError` before it
    allocates anything (``on_over_budget="raise"``); with ``"warn"`` it runs without recompute while Libra profiles
    it, over the budget, and later steps with those inputs run under a plan of their own made for the same budget
    (one warning per new input signature).

    Args:
        model: the model the plans were made for (same parameter names, shapes and dtypes).
        plan: from :func:`libra.plan` or :meth:`libra.Plan.load`, or a list of them for several input signatures
            (the first is the one steps with unrecorded signatures fall back to).
        on_over_budget: ``"raise"`` (default) or ``"warn"``: what a step that cannot be kept under the budget does.
        replan: with ``on_over_budget="warn"``, profile and plan steps with new input signatures (default); with
            False they run plainly.
        max_plans: how many plans made on the fly (one per input signature) are kept; the least recently used is
            dropped.

    Raises:
        PlanMismatchError: a plan was made for another model; the message names the first differing tensor.
        UnplannedInputsError: (from the step) its inputs have no plan and ``on_over_budget="raise"``.
        LibraError: ``apply`` is already active on this model, or the arguments are of the wrong type.

    Example:
        >>> with libra.apply(model, plan):
        ...     for x, y in loader:
        ...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """
    return _runtime_apply(model, plan, on_over_budget=on_over_budget, max_plans=max_plans,
                          replanner=_Replanner() if replan else None)
