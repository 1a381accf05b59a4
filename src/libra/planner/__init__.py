"""Planner: a pure function from a Profile and a byte budget to a Plan. No torch device work."""

from __future__ import annotations

import logging
import time

from libra.errors import BudgetInfeasibleError, LibraError
from libra.planner.regions import Unit, analyse
from libra.planner.simulate import PLAIN, SimResult, Simulator, State, kept_split
from libra.planner.solvers import front, greedy, milp
from libra.planner.types import PLAN_SCHEMA_VERSION, Decision, Plan, RegionPlan
from libra.profiler.types import Profile
from libra.units import format_bytes, parse_bytes

__all__ = ["plan", "Plan", "Decision", "RegionPlan", "PLAN_SCHEMA_VERSION", "Planning"]

log = logging.getLogger("libra")

_SOLVERS = ("greedy", "milp")

# NOTE [Safety margin]: the simulator knows when autograd lets go of a storage, but not every Python reference (a
# local variable of a forward that is still running). Measured on the test models, this leaves the prediction under
# the measured peak by at most about 0.5% of eager's activation bytes. Plans are made against the budget less 1% of
# eager's activation bytes, so the measured peak stays under the budget; the reported minimum includes the margin.
SAFETY_MARGIN = 0.01


_DECISIONS = frozenset({"keep", "recompute", "offload"})


def _host_bandwidth(profile: Profile, host_bandwidth: float | None) -> float | None:
    """Bytes per second to and from host memory: the argument, else measured once on CUDA, else None (on CPU
    there is no separate host memory: offloading is modelled only when a bandwidth is given)."""
    if host_bandwidth is not None:
        if isinstance(host_bandwidth, bool) or not isinstance(host_bandwidth, (int, float)) or host_bandwidth <= 0:
            raise LibraError(
                f"libra.plan: host_bandwidth should be a positive number of bytes per second, got {host_bandwidth!r}."
            )
        return float(host_bandwidth)
    if profile.device.startswith("cuda"):
        from libra.runtime.offload import measured_host_bandwidth

        return measured_host_bandwidth(profile.device)
    return None


