"""The memory timeline of one step: live bytes after every op, eagerly and under a plan, from the simulator.

A :class:`~libra.planner.types.Plan` holds decisions, not the profile's storage timeline, so drawing it needs the
profile it was planned from. :func:`state_of` maps the plan's regions back to the simulator's state (the inverse of
``Planning.build``); :func:`memory_timeline` runs the simulator on that state and on ``{}`` (eager). Pure, like the
rest of the planner: no device work (except measuring the host link on CUDA for an offloading plan, as ``plan`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.errors import LibraError
from libra.planner import _host_bandwidth
from libra.planner.regions import GRANULARITIES, Unit, analyse
from libra.planner.simulate import EARLY, HOOKED, PLAIN, Simulator, State
from libra.planner.types import Plan
from libra.profiler.types import Profile

__all__ = ["Timeline", "memory_timeline", "state_of"]

_FIX = "Fix: pass the profile the plan was planned from (the profile.json given to `libra plan`)."


@dataclass(frozen=True)
class Timeline:
    """Live bytes on the device after each op of one step, eagerly and under a plan.

    Attributes:
        eager_bytes: live bytes after op ``i`` in eager PyTorch; index ``n_ops`` is after the step.
        plan_bytes: the same under the plan.
        op_start_seconds: when each op starts in the eager step (index ``n_ops``: the step's end).
        first_backward_op: index of the first backward op (``n_ops`` when the step has none).
        budget_bytes / static_bytes: the plan's budget, and the bytes live when the step began.
    """

    eager_bytes: tuple[int, ...]
    plan_bytes: tuple[int, ...]
    op_start_seconds: tuple[float, ...]
    first_backward_op: int
    budget_bytes: int
    static_bytes: int

    @property
    def n_ops(self) -> int:
        return len(self.eager_bytes) - 1

    @property
    def eager_peak_op(self) -> int:
        return max(range(len(self.eager_bytes)), key=self.eager_bytes.__getitem__)

    @property
    def plan_peak_op(self) -> int:
        return max(range(len(self.plan_bytes)), key=self.plan_bytes.__getitem__)


def state_of(plan: Plan, units: list[Unit]) -> State:
    """The simulator state a plan encodes: the inverse of ``Planning.build`` over the same profile's units.

    Args:
        plan: from :func:`libra.plan` or ``Plan.load``.
        units: the decision units of the profile it was planned from (``Planning(profile).units``).

    Returns:
        unit index -> kept candidates (``j`` on the device, ``~j`` offloaded), as the solvers produce it;
        ``PLAIN`` for a plain region, ``HOOKED`` for a hooked one; ``EARLY`` in it where the offloads come back at
        a prefetch trigger (NOTE [Prefetch] in simulate.py).

    Raises:
        LibraError: a region of the plan is no unit of this profile, or its ops differ (another profile).
    """
    index = {(u.module, u.call): ui for ui, u in enumerate(units)}
    state: State = {}
    for r in plan.regions:
        ui = index.get((r.module, r.call))
        if ui is None or list(units[ui].op_names) != list(r.ops):
            name = r.module + (f"[{r.call}]" if r.call else "")
            seen = "is not a region of this profile" if ui is None else "ran other ops when this profile was recorded"
            raise LibraError(f"libra.memory_timeline: the plan checkpoints module {name!r}, which {seen}. {_FIX}")
        early = frozenset({EARLY}) if r.prefetch_after else frozenset()
        if r.plain or r.hooked:
            state[ui] = PLAIN if r.plain else HOOKED | early
            continue
        unit = units[ui]
        save, offload = set(r.save), set(r.offload)
        kept = [j for j in unit.candidates if j in save and j not in offload]
        kept += [~j for j in sorted(offload)]
        state[ui] = frozenset(kept) | early
    return state


def memory_timeline(profile: Profile, plan: Plan, *, host_bandwidth: float | None = None) -> Timeline:
    """Simulates the step eagerly and under ``plan``, and returns both live-bytes curves.

    Args:
        profile: the profile ``plan`` was planned from.
        plan: from :func:`libra.plan` or ``Plan.load``.
        host_bandwidth: bytes per second to and from host memory, for a plan that offloads (see
            :func:`libra.plan`); on CUDA it is measured when not given.

    Returns:
        A :class:`Timeline`; the maximum of ``plan_bytes`` is the plan's ``predicted_peak_bytes``.

    Raises:
        LibraError: the plan was made from another profile, or it offloads on a device without a measured host link
            and no ``host_bandwidth`` was given.

    Example:
        >>> tl = memory_timeline(profile, plan)
        >>> max(tl.plan_bytes) == plan.predicted_peak_bytes
        True
    """
    if not isinstance(profile, Profile) or not isinstance(plan, Plan):
        raise LibraError(
            f"libra.memory_timeline: expected a libra.Profile and a libra.Plan, got {type(profile).__name__} and "
            f"{type(plan).__name__}."
        )
    if (profile.eager_peak_bytes, profile.static_bytes, profile.device) != (
        plan.eager_peak_bytes, plan.static_bytes, plan.device
    ):
        raise LibraError(
            f"libra.memory_timeline: the plan was made from a profile with eager peak {plan.eager_peak_bytes} and "
            f"static {plan.static_bytes} bytes on {plan.device}; this profile has {profile.eager_peak_bytes} and "
            f"{profile.static_bytes} bytes on {profile.device}. {_FIX}"
        )
    bandwidth = None
    if any(r.offload or r.hooked for r in plan.regions):
        bandwidth = _host_bandwidth(profile, host_bandwidth)
        if bandwidth is None:
            raise LibraError(
                "libra.memory_timeline: the plan offloads activations, but the profile has no host link measured "
                f"(its device is {profile.device}) and no host_bandwidth was given. Fix: pass host_bandwidth=... "
                "(bytes per second), the value the plan was made with."
            )
    # the plan was made over one of the region selections (NOTE [Region granularity]): the first that has all of
    # its regions (a unit in two selections is the same unit, so which one maps it makes no difference)
    error = None
    for granularity in GRANULARITIES:
        units, _ = analyse(profile, granularity)
        try:
            state = state_of(plan, units)
            break
        except LibraError as e:
            error = error or e
    else:
        raise error
    sim = Simulator(profile, units, bandwidth)
    eager, _ = sim.live({})
    planned, _ = sim.live(state)
    return Timeline(
        eager_bytes=tuple(int(b) for b in eager),
        plan_bytes=tuple(int(b) for b in planned),
        op_start_seconds=tuple(float(t) for t in sim.op_time),
        first_backward_op=profile.first_backward_op,
        budget_bytes=plan.budget_bytes,
        static_bytes=profile.static_bytes,
    )
