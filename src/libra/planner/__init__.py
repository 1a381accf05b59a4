"""Planner: a pure function from a Profile and a byte budget to a Plan. No torch device work."""

from __future__ import annotations

import logging
import time

import numpy as np

from libra.errors import BudgetInfeasibleError, LibraError
from libra.planner.problem import LARGE, Problem
from libra.planner.regions import (GRANULARITIES, analyse, innermost_calls, unprofiled_reserve,
                                   unprofiled_siblings)
from libra.planner.simulate import EARLY, PLAIN, SimResult, Simulator, State, is_hooked, kept_split, spans_delta
from libra.planner.solvers import milp, options
from libra.planner.solvers.effects import OFFLOAD, RECOMPUTE
from libra.planner.solvers.lowest import full_state, hook_lowest, without_idle_units
from libra.planner.types import PLAN_SCHEMA_VERSION, Decision, Plan, RegionPlan
from libra.profiler.types import Profile
from libra.units import format_bytes, parse_bytes

__all__ = ["plan", "Plan", "Decision", "RegionPlan", "PLAN_SCHEMA_VERSION", "Planning"]

log = logging.getLogger("libra")

_SOLVERS = ("greedy", "milp")

# NOTE [Safety margin]: the simulator knows when autograd lets go of a storage and when Python let go of what the
# forward made (NOTE [Python's hold] in profiler/recorder.py), but not every reference a replay's Python keeps.
# Plans keep 1% of eager's activation bytes under the budget where that costs nothing: a budget at least that far
# above the lowest peak the planner reaches is planned against the budget less the margin; a budget closer to it is
# planned against the lowest peak itself (the target never falls as the budget rises, so larger budgets are never
# slower). The minimum the planner names is that lowest peak, the least of every plan the solver can return
# (``Planning._lowest_of``): on the test and benchmark models the meter measures it to the byte or below (the tests
# run every model at its named minimum), and it is what per-block checkpointing reaches where the planner's plan is
# that checkpointing.
SAFETY_MARGIN = 0.01

# NOTE [Layers the profiled step skipped]: with layer drop (Whisper's, stochastic depth) the profiled step skips some
# layers that later steps run. Under a plan that checkpoints anything, the runtime runs such a layer recomputed whole
# (NOTE [Unprofiled siblings] in runtime/apply.py), where plain checkpoint replays its twin exactly, so it holds its
# input (and its checkpoint's generator state) from its forward to its backward, its backward replays it whole, and
# makes gradients for its parameters: bytes the profiled step never held. Plans reserve them where a later step would
# hold them (``regions.unprofiled_reserve``): spans added to every curve the simulator draws, so the planner's peak,
# the named minimum and the predicted peak include them. The layer runs between its called siblings, so its input is
# held from the first sibling's forward to the end of their ancestor's backward, its gradients live from the start of
# that backward on, and its replay falls between its neighbours' backward, right before the one before it in the
# forward begins: each part is needed (without the gradients or the replay a step that runs every layer goes over
# its minimum), and charging all of it at every op instead would name a minimum far above what such a step holds.
# A layer whose twin plain checkpoint cannot replay exactly (a random op handed its own generator), or a step under
# a plan that checkpoints nothing (a budget above eager's peak with the reserve), runs as it is, which no reserve
# covers.

_CHEAPEST_ROUNDS = 8  # trims of the lowest-peak plan at its own peak, while they gain (Selection._cheapest_at)


_DECISIONS = frozenset({"keep", "recompute", "offload"})


def _host_bandwidth(profile: Profile, host_bandwidth: float | None) -> float | None:
    """Bytes per second to and from host memory: the argument, else the profile's (measured by the profiler on
    CUDA), else None (on CPU there is no separate host memory: offloading is modelled only when a bandwidth is
    given). Never a device call: a CUDA profile plans on a machine without CUDA."""
    if host_bandwidth is not None:
        if isinstance(host_bandwidth, bool) or not isinstance(host_bandwidth, (int, float)) or host_bandwidth <= 0:
            raise LibraError(
                f"libra.plan: host_bandwidth should be a positive number of bytes per second, got {host_bandwidth!r}."
            )
        return float(host_bandwidth)
    return profile.host_bandwidth or None