class Planning:
    """The analysis of one profile, reused across budgets: regions, simulator, solver effects.

    Args:
        profile: from :func:`libra.profile`.
        host_bandwidth: bytes per second to and from host memory (see :func:`plan`).
        decisions: the decisions the planner may use, a non-empty subset of ``{"keep", "recompute", "offload"}``.
    """

    def __init__(self, profile: Profile, host_bandwidth: float | None = None,
                 decisions=("keep", "recompute", "offload")) -> None:
        if not isinstance(profile, Profile):
            raise LibraError(
                f"libra.plan: expected a libra.Profile from libra.profile(model, step), got {type(profile).__name__}."
            )
        chosen = frozenset(decisions) if not isinstance(decisions, str) else frozenset({decisions})
        if not chosen or not chosen <= _DECISIONS:
            raise LibraError(
                f"libra.plan: decisions should be a non-empty subset of {{'keep', 'recompute', 'offload'}}, got "
                f"{sorted(chosen) if chosen else decisions!r}."
            )
        self.profile = profile
        self.decisions = chosen
        self.host_bandwidth = _host_bandwidth(profile, host_bandwidth)
        kinds = [k for k in (greedy.RECOMPUTE, greedy.OFFLOAD) if k in chosen]
        if greedy.OFFLOAD in kinds and self.host_bandwidth is None:
            kinds.remove(greedy.OFFLOAD)
        if not kinds and "keep" not in chosen:
            raise LibraError(
                "libra.plan: decisions={'offload'} needs a host_bandwidth on a device without one measured (CPU). "
                "Fix: pass host_bandwidth=... in bytes per second."
            )
        self.kinds = tuple(kinds)
        self.units, self.rejected = analyse(profile)
        self.sim = Simulator(profile, self.units, self.host_bandwidth)
        self.eager = self.sim.run({})
        self._effects: greedy.Effects | None = None
        self._full_state: State | None = None

    @property
    def full_state(self) -> State:
        """Every candidate evicted: the lowest peak the planner reaches ({} when it may only keep)."""
        if self._full_state is None:
            self._full_state = greedy.full_state(self.sim, self.kinds) if self.kinds else {}
        return self._full_state

    @property
    def full(self) -> SimResult:
        return self.sim.run(self.full_state)

    @property
    def effects(self) -> greedy.Effects:
        if self._effects is None:
            self._effects = greedy.Effects(self.sim, self.kinds)
        return self._effects

    def matches(self, host_bandwidth, decisions) -> bool:
        want = frozenset(decisions) if not isinstance(decisions, str) else frozenset({decisions})
        return want == self.decisions and (host_bandwidth is None or float(host_bandwidth) == self.host_bandwidth)

    @property
    def margin_bytes(self) -> int:
        return int(SAFETY_MARGIN * max(self.profile.eager_peak_bytes - self.profile.static_bytes, 0))

    def min_budget_bytes(self) -> int:
        """The smallest budget :func:`plan` accepts for this profile."""
        return min(self.full.peak_bytes + self.margin_bytes, self.eager.peak_bytes)

    # ---- building the Plan ---------------------------------------------------------------------------------
    def _op_keys(self) -> list[str]:
        """A readable, stable key per op: ``"blocks.3.attn:aten.mm.default#2"`` (``[k]`` marks a module's k-th call)."""
        ops = self.profile.ops
        owner = [-1] * len(ops)
        for ci in sorted(range(len(self.profile.module_calls)), key=lambda i: self.profile.module_calls[i].depth):
            c = self.profile.module_calls[ci]
            for i in range(c.start_op, c.end_op):
                owner[i] = ci
        counts: dict[tuple[int, str], int] = {}
        keys = []
        for i, o in enumerate(ops):
            ci = owner[i]
            if ci >= 0:
                c = self.profile.module_calls[ci]
                where = c.module + (f"[{c.call}]" if c.call else "") + (f"~{c.root_call}" if c.root_call else "")
            else:
                where = "~backward" if o.backward else ""
            occ = counts.get((ci, o.name), 0)
            counts[(ci, o.name)] = occ + 1
            keys.append(f"{where}:{o.name}#{occ}")
        return keys

    def build(self, state: State, budget: int, result: SimResult, solver: str, seconds: float) -> Plan:
        prof = self.profile
        recomputed_ops: set[int] = set()
        offloaded_ops: set[int] = set()
        regions = []
        for ui in sorted(state, key=lambda u: self.units[u].instances[0].start):
            unit = self.units[ui]
            plain = state[ui] == PLAIN
            on_device, offloaded = kept_split(state[ui])
            saved = set() if plain else unit.forced_save | on_device | offloaded
            for inst in unit.instances:
                recomputed_ops.update(inst.start + j for j in range(len(unit.op_names)) if j not in saved)
                offloaded_ops.update(inst.start + j for j in offloaded)
            regions.append(
                RegionPlan(
                    module=unit.module,
                    call=unit.call,
                    ops=list(unit.op_names),
                    save=sorted(saved),
                    offload=sorted(offloaded),
                    protect={k: list(v) for k, v in sorted(unit.protect.items())},
                    input_shapes=[list(s) for s in unit.input_shapes],
                    skip=[] if plain else sorted(self.sim.skip_of(ui, saved)),
                    plain=plain,
                )
            )
        keys = self._op_keys()
        decisions: dict[str, Decision] = {}
        for p in prof.packs:
            producer = prof.storages[p.storage].producer
            if producer < 0 or prof.ops[producer].backward:
                continue
            if producer in recomputed_ops:
                decision = Decision.RECOMPUTE
            elif producer in offloaded_ops:
                decision = Decision.OFFLOAD
            else:
                decision = Decision.KEEP
            decisions.setdefault(keys[producer], decision)
        op = prof.ops[result.peak_op] if prof.ops else None
        where = (
            f"op #{result.peak_op} {op.name} in {'backward' if op.backward else 'forward'}"
            f"{' of ' + repr(op.module) if op.module else ''}"
            if op
            else "no ops"
        )
        return Plan(
            budget_bytes=budget,
            predicted_peak_bytes=result.peak_bytes,
            predicted_step_seconds=prof.eager_step_seconds + result.added_seconds,
            eager_peak_bytes=prof.eager_peak_bytes,
            eager_step_seconds=prof.eager_step_seconds,
            static_bytes=prof.static_bytes,
            device=prof.device,
            solver=solver,
            decisions=decisions,
            regions=regions,
            parameters=[tuple(p) for p in prof.parameters],
            peak_op=result.peak_op,
            peak_description=where,
            planner_seconds=seconds,
            input_signature=list(prof.input_signature),
        )

    def contributors(self, state: State, t: int, limit: int = 5) -> list[str]:
        """The biggest storages live at op ``t``, as readable lines."""
        prof = self.profile
        keys = self._op_keys()
        lines = []
        for sid, nbytes in self.sim.live_at(state, t)[:limit]:
            rec = prof.storages[sid]
            what = keys[rec.producer] if rec.producer >= 0 else ("static (parameters, gradients, inputs...)" if rec.static else "opaque")
            lines.append(f"{format_bytes(nbytes):>10}  {what}")
        return lines