class Selection:
    """One choice of regions over a profile (NOTE [Region granularity] in ``regions.py``): its decision units, their
    simulator, and its options and family of plans, built when first asked for."""

    def __init__(self, profile: Profile, granularity: str, host_bandwidth: float | None, kinds: tuple,
                 reserve: list[tuple[int, int, int]] = ()) -> None:
        self.granularity = granularity
        self.kinds = kinds
        self.units, self.rejected = analyse(profile, granularity)
        self.sim = Simulator(profile, self.units, host_bandwidth, reserve)
        self._problem: Problem | None = None
        self._family: options.Family | None = None
        self._full_state: State | None = None
        self._lowest_state: State | None = None
        self._minimum: tuple[State, SimResult] | None = None

    @property
    def keys(self) -> tuple:
        return tuple((u.module, u.call) for u in self.units)

    @property
    def full_state(self) -> State:
        """Every candidate of every unit evicted ({} when the planner may only keep)."""
        if self._full_state is None:
            self._full_state = full_state(self.sim, self.kinds) if self.kinds else {}
        return self._full_state

    @property
    def full(self) -> SimResult:
        return self.sim.run(self.full_state)

    @property
    def lowest_state(self) -> State:
        """The full state less every unit whose checkpointing does not lower its peak (the last block in forward,
        replayed as soon as backward starts, typically): the lowest peak, for less time."""
        if self._lowest_state is None:
            state = without_idle_units(self.sim, self.full_state) if self.full_state else {}
            self._lowest_state = state
        return self._lowest_state

    @property
    def lowest(self) -> SimResult:
        return self.sim.run(self.lowest_state)

    @property
    def minimum(self) -> tuple[State, SimResult]:
        """The plan of the lowest peak found here, and its result: the lowest state (units turned hooked where that
        lowers the peak, NOTE [Hooked regions]), or, with both mechanisms, the same from offloading's own full
        state where that ends lower; then each unit takes its cheapest option at that peak (:meth:`_cheapest_at`,
        plain calls included): the searches look for the lowest peak, not the cheapest plan that has it. Where
        keeping some activations lowers the peak further (a kept one spares a replay at the peak's moment), the
        option family's lowest member is lower and :meth:`Planning._lowest_of` takes it."""
        if self._minimum is None:
            starts = [self.lowest_state]
            if OFFLOAD in self.kinds and len(self.kinds) > 1:
                # offloading alone can end lower once calls are hooked, though recompute's full state starts lower
                alone = full_state(self.sim, (OFFLOAD,))
                starts.append(without_idle_units(self.sim, alone) if alone else {})
            best = None
            for state in starts:
                got = self.sim.run(state)
                if OFFLOAD in self.kinds:
                    state, got = hook_lowest(self.sim, state)
                if best is None or (got.peak_bytes, got.added_seconds) < (best[1].peak_bytes, best[1].added_seconds):
                    best = (state, got)
            self._minimum = self._cheapest_at(*best)
        return self._minimum

    def _cheapest_at(self, state: State, got: SimResult) -> tuple[State, SimResult]:
        """``state`` with each unit moved to its cheapest option that keeps the simulated peak at ``got``'s (the
        option family's trim, repeated while it gains); ``state`` itself where one of its entries is no option, and
        in large selections, where a trim's dense spans cost too much (``problem.LARGE``)."""
        if len(self.units) > LARGE:
            return state, got
        problem = self.problem
        for _ in range(_CHEAPEST_ROUNDS):
            choice = problem.choice_of(state)
            if choice is None:
                break
            live, _ = self.sim.live(state)
            trimmed = problem.state(options.trim(problem, got.peak_bytes, choice, live)[0])
            after = self.sim.run(trimmed)
            if after.peak_bytes > got.peak_bytes or after.added_seconds >= got.added_seconds:
                break
            state, got = trimmed, after
        return state, got

    @property
    def family(self) -> options.Family:
        """The option family and its chains (NOTE [Option family] in ``solvers/options.py``)."""
        if self._family is None:
            self._family = options.Family(self.problem,
                                          self.minimum[1].peak_bytes if len(self.units) > LARGE else None)
        return self._family

    @property
    def problem(self) -> Problem:
        """The units' options and their measured effects (NOTE [Options per unit] in ``problem.py``)."""
        if self._problem is None:
            self._problem = Problem(self.sim, self.kinds)
        return self._problem


class Planning:
    """The analysis of one profile, reused across budgets: regions, simulator, options and families of plans.

    The profile is analysed with each region granularity (NOTE [Region granularity]); ``selections`` holds the
    distinct ones, finest first, and :func:`plan` takes the faster plan among them. ``units``, ``sim``
    and ``full_state`` are the finest selection's.

    Args:
        profile: from :func:`libra.profile`.
        host_bandwidth: bytes per second to and from host memory (see :func:`plan`).
        decisions: the decisions the planner may use, a non-empty subset of ``{"keep", "recompute", "offload"}``.
        granularities: the region granularities to analyse (default: all of ``GRANULARITIES``).
        held: ``(first op, last op, bytes)``: memory a step holds beyond the profiled one whatever the plan, over
            those ops of the profiled step (a trainer's gradients and optimizer state: NOTE [Trainer steps] in
            integrations/_steps.py); the planner's peaks, the named minimum and the predicted peak include it.
    """

    def __init__(self, profile: Profile, host_bandwidth: float | None = None,
                 decisions=("keep", "recompute", "offload"), granularities=GRANULARITIES,
                 held: list[tuple[int, int, int]] = ()) -> None:
        if not isinstance(profile, Profile):
            raise LibraError(
                f"libra.plan: expected a libra.Profile from libra.profile(model, step), got {type(profile).__name__}."
            )
        self.granularities = tuple(granularities)
        chosen = frozenset(decisions) if not isinstance(decisions, str) else frozenset({decisions})
        if not chosen or not chosen <= _DECISIONS:
            raise LibraError(
                f"libra.plan: decisions should be a non-empty subset of {{'keep', 'recompute', 'offload'}}, got "
                f"{sorted(chosen) if chosen else decisions!r}."
            )
        self.profile = profile
        self.decisions = chosen
        self.host_bandwidth = _host_bandwidth(profile, host_bandwidth)
        kinds = [k for k in (RECOMPUTE, OFFLOAD) if k in chosen]
        if OFFLOAD in kinds and self.host_bandwidth is None:
            kinds.remove(OFFLOAD)
        if not kinds and "keep" not in chosen:
            raise LibraError(
                f"libra.plan: decisions={{'offload'}} needs a host link's bandwidth, and the profile has none measured "
                f"(its device is {profile.device}). Fix: pass host_bandwidth=... in bytes per second."
            )
        self.kinds = tuple(kinds)
        # NOTE [Layers the profiled step skipped]
        siblings = unprofiled_siblings(profile)
        self.unprofiled = sorted(siblings)
        reserve = unprofiled_reserve(profile, siblings)
        self.held = [(int(a), int(b), int(x)) for a, b, x in held if x > 0]
        self.selections: list[Selection] = []
        for granularity in self.granularities:
            sel = Selection(profile, granularity, self.host_bandwidth, self.kinds, reserve + self.held)
            if all(sel.keys != other.keys for other in self.selections):
                self.selections.append(sel)
        first = self.selections[0]
        self.units, self.rejected, self.sim = first.units, first.rejected, first.sim
        self.eager = self.sim.run({})
        # the most the reserve for skipped layers adds at any op (for messages)
        self.reserve_bytes = int(np.cumsum(spans_delta(reserve, len(profile.ops))).max())

    @property
    def full_state(self) -> State:
        return self.selections[0].full_state

    @property
    def full(self) -> SimResult:
        return self.selections[0].full

    def matches(self, host_bandwidth, decisions, granularities=GRANULARITIES) -> bool:
        want = frozenset(decisions) if not isinstance(decisions, str) else frozenset({decisions})
        return (want == self.decisions and tuple(granularities) == self.granularities
                and (host_bandwidth is None or float(host_bandwidth) == self.host_bandwidth))

    @property
    def margin_bytes(self) -> int:
        return int(SAFETY_MARGIN * max(self.profile.eager_peak_bytes - self.profile.static_bytes, 0))

    def _lowest_of(self, sel: Selection) -> tuple[State, SimResult]:
        """The lowest-peak plan of ``sel`` among every plan :meth:`solve` can return from it: ``Selection.minimum``
        or, where one ends lower, the option family's lowest member (the family plans a budget with its cheapest
        member that fits, so a member below ``minimum`` would plan under the named minimum)."""
        if "keep" not in self.decisions or not self.kinds:
            return sel.full_state, sel.full
        state, got = sel.minimum
        if sel.family.members:
            _, peak, member = min(sel.family.members, key=lambda m: (m[1], m[0]))
            if peak < got.peak_bytes:
                state, got = member, sel.sim.run(member)
        return state, got

    @property
    def lowest(self) -> Selection:
        """The selection that reaches the lowest peak (the first among equals)."""
        return min(self.selections, key=lambda sel: self._lowest_of(sel)[1].peak_bytes)

    def lowest_state(self) -> State:
        """The plan state of the lowest peak the planner reaches, in :attr:`lowest`."""
        return self._lowest_of(self.lowest)[0]

    def lowest_peak_bytes(self) -> int:
        """The lowest peak the planner reaches (``Selection.minimum`` of the best selection; with only
        ``"offload"``/``"recompute"`` allowed, every candidate evicted)."""
        return self._lowest_of(self.lowest)[1].peak_bytes

    def min_budget_bytes(self) -> int:
        """The smallest budget :func:`plan` accepts for this profile."""
        return min(self.lowest_peak_bytes(), self.eager.peak_bytes)

    def target_bytes(self, budget: int) -> int:
        """The peak the simulator must find for a plan for ``budget`` (NOTE [Safety margin]; NOTE [Layers the
        profiled step skipped])."""
        return max(budget - self.margin_bytes, min(budget, self.lowest_peak_bytes()))

    def solve(self, budget: int, solver: str = "greedy", time_limit: float = 60.0) -> tuple[Selection, State] | None:
        """The fastest plan for ``budget`` bytes among the selections, as ``(selection, state)``; None when none
        fits. Equal predicted times go to the finer selection."""
        if "keep" in self.decisions and budget >= self.eager.peak_bytes:
            return self.selections[0], {}  # everything kept: no need for the lowest peak or the solvers
        best = None
        target = self.target_bytes(budget)
        for sel in self.selections:
            state = self._solve_in(sel, budget, target, solver, time_limit)
            if state is None:
                continue
            added = sel.sim.run(state).added_seconds
            if best is None or added < best[0]:
                best = (added, sel, state)
        return None if best is None else (best[1], best[2])

    def _solve_in(self, sel: Selection, budget: int, target: int, solver: str, time_limit: float) -> State | None:
        if "keep" not in self.decisions:
            return sel.full_state if sel.full.peak_bytes <= target else None
        if budget >= self.eager.peak_bytes:
            return {}
        if not self.kinds:
            return None
        if solver == "milp":
            # the exact reference starts from nothing the greedy found (NOTE [Exact up to interactions])
            choice = milp.solve(sel.problem, target, time_limit=time_limit)
            state = None if choice is None else sel.problem.state(choice)
            if state is None and sel.minimum[1].peak_bytes <= target:
                log.info("libra.plan: no choice of the exact solver's options fits %s in the %s selection; the "
                         "lowest-peak plan does and is used", format_bytes(target), sel.granularity)
                state = sel.minimum[0]
            return state
        # each candidate is the cheapest fitting plan of a budget-independent family, so the cheapest of them is too
        # (NOTE [Monotone in the budget] in solvers/options.py): the option family's, with its chains (NOTE [Option
        # family]), and the lowest state (the growth starts from eager, the lowest plan from every candidate evicted:
        # below the family's lowest peak only it may fit)
        low_state, low = sel.minimum
        found = [sel.family.solve(target), low_state if low.peak_bytes <= target else None]
        costs = [(sel.sim.run(s).added_seconds, i) for i, s in enumerate(found) if s is not None]
        return found[min(costs)[1]] if costs else None

    # ---- building the Plan ---------------------------------------------------------------------------------
    def _op_keys(self) -> list[str]:
        """A readable, stable key per op: ``"blocks.3.attn:aten.mm.default#2"`` (``[k]`` marks a module's k-th call)."""
        ops = self.profile.ops
        owner = innermost_calls(self.profile)
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

    def _stay_ordinals(self, unit, shared) -> list[int]:
        """A hooked unit's saves that stay on the device (``RegionPlan.stay``): ordinals among the saves of storages
        the call makes, in pack order, of those that escape it and are not ``shared`` with other hooked calls
        (NOTE [Shared hooked storages]); none where its calls differ (the escaping ones are then copied too: link
        time for nothing, never a wrong value)."""
        packs, storages = self.profile.packs, self.profile.storages
        found = None
        for inst in unit.instances:
            escapes = {s: e for s, e in zip(inst.sids, inst.escapes)}
            ordinals = []
            j = 0
            for pi in inst.packs:
                s = packs[pi].storage
                if storages[s].static or s not in escapes:
                    continue  # a parameter, buffer or input: the runtime leaves it alone and does not count it
                if escapes[s] and s not in shared:
                    ordinals.append(j)
                j += 1
            if found is not None and ordinals != found:
                return []
            found = ordinals
        return found or []

    @staticmethod
    def _prefetch_after(sel: Selection, ui: int, early: bool) -> list:
        """``RegionPlan.prefetch_after`` of unit ``ui`` (NOTE [Prefetch] in simulate.py)."""
        p = sel.sim.prefetch_trigger[ui]
        return [sel.units[p].module, sel.units[p].call] if early and p >= 0 else []

    def build(self, state: State, budget: int, result: SimResult, solver: str, seconds: float,
              selection: Selection | None = None) -> Plan:
        """The Plan of ``state`` over ``selection``'s units (default: the finest selection)."""
        sel = selection or self.selections[0]
        units = sel.units
        prof = self.profile
        recomputed_ops: set[int] = set()
        offloaded_ops: set[int] = set()
        shared, offload_inputs = sel.sim.hook_sharing(state)
        offloaded_ops.update(prof.storages[s].producer for s in shared if prof.storages[s].producer >= 0)
        regions = []
        for ui in sorted(state, key=lambda u: units[u].instances[0].start):
            unit = units[ui]
            plain = state[ui] == PLAIN
            hooked = is_hooked(state[ui])
            on_device, offloaded = kept_split(state[ui])
            saved = set() if plain or hooked else unit.forced_save | on_device | offloaded
            for ii, inst in enumerate(unit.instances):
                if hooked:  # what it saves goes to host memory, but what escapes it (NOTE [Hooked regions])
                    offloaded_ops.update(inst.start + inst.producer[k] for k in range(len(inst.sids))
                                         if inst.packed[k] and not inst.escapes[k])
                    if ui in offload_inputs:
                        offloaded_ops.update(prof.storages[s].producer for s in sel.sim.own_input_packs(ui, ii)
                                             if prof.storages[s].producer >= 0)
                    continue
                recomputed_ops.update(inst.start + j for j in range(len(unit.op_names)) if j not in saved)
                offloaded_ops.update(inst.start + j for j in offloaded)
            regions.append(
                RegionPlan(
                    module=unit.module,
                    call=unit.call,
                    ops=list(unit.op_names),
                    save=sorted(saved),
                    offload=sorted(offloaded),
                    protect={} if hooked else {k: list(v) for k, v in sorted(unit.protect.items())},
                    input_shapes=[list(s) for s in unit.input_shapes],
                    skip=[] if plain or hooked else sorted(sel.sim.skip_of(ui, saved)),
                    plain=plain,
                    hooked=hooked,
                    stay=self._stay_ordinals(unit, shared) if hooked else [],
                    offload_inputs=hooked and ui in offload_inputs,
                    plain_ok=unit.plain_ok,
                    prefetch_after=self._prefetch_after(sel, ui, EARLY in state[ui] and (hooked or bool(offloaded))),
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
        where = self._moment(state, result.peak_op, sel)
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
            refused=self.refusals(sel),
            allowed=sorted(self.decisions),
            host_bandwidth=self.host_bandwidth or 0.0,
            granularity=sel.granularity,
            provenance=self.provenance(),
            unprofiled=list(self.unprofiled),
        )

    def provenance(self) -> dict[str, str]:
        """``Plan.provenance``: the profile's, with whether the host link's bandwidth was given or measured."""
        out = {k: str(v) for k, v in self.profile.provenance.items()}
        if self.host_bandwidth is None:
            out["host_bandwidth"] = "none"
        elif self.host_bandwidth != self.profile.host_bandwidth:
            out["host_bandwidth"] = "given"
        else:
            out["host_bandwidth"] = "measured"
        return out

    def split(self, state: State, t: int, selection: Selection | None = None) -> dict[str, int]:
        """What is live at op ``t`` under ``state``, by kind: parameters, gradients, buffers, other static tensors
        (optimizer state, inputs), activations, the op's own temporaries."""
        sel = selection or self.selections[0]
        prof = self.profile
        names = {sid: name for sid, name in prof.static_names}
        out = {"parameters": 0, "gradients": 0, "buffers": 0, "other static": 0, "activations": 0,
               "kernel temporaries": prof.ops[t].transient_bytes if 0 <= t < len(prof.ops) else 0}
        for ui, nbytes in sel.sim.replays_at(state, t):
            out["activations"] += nbytes
        for sid, nbytes in sel.sim.live_at(state, t):
            name = names.get(sid, "")
            if name.startswith("gradient of "):
                out["gradients"] += nbytes
            elif name.startswith("buffer "):
                out["buffers"] += nbytes
            elif name:
                out["parameters"] += nbytes
            elif prof.storages[sid].static:
                out["other static"] += nbytes
            elif self._made_gradient(sid):
                out["gradients"] += nbytes
            else:
                out["activations"] += nbytes
        return out

    def _made_gradient(self, sid: int) -> bool:
        """A storage backward made that outlives the step: a parameter's gradient, as far as the profile tells."""
        prof = self.profile
        rec = prof.storages[sid]
        return rec.producer >= 0 and prof.ops[rec.producer].backward and rec.free_op >= len(prof.ops)

    def refusals(self, selection: Selection | None = None) -> list[list]:
        """``[module, call, reason]`` of each module call ``selection`` (by default the first) left out, once per
        module call, in forward order; calls that save nothing for backward are not refusals (nothing to gain)."""
        sel = selection or self.selections[0]
        calls = self.profile.module_calls
        out: dict[tuple[str, int], str] = {}
        for ci in sorted(sel.rejected):
            reason = sel.rejected[ci]
            if reason == "autograd saves nothing inside it":
                continue
            out.setdefault((calls[ci].module, calls[ci].call), reason)
        return [[m, c, r] for (m, c), r in out.items()]

    def _moment(self, state: State, t: int, sel: Selection) -> str:
        """Where op ``t`` is, in words; a replay that runs right before it (NOTE [Replay moment]) and makes the peak
        there is named."""
        prof = self.profile
        if not prof.ops:
            return "no ops"
        op = prof.ops[t]
        where = (f"op #{t} {op.name} in {'backward' if op.backward else 'forward'}"
                 f"{' of ' + repr(op.module) if op.module else ''}")
        replays = sel.sim.replays_at(state, t)
        if replays:
            where = f"the replay of {sel.units[replays[0][0]].module!r} before {where}"
        return where

    def contributors(self, state: State, t: int, limit: int = 5, selection: Selection | None = None) -> list[str]:
        """The biggest storages live at op ``t`` under ``state`` over ``selection``'s units, as readable lines."""
        sel = selection or self.selections[0]
        prof = self.profile
        keys = self._op_keys()
        lines = []
        for ui, nbytes in sel.sim.replays_at(state, t):
            lines.append((nbytes, f"{format_bytes(nbytes):>10}  the replay of {sel.units[ui].module!r} (what it "
                                  "recomputes)"))
        names = {sid: name for sid, name in prof.static_names}
        for sid, nbytes in sel.sim.live_at(state, t)[:limit]:
            rec = prof.storages[sid]
            if rec.producer >= 0 and self._made_gradient(sid):
                what = f"a gradient made in backward ({prof.ops[rec.producer].name})"
            elif rec.producer >= 0:
                what = keys[rec.producer]
            elif sid in names:
                what = names[sid]
            elif rec.static:
                what = "static: an input, optimizer state or another tensor live before the step"
            else:
                what = "opaque"
            lines.append((nbytes, f"{format_bytes(nbytes):>10}  {what}"))
        transient = prof.ops[t].transient_bytes if 0 <= t < len(prof.ops) else 0
        if transient:  # NOTE [Transient bytes] in planner/simulate.py
            lines.append((transient, f"{format_bytes(transient):>10}  the temporary memory of {prof.ops[t].name} itself"))
        return [line for _, line in sorted(lines, key=lambda x: -x[0])[:limit]]


def plan(
    profile: Profile,
    budget: int | str,
    *,
    solver: str = "greedy",
    host_bandwidth: float | None = None,
    decisions=None,
    time_limit: float = 60.0,
    granularity: str | None = None,
) -> Plan:
    """Decides, for every saved activation, whether to keep, recompute or offload it, so a step fits ``budget``.

    Pure: reads the profile only, touches no device, and gives the same plan for the same profile and budget.

    Args:
        profile: from :func:`libra.profile`.
        budget: the peak of all live tensor bytes allowed during one step, static bytes included: an int of bytes
            or a string such as ``"6GiB"`` or ``"800MB"``. Never a fraction.
        solver: ``"greedy"`` (fast, the default) or ``"milp"``: the exact reference, one program over each module
            call's options solved with SciPy's HiGHS, independent of the greedy (NOTE [Exact up to interactions]
            in ``solvers/milp.py``; small and medium profiles).
        host_bandwidth: bytes per second between device and host memory, each way. Default: the profile's
            ``host_bandwidth``, which the profiler measures on a CUDA device (pinned copies, the slower direction);
            on CPU, where host and device memory are one, offloading is planned only when a bandwidth is given (to
            test and compare the mechanism).
        decisions: the decisions allowed, a non-empty subset of ``{"keep", "recompute", "offload"}`` (default: all
            three). Without ``"keep"``, every candidate activation is evicted.
        time_limit: seconds the ``"milp"`` solver may take.
        granularity: plan over one region granularity, ``"fine"`` or ``"blocks"`` (NOTE [Region granularity]), as
            ``Plan.granularity`` records; default: each, and the faster plan is taken.

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
    if granularity is not None and granularity not in GRANULARITIES:
        raise LibraError(f"libra.plan: unknown granularity {granularity!r}; expected one of "
                         f"{', '.join(GRANULARITIES)}, or None for each.")
    granularities = GRANULARITIES if granularity is None else (granularity,)
    t0 = time.perf_counter()
    if isinstance(profile, Planning) and (
        (host_bandwidth is None and decisions is None and granularity is None)
        or profile.matches(host_bandwidth, decisions or _DECISIONS, granularities)
    ):
        planning = profile  # reuse its analysis and options
    else:
        base = profile.profile if isinstance(profile, Planning) else profile
        planning = Planning(base, host_bandwidth, _DECISIONS if decisions is None else decisions, granularities,
                            held=profile.held if isinstance(profile, Planning) else ())
    found = planning.solve(budget_bytes, solver, time_limit)
    if found is None:
        minimum = planning.min_budget_bytes()
        low = planning.lowest
        state = planning.lowest_state()
        peak_op = low.sim.run(state).peak_op
        lines = planning.contributors(state, peak_op, selection=low)
        split = planning.split(state, peak_op, selection=low)
        at_peak = ", ".join(f"{k} {format_bytes(v)}" for k, v in split.items() if v)
        static = planning.profile.static_bytes
        refused = planning.refusals(low)
        left_out = ""
        if refused:
            left_out = (f"Left out of the plan ({len(refused)}):\n  " + "\n  ".join(
                f"{m}{f'[{c}]' if c else ''}: {r}" for m, c, r in refused[:8]) + ("\n  ..." if len(refused) > 8 else "")
                + "\n")
        if minimum >= planning.eager.peak_bytes:
            fix = (f"Fix: Libra cannot lower this step's peak at all (nothing it may recompute or offload is live "
                   f"then); pass a budget of at least {minimum} bytes, or lower what is live then (the batch, or "
                   "the static bytes: parameters, gradients, optimizer state).")
        elif split["activations"] < 0.5 * sum(split.values()):
            fix = (f"Fix: pass a budget of at least {minimum} bytes; most of that peak is parameters, gradients, "
                   "optimizer state and inputs, which Libra does not recompute or offload: a lighter optimizer, "
                   "lower-precision parameters or sharding (FSDP) lower it; a smaller batch lowers only the rest.")
        else:
            fix = f"Fix: pass a budget of at least {minimum} bytes, or lower the batch size."
        raise BudgetInfeasibleError(
            f"libra.plan: no plan keeps the step under {format_bytes(budget_bytes)} ({budget_bytes} bytes); the "
            f"smallest peak this planner reaches is {format_bytes(minimum)} ({minimum} bytes), of which "
            f"{format_bytes(static)} were live before the step began (parameters, gradients, optimizer state, "
            f"inputs). At that peak: {at_peak}. Biggest tensors live then:\n  " + "\n  ".join(lines) + "\n"
            + left_out + (f"It includes up to {format_bytes(planning.reserve_bytes)} reserved for "
                          f"{', '.join(planning.unprofiled)}, which the profiled step skipped (layer drop, or a "
                          "branch its inputs did not take) and later steps may run.\n"
                          if planning.reserve_bytes else "") + fix,
            budget_bytes=budget_bytes,
            min_budget_bytes=minimum,
        )
    sel, state = found
    result = sel.sim.run(state)
    seconds = time.perf_counter() - t0
    out = planning.build(state, budget_bytes, result, solver, seconds, sel)
    counts = out.counts
    log.info(
        "planned in %.3f s: %d kept / %d recomputed, predicted peak %s of budget %s",
        seconds,
        counts[Decision.KEEP],
        counts[Decision.RECOMPUTE],
        format_bytes(out.predicted_peak_bytes),
        format_bytes(budget_bytes),
    )
    if planning.reserve_bytes:
        log.info("reserved up to %s of the budget for %s, which the profiled step skipped (layer drop, or a branch "
                 "its inputs did not take: Longformer's global attention): a step that runs them recomputes them "
                 "whole and holds their inputs", format_bytes(planning.reserve_bytes),
                 ", ".join(planning.unprofiled))
    if out.refused:
        log.info("left out of the plan: %s", "; ".join(
            f"{m}{f'[{c}]' if c else ''} ({r})" for m, c, r in out.refused))
    return out