def plan(
    profile: Profile,
    budget: int | str,
    *,
    solver: str = "greedy",
    host_bandwidth: float | None = None,
    decisions=None,
    time_limit: float = 60.0,
) -> Plan:
    """Decides, for every saved activation, whether to keep, recompute or offload it, so a step fits ``budget``.

    Pure: reads the profile only, touches no device, and gives the same plan for the same profile and budget.

    Args:
        profile: from :func:`libra.profile`.
        budget: the peak of all live tensor bytes allowed during one step, static bytes included: an int of bytes
            or a string such as ``"6GiB"`` or ``"800MB"``. Never a fraction.
        solver: ``"greedy"`` (fast, the default) or ``"milp"`` (exact reference over the same model, SciPy's HiGHS;
            for small and medium profiles).
        host_bandwidth: bytes per second between device and host memory, each way. Default: measured once per
            CUDA device (pinned copies); on CPU, where host and device memory are one, offloading is planned only
            when a bandwidth is given (to test and compare the mechanism).
        decisions: the decisions allowed, a non-empty subset of ``{"keep", "recompute", "offload"}`` (default: all
            three). Without ``"keep"``, every candidate activation is evicted.
        time_limit: seconds the ``"milp"`` solver may take.

    Returns:
        A :class:`Plan`. When the budget is at or above the eager peak it keeps everything, and applying it installs
        nothing.

    Raises:
        BudgetInfeasibleError: no plan fits; ``min_budget_bytes`` is the smallest budget this planner can meet.
        LibraError: the budget does not parse, or the solver is unknown.

    Example:
        >>> plan = libra.plan(profile, budget="300MiB")
        >>> plan.predicted_peak_bytes <= 300 * 2**20
        True
    """
    budget_bytes = parse_bytes(budget, what="libra.plan: budget")
    if solver not in _SOLVERS:
        raise LibraError(f"libra.plan: unknown solver {solver!r}; expected one of {', '.join(_SOLVERS)}.")
    t0 = time.perf_counter()
    if isinstance(profile, Planning) and (
        (host_bandwidth is None and decisions is None) or profile.matches(host_bandwidth, decisions or _DECISIONS)
    ):
        planning = profile  # reuse its analysis and options
    else:
        base = profile.profile if isinstance(profile, Planning) else profile
        planning = Planning(base, host_bandwidth, _DECISIONS if decisions is None else decisions)
    target = budget_bytes - planning.margin_bytes
    state: State | None
    if "keep" not in planning.decisions:
        state = planning.full_state if planning.full.peak_bytes <= target else None
    elif budget_bytes >= planning.eager.peak_bytes:
        state = {}
    elif not planning.kinds:
        state = None
    elif solver == "milp":
        # NOTE [MILP incumbent]: the program is linear in the measured effects, the simulator is not (regions
        # interact), so HiGHS's optimum can simulate a hair slower than the greedy's plan, or the program can miss a
        # plan the simulator accepts. The greedy's verified plan is the incumbent; the cheaper simulated one wins.
        state = milp.solve(planning.sim, target, planning.effects, time_limit=time_limit)
        incumbent = greedy.solve(planning.sim, target, planning.effects)
        if incumbent is not None and (
            state is None or planning.sim.run(incumbent).added_seconds < planning.sim.run(state).added_seconds
        ):
            state = incumbent
    else:
        state = greedy.solve(planning.sim, target, planning.effects)
    if state is None:
        minimum = planning.min_budget_bytes()
        lines = planning.contributors(planning.full_state, planning.full.peak_op)
        static = planning.profile.static_bytes
        raise BudgetInfeasibleError(
            f"libra.plan: no plan keeps the step under {format_bytes(budget_bytes)} ({budget_bytes} bytes); the "
            f"smallest peak this planner reaches is {format_bytes(minimum)} ({minimum} bytes), of which "
            f"{format_bytes(static)} were live before the step began (parameters, gradients, optimizer state, "
            f"inputs). Biggest tensors live at that peak:\n  " + "\n  ".join(lines) + "\n"
            f"Fix: pass a budget of at least {minimum} bytes, or lower the batch size.",
            budget_bytes=budget_bytes,
            min_budget_bytes=minimum,
        )
    if state and solver == "milp":  # the greedy's family has plain variants already (NOTE [Plain regions])
        state = front.plainify(planning.sim, state, target)[0]
    result = planning.sim.run(state)
    seconds = time.perf_counter() - t0
    out = planning.build(state, budget_bytes, result, solver, seconds)
    counts = out.counts
    log.info(
        "planned in %.3f s: %d kept / %d recomputed, predicted peak %s of budget %s",
        seconds,
        counts[Decision.KEEP],
        counts[Decision.RECOMPUTE],
        format_bytes(out.predicted_peak_bytes),
        format_bytes(budget_bytes),
    )
    return out
