"""The simulator: replays a profile's storage timeline under a plan and predicts peak bytes and added seconds.

Everything the planner decides is judged by this one function; tests hold it against measurement. The memory model
of a checkpointed region is NOTE [Region model] in ``regions.py``.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import numpy as np

from libra.planner.regions import Unit
from libra.planner.replay import replay_skip
from libra.profiler.types import Profile

__all__ = ["Simulator", "SimResult", "State", "kept_split", "is_hooked", "spans_delta", "PLAIN", "HOOKED", "EARLY"]

# unit index -> the candidates (local op indices) whose outputs are kept: ``j`` keeps them on the device, ``~j``
# (that is -j-1) in host memory (offloaded). Candidates of a listed unit that are in neither form are recomputed.
State = dict[int, frozenset[int]]


# NOTE [Plain regions]: a unit whose entry is PLAIN runs under plain ``torch.utils.checkpoint``, without Libra's
# modes: nothing is cached (outputs that escape the call are recomputed too), no op is skipped, and it costs what
# checkpoint itself costs, which on a CPU is far less per op than the modes (runtime/calibrate.py). A unit that
# writes module state (BatchNorm's running statistics) replays under one light mode that gives those writes private
# copies (NOTE [Guarded replay] in runtime/region.py): its forward costs what plain checkpoint's does, each replayed
# op what Libra's replay mode costs (``plain_replay_op``): both are one dispatch mode under checkpoint's replay, which
# also routes the ``detach`` of each save through it, and they measure alike per op (``bench/executor_cost.py``'s
# ``guarded_plain`` variant, about twice plain checkpoint's replay). Units with a random op handed
# its own torch.Generator are never plain (checkpoint restores only the default generators, so the replay would
# draw other numbers).
PLAIN: frozenset[int] = frozenset({1 << 40})

# NOTE [Hooked regions]: a unit whose entry is HOOKED runs under saved-tensor hooks alone: no checkpoint, no
# dispatch mode, nothing recomputed. Every tensor autograd saves inside the call, except static tensors
# (parameters, buffers), what escapes it and its inputs, is copied to host memory when it is saved and copied back
# when the call starts its backward (its first unpack), or, early, when its prefetch trigger does (NOTE [Prefetch]). The device copy lives until the copy out is done and the forward no longer holds it; the copy back, until
# autograd releases the saving nodes (eager's free time). What escapes the call and its inputs go to host memory too
# where no call but hooked ones saves them (NOTE [Shared hooked storages]: ``hook_sharing``); else they stay on the
# device, as in eager (a block output the next, checkpointed, block caches), the escaping ones named by the plan
# (``stay``, ordinals in pack order) so the hooks never copy them. A unit may be hooked when every instance's
# saves are unpacked and the profile has plain-checkpoint costs, which stand for the hooks' own (a pack hook per
# saved tensor). It is what ``save_on_cpu`` does, with a pool of host buffers, copies that overlap compute, and per
# module call.
HOOKED: frozenset[int] = frozenset({1 << 41})
# An entry holding EARLY brings what the unit offloads back at its prefetch trigger, ahead of its own backward
# (NOTE [Prefetch]); without it, at the unit's own first unpack. ``HOOKED | EARLY`` is the early hooked entry.
EARLY: int = 1 << 42
_SENTINELS = 1 << 40


def is_hooked(cached: frozenset[int]) -> bool:
    return (1 << 41) in cached


def kept_split(cached: frozenset[int]) -> tuple[set[int], set[int]]:
    """(kept on the device, offloaded) local op indices of one unit's state entry."""
    if cached == PLAIN or is_hooked(cached):
        return set(), set()
    return {j for j in cached if 0 <= j < _SENTINELS}, {~j for j in cached if j < 0}

# Runtime cost model, per op dispatched through Libra's modes (in multiples of a do-nothing dispatch mode's cost),
# and per checkpointed region call (checkpoint's own bookkeeping, measured on CPU with torch 2.13).
MODE_OVERHEAD_FACTOR = 2.5
REGION_OVERHEAD_SECONDS = 120e-6
DEFAULT_COPY_BANDWIDTH = 10e9  # bytes per second of a clone, where the profile has no measurement

_RECENT = 8  # simulated curves remembered


class _ExactSum:
    """A sum of floats kept exactly (as an integer multiple of 2**-1100) and rounded once: the added seconds of a
    plan do not depend on the order its terms are visited in, so equal plans always predict equal times."""

    __slots__ = ("total",)
    _SHIFT = 1100

    def __init__(self) -> None:
        self.total = 0

    @classmethod
    def term(cls, x: float) -> int:
        """``x`` as the integer the sum adds."""
        num, den = float(x).as_integer_ratio()
        return num << (cls._SHIFT + 1 - den.bit_length())

    def add(self, x: float) -> None:
        num, den = float(x).as_integer_ratio()
        self.total += num << (self._SHIFT + 1 - den.bit_length())

    def value(self) -> float:
        return self.total / (1 << self._SHIFT)


class _UnitRecord:
    """One region unit's own part of a plan's changes (``Simulator._unit_record``); shared, never changed."""

    __slots__ = ("touched", "holders", "copies", "bursts", "held", "base", "lane", "exposed", "offloads")

    def __init__(self) -> None:
        self.touched: dict[int, None] = {}  # an ordered set
        self.holders: dict[int, int] = {}  # storage -> the latest end of the unit's holders of it (_hold)
        self.copies: list[list[int]] = []
        self.bursts: list[tuple[int, int, int]] = []
        self.held: list[tuple[int, int, int, int]] = []
        self.base = self.lane = self.exposed = 0  # _ExactSum totals
        self.offloads: list[tuple[int, int, float, int]] = []  # (instance, storage, seconds each way, end of copy)


def spans_delta(spans, n: int) -> np.ndarray:
    """``(first op, last op, bytes)`` spans as a difference array over the live curve's ``n + 1`` points (and one
    past): its cumulative sum is the bytes the spans add after each op."""
    delta = np.zeros(n + 2, dtype=np.int64)
    for first, last, nbytes in spans:
        delta[first] += nbytes
        delta[min(last, n) + 1] -= nbytes
    return delta


def _hold(holders: dict[int, int], s: int, end: int) -> None:
    """Storage ``s`` has one more holder, until op ``end``: only the latest end matters."""
    if end > holders.get(s, end - 1):
        holders[s] = end


@dataclass
class SimResult:
    peak_bytes: int
    peak_op: int
    added_seconds: float


# NOTE [Prefetch]: what a region call offloaded is copied back either when its own backward starts (its first
# unpack: no copy time hidden, no memory held ahead) or, where its entry holds EARLY, when a fixed call before it in
# backward order starts its backward: the call of the selection whose backward starts right before this one's,
# planned or not (the runtime watches an unplanned one with saved-tensor hooks that change nothing, TriggerRun in
# runtime/region.py). Both points are fixed, so what a unit's option adds does not depend on the other units'
# options: with the copy back at "the region replayed before it" the effects were not additive and no option program
# could be exact; with the trigger alone, a lone offloaded unit held its copies through its neighbour's backward and
# the lowest budgets of random DAG stacks with a fast link rose up to 5%. The runtime knows calls by (module, call
# within the root call), so the trigger is one unit for all of a unit's instances: where the call before instance
# ii is not instance ii of one same unit, a unit has no trigger and its copies come back at its own first unpack. A
# copy back that starts later than simulated holds less memory; the runtime never starts one earlier.
def prefetch_triggers(units: list[Unit]) -> tuple[list[int], dict[tuple[int, int], int]]:
    """NOTE [Prefetch]: per unit, the unit whose backward start brings its offloads back (-1: none, its own first
    unpack does), and per (unit, instance) that replays, the op where its copies start back."""
    order = sorted((inst.t_r, ui, ii) for ui, unit in enumerate(units)
                   for ii, inst in enumerate(unit.instances) if inst.t_r >= 0)
    before = {(u1, i1): (u0, i0) for (t0, u0, i0), (t1, u1, i1) in zip(order, order[1:]) if t0 < t1}
    trigger: list[int] = []
    at: dict[tuple[int, int], int] = {}
    for ui, unit in enumerate(units):
        first = next((before.get((ui, ii)) for ii, inst in enumerate(unit.instances) if inst.t_r >= 0), None)
        p = first[0] if first is not None else -1
        if p >= 0 and (len(units[p].instances) != len(unit.instances) or any(
                inst.t_r >= 0 and before.get((ui, ii)) != (p, ii) for ii, inst in enumerate(unit.instances))):
            p = -1
        trigger.append(p)
        for ii, inst in enumerate(unit.instances):
            if inst.t_r >= 0:
                at[(ui, ii)] = units[p].instances[ii].t_r if p >= 0 else inst.t_r
    return trigger, at


class Simulator:
    """Predicts the peak and the added time of any plan over one profile."""

    def __init__(self, profile: Profile, units: list[Unit], host_bandwidth: float | None = None,
                 reserve: list[tuple[int, int, int]] = ()) -> None:
        self.profile = profile
        self.units = units
        self.host_bandwidth = host_bandwidth  # bytes per second each way between device and host memory
        self.n = n = len(profile.ops)
        st = profile.storages
        self.nbytes = np.array([s.nbytes for s in st], dtype=np.int64)
        self.alloc = np.array([max(s.alloc_op, 0) for s in st], dtype=np.int64)
        self.free = np.array([min(max(s.free_op, s.alloc_op, 0), n) for s in st], dtype=np.int64)
        delta = np.zeros(n + 2, dtype=np.int64)
        np.add.at(delta, self.alloc, self.nbytes)
        np.add.at(delta, self.free + 1, -self.nbytes)
        # bytes a later step may hold that the profiled one never did, ``(first op, last op, bytes)``, whatever the
        # plan: on every curve (NOTE [Layers the profiled step skipped] in planner/__init__.py)
        delta += spans_delta(reserve, n)
        self.base_delta = delta
        # NOTE [Transient bytes]: what each op's kernels hold inside it above what it returns (workspaces,
        # temporaries), measured from the allocator by the profiler (NOTE [Allocator truth] in libra/_allocator.py).
        # It sits on top of the live bytes after the op, at that op only: in the forward, in backward and in every
        # replay of the op (``_replay``), whatever the plan. Profiles from before schema 2 have none.
        # NOTE [RNG state]: ``checkpoint(preserve_rng_state=True)`` stashes the CPU generator's state (a tensor of
        # ``profile.rng_state_bytes``, 5,056 B with torch 2.13) per checkpointed call, from the call's forward until
        # the checkpoint frame dies (``l_r``), and forks it once more while the call replays. Libra's modes keep one
        # more per random op they do not rerun (kept or skipped: the replay restores the generator as the op left
        # it), from that op until the frame dies. On a CUDA device those states live in host memory: the profile
        # then records 0. Plain calls keep only checkpoint's; hooked calls stash nothing.
        self.rng_state_bytes = int(profile.rng_state_bytes)
        self.transient = np.array([o.transient_bytes for o in profile.ops] + [0], dtype=np.int64)
        self._transient = self.transient.tolist()
        # NOTE [Untracked bytes]: some of an op's transient bytes are not its kernels' but memory no storage of the
        # profile accounts for that lives on across ops: the scalar of ``x.mul_(0.5)``, which Python's binding wraps
        # in a tensor before dispatch (no op returns it) and the op's autograd node keeps without a saved-tensor
        # hook, 8 bytes on a CPU from the op to its backward. It shows in the transient bytes of every op while it
        # lives, and ``OpRecord.untracked_bytes`` is what of it is left when the op returns. A replay makes such
        # memory again (the module's own Python runs again) and it coexists with what was left before the replay
        # began: ``_replay`` keeps the latter, and counts in the replayed ops only what was not carried into the
        # region from before it.
        self._untracked = [o.untracked_bytes for o in profile.ops] + [0]
        self.op_time = np.concatenate([[0.0], np.cumsum([o.seconds for o in profile.ops])])  # start time of each op
        # holders of each storage in eager (NOTE [Who holds a storage])
        last_use = np.full(len(st), -1, dtype=np.int64)
        for i, o in enumerate(profile.ops):
            if not o.backward:
                for s in o.inputs:
                    last_use[s] = i
        self.packs_of: dict[int, list[int]] = {}
        self.pack_end: list[int] = []
        for pi, p in enumerate(profile.packs):
            self.packs_of.setdefault(p.storage, []).append(pi)
            self.pack_end.append(p.last_unpack if p.last_unpack >= 0 else n)
        # Python's own hold on a storage autograd also saves, which eager hides behind the saves: the profiler records
        # when the last tensor object of it that a forward op returned died (a frame's local, a list the forward keeps
        # until it returns). A profile made by hand has no record: assume the innermost non-root module call that
        # produced the storage holds it to its end.
        call_end = np.full(n, -1, dtype=np.int64)
        for c in sorted(profile.module_calls, key=lambda c: c.depth):
            if c.parent != -1:
                call_end[c.start_op : c.end_op] = c.end_op - 1
        producer = np.array([s.producer for s in st], dtype=np.int64)
        held = np.array([s.held_op for s in st], dtype=np.int64)
        local_end = np.where(held >= 0, held, np.where(producer >= 0, call_end[np.maximum(producer, 0)], -1))
        self.python_end = np.where(
            [s in self.packs_of for s in range(len(st))],
            np.maximum(np.maximum(last_use, self.alloc), local_end),
            self.free,
        )
        self.pack_owner: dict[int, tuple[int, int]] = {}
        for ui, unit in enumerate(units):
            for ii, inst in enumerate(unit.instances):
                for pi in inst.packs:
                    self.pack_owner[pi] = (ui, ii)
        # NOTE [Region overhead] in runtime/calibrate.py: measured by the profiler; older and synthetic profiles
        # fall back to a multiple of the do-nothing dispatch mode's cost
        # (and then never plan plain regions, NOTE [Plain regions])
        costs = list(profile.region_costs)
        self.plain_costs: tuple[float, float, float] | None = None
        if len(costs) == 6:
            self.per_op, self.per_replay_op, self.per_call = costs[:3]
            self.plain_costs = (costs[3], costs[4], costs[5])
        else:
            self.per_op = self.per_replay_op = MODE_OVERHEAD_FACTOR * profile.dispatch_overhead_seconds
            self.per_call = REGION_OVERHEAD_SECONDS
        # NOTE [Copy cost]: seconds per byte of a clone on the device, measured by the profiler (a fresh buffer
        # each time, as the cache's clones are); older and synthetic profiles fall back to DEFAULT_COPY_BANDWIDTH
        self.copy_seconds_per_byte = profile.copy_seconds_per_byte or 1.0 / DEFAULT_COPY_BANDWIDTH
        self._hook_ok: dict[int, bool] = {}
        self.prefetch_trigger, self._prefetch_at = prefetch_triggers(units)  # NOTE [Prefetch]
        self._sharing: dict[frozenset[int], tuple[dict, set[int]]] = {}
        self._recent: dict[tuple, tuple[np.ndarray, float]] = {}
        self._unit_times: dict[tuple[int, frozenset[int]], tuple] = {}
        self._hooked_times: dict[frozenset, tuple[int, int, int]] = {}
        self._records: dict[tuple[int, frozenset[int]], _UnitRecord] = {}
        self._replays: dict[tuple, tuple[tuple | None, int]] = {}  # _replay's, per call and kept set
        # What holds each storage whatever the plan, for _plan's per-storage loop: its allocation, Python's last use
        # and the saves made outside every unit (``_fixed_end``), then the saves units make, latest first, as (end,
        # saving instance). A save holds its storage until autograd releases the node that holds it, which the
        # profiler records (NOTE [Release after unpack] in regions.py). Profiles made by hand have no record: for the
        # save unpacked last, the storage's eager free stands in, for the others their last unpack.
        packs = profile.packs
        self._fixed_end: list[int] = []
        self._owned_saves: list[tuple[tuple[int, tuple[int, int]], ...]] = []
        for s in range(len(st)):
            pis = self.packs_of.get(s, ())
            last = max((self.pack_end[pi] for pi in pis), default=-1)
            fixed = max(int(self.alloc[s]), int(self.python_end[s]))
            owned = []
            for pi in pis:
                if packs[pi].released_op >= 0:
                    end = packs[pi].released_op
                elif self.pack_end[pi] == last:
                    end = max(last, self.free[s])
                else:
                    end = self.pack_end[pi]
                owner = self.pack_owner.get(pi)
                if owner is None:
                    fixed = max(fixed, int(end))
                else:
                    owned.append((int(end), owner))
            self._fixed_end.append(fixed)
            self._owned_saves.append(tuple(sorted(owned, reverse=True)))
        self._exact_ops: dict[int, list[int]] = {}
        self._own_inputs: dict[tuple[int, int], dict[int, list[int]]] = {}
        # plain-Python copies for the per-storage loops (numpy scalar indexing is slow)
        self._nbytes = self.nbytes.tolist()
        self._alloc = self.alloc.tolist()
        self._free = self.free.tolist()
        self._op_time = self.op_time.tolist()
        allocated = np.zeros(n + 1, dtype=np.int64)  # bytes each op allocates (NOTE [Replay moment])
        made = np.array([s.alloc_op >= 0 for s in st], dtype=bool)
        np.add.at(allocated, self.alloc[made], self.nbytes[made])
        self._allocated_at = allocated.tolist()
        self._skips: dict[tuple[int, frozenset[int]], set[int]] = {}
        # per instance: local op -> positions (into inst.sids) of the storages it allocates
        self._outputs_of: list[list[dict[int, list[int]]]] = []
        for unit in units:
            per_inst = []
            for inst in unit.instances:
                by_op: dict[int, list[int]] = {}
                for k, local in enumerate(inst.producer):
                    by_op.setdefault(local, []).append(k)
                per_inst.append(by_op)
            self._outputs_of.append(per_inst)

    def _plan(self, state: State):
        """The plan's changes to the eager timeline, sparsely: changed storage intervals, extra copies, replay
        bursts, and the terms of the added seconds.

        NOTE [Who holds a storage]: in eager a storage lives until its last Python use or until every autograd save
        of it is unpacked, whichever is later. Under a plan, saves made inside a checkpointed region hold nothing;
        instead that region's frame holds its inputs, and Libra's cache the outputs of saved ops, until the
        region's last unpack. The forward copy of a storage lives until the last of its remaining holders.

        Returns ``(ends, copies, bursts, held, seconds)``: storage -> the end of its one live interval (it starts
        where eager allocates it) for every storage the plan touches; extra copies ``[start, end, storage]`` (a cache
        clone, a replayed escaping storage, a prefetched offload); ``(op, bytes, unit)`` replay peaks above the live bytes after ``op``
        (NOTE [Replay moment]); ``(start, end, bytes, unit)`` bytes a region call holds that are no storage of the
        profile (NOTE [RNG state]); and the added seconds. The cost is linear in
        the size of the units in ``state``, not in the length of the profile.
        """
        extra_copies: list[list[int]] = []
        bursts: list[tuple[int, int, int]] = []
        held: list[tuple[int, int, int, int]] = []
        base = _ExactSum()
        exposed = _ExactSum()
        lane = _ExactSum()
        active = {(ui, ii) for ui in state for ii in range(len(self.units[ui].instances))}
        holders: dict[int, int] = {}  # storage -> the latest end of the holders the plan adds (_hold)
        touched: dict[int, None] = {}
        self._hooked_part(state, touched, holders, extra_copies, base, exposed, lane)
        for ui, cached in state.items():
            if is_hooked(cached):
                continue
            rec = self._unit_record(ui, cached)
            touched.update(rec.touched)
            for s, e in rec.holders.items():
                _hold(holders, s, e)
            extra_copies.extend(rec.copies)
            bursts.extend(rec.bursts)
            held.extend(rec.held)
            base.total += rec.base
            lane.total += rec.lane
            exposed.total += rec.exposed
        ends: dict[int, int] = {}
        fixed, owned = self._fixed_end, self._owned_saves
        for s in touched:
            end = fixed[s]
            h = holders.get(s)
            if h is not None and h > end:
                end = h
            for e, owner in owned[s]:  # saves made outside the plan's regions still hold it
                if e <= end:
                    break
                if owner not in active:
                    end = e
                    break
            ends[s] = end
        return ends, extra_copies, bursts, held, (base.value(), exposed.value(), lane.value())

    def added_seconds(self, terms):
        """The added seconds of a plan's ``(base, exposed, lane)`` terms (floats, or arrays of them): copies run on
        their own lane, exposed where a prefetch is late, and wherever the lane is busier than the step."""
        base, exposed, lane = terms
        return base + np.maximum(exposed, lane - self.profile.eager_step_seconds)

    def _unit_record(self, ui: int, cached: frozenset[int]) -> "_UnitRecord":
        """What region unit ``ui`` keeping ``cached`` (or plain) adds to :meth:`_plan`, remembered per (unit,
        cached): it does not depend on the other units (NOTE [Prefetch])."""
        key = (ui, cached)
        rec = self._records.get(key)
        if rec is not None:
            return rec
        if EARLY in cached:  # the same but where the offloads come back: from the record without the flag
            late = self._unit_record(ui, cached - {EARLY})
            rec = self._records[key] = copy.copy(late)
            rec.copies = late.copies[: len(late.copies) - len(late.offloads)]
            self._copies_back(ui, cached, rec)
            return rec
        n = self.n
        nb = self._nbytes
        alloc = self._alloc
        rng = self.rng_state_bytes
        unit = self.units[ui]
        rec = _UnitRecord()
        base = _ExactSum()
        lane = _ExactSum()
        op_time = self._op_time
        plain, offloaded, saved, per_op, per_call = self._entry(ui, cached)
        in_cache = saved - offloaded
        ops = self.profile.ops
        unrun = set() if plain or not rng else saved | self.skip_of(ui, saved)  # ops the replay does not rerun
        for ii, inst in enumerate(unit.instances):
            last = inst.l_r if inst.l_r >= 0 else n
            if rng:  # NOTE [RNG state]: checkpoint's, and one per random op the replay does not rerun
                end = last if inst.t_r >= 0 else inst.end - 1
                rec.held.append((inst.start, end, rng, ui))
                rec.held.extend((inst.start + local, end, rng, ui) for local in sorted(unrun)
                                if ops[inst.start + local].random and not ops[inst.start + local].generator)
            producer = inst.producer
            for k, s in enumerate(inst.sids):
                rec.touched[s] = None
                local = producer[k]
                if local in offloaded:
                    seconds = nb[s] / self.host_bandwidth
                    done = bisect.bisect_left(op_time, op_time[alloc[s]] + seconds)
                    _hold(rec.holders, s, min(done, n))
                    if inst.t_r >= 0:  # copied back: _copies_back
                        rec.offloads.append((ii, s, seconds, max(last, inst.bwd_end[k])))
                    lane.add(2 * seconds)
                elif local in saved:
                    if inst.mutated_at[k] >= 0:  # the cache holds a copy-on-write clone, not the storage
                        rec.copies.append([inst.mutated_at[k], last, s])
                        if inst.t_r >= 0 and inst.packed[k] and inst.bwd_end[k] >= inst.t_r:
                            # and the replay, which writes it again, gets a clone of that clone
                            rec.copies.append([inst.t_r, inst.bwd_end[k], s])
                    else:
                        _hold(rec.holders, s, last)
                elif inst.packed[k] and inst.t_r >= 0 and inst.bwd_end[k] >= inst.t_r:
                    rec.copies.append([inst.t_r, inst.bwd_end[k], s])
            for s in inst.external_inputs:
                rec.touched[s] = None
                _hold(rec.holders, s, last)
            if inst.t_r >= 0:
                self._replay(ui, ii, saved, rec.bursts, base, plain, rng)
            base.add((inst.end - inst.start) * per_op + per_call)
            self._clone_seconds(ui, ii, in_cache, base)
        rec.base, rec.lane = base.total, lane.total
        self._copies_back(ui, cached, rec)
        self._records[key] = rec
        return rec

    def _copies_back(self, ui: int, cached: frozenset[int], rec: "_UnitRecord") -> None:
        """Appends the copies back of ``rec.offloads`` to ``rec.copies`` (last) and sets ``rec.exposed``: from the
        prefetch point of entry ``cached`` (NOTE [Prefetch])."""
        op_time = self._op_time
        exposed = _ExactSum()
        for ii, s, seconds, end in rec.offloads:
            prefetch = self.prefetch_at(ui, ii, cached)
            rec.copies.append([prefetch, end, s])
            exposed.add(max(0.0, seconds - (op_time[self.units[ui].instances[ii].t_r] - op_time[prefetch])))
        rec.exposed = exposed.total

    def prefetch_at(self, ui: int, ii: int, cached: frozenset[int]) -> int:
        """The op where instance ``ii`` of unit ``ui``, entry ``cached``, starts bringing its offloads back: its
        trigger's first unpack when early, else its own (NOTE [Prefetch])."""
        inst = self.units[ui].instances[ii]
        return self._prefetch_at.get((ui, ii), inst.t_r) if EARLY in cached else inst.t_r

    def hook_ok(self, ui: int) -> bool:
        """Whether unit ``ui`` may run hooked (NOTE [Hooked regions]): offloading is modelled, plain-checkpoint
        costs were measured, and every instance's saves are unpacked."""
        got = self._hook_ok.get(ui)
        if got is None:
            got = self.host_bandwidth is not None and self.plain_costs is not None and all(
                inst.t_r >= 0 for inst in self.units[ui].instances)
            self._hook_ok[ui] = got
        return got

    def hook_sharing(self, state: State) -> tuple[dict[int, list[tuple[int, int]]], set[int]]:
        """NOTE [Shared hooked storages]: which storages the hooked calls of ``state`` send to host memory together,
        and which hooked units offload the inputs they save (``RegionPlan.offload_inputs``, all or none).

        A storage every save of which is made by hooked calls, two or more, goes to host memory once (the calls
        share its copy): a ResNet block's output, saved by its last ReLU and by the next block; a U-Net skip, saved
        by an encoder stage and the next max-pool. A hooked unit offloads its saved inputs when each is its own (no
        other call saves it: a transformer block's residual stream) or shared; where one is neither, it keeps them
        all, and what it keeps cannot be shared. Returns ``(storage -> its saving instances, units whose inputs go
        to host memory)``."""
        hooked = frozenset(ui for ui, c in state.items() if is_hooked(c))
        got = self._sharing.get(hooked)
        if got is not None:
            return got
        instances = {(ui, ii) for ui in hooked for ii in range(len(self.units[ui].instances))}
        inputs = {(ui, ii): self.own_input_packs(ui, ii) for ui, ii in instances}
        candidates = set()
        for ui, ii in instances:
            inst = self.units[ui].instances[ii]
            candidates.update(inputs[(ui, ii)])
            candidates.update(s for k, s in enumerate(inst.sids) if inst.packed[k] and inst.escapes[k])
        shared = {}
        for s in sorted(candidates):
            owners = {self.pack_owner.get(pi) for pi in self.packs_of[s]}
            if len(owners) > 1 and owners <= instances:
                shared[s] = sorted(owners)
        while True:
            offload_inputs = {ui for ui in hooked if all(
                s in shared or all(self.pack_owner.get(pi) == (ui, ii) for pi in self.packs_of[s])
                for ii in range(len(self.units[ui].instances)) for s in inputs[(ui, ii)])}
            kept = {s for s in shared if any(o[0] not in offload_inputs and s in inputs[o] for o in shared[s])}
            if not kept:
                break
            for s in kept:
                del shared[s]
        got = self._sharing[hooked] = (shared, offload_inputs)
        return got

    def own_input_packs(self, ui: int, ii: int) -> dict[int, list[int]]:
        """Input storage -> the packs of it that instance ``ii`` of unit ``ui`` makes (inputs it saves), for the
        inputs with autograd history (what a hooked call may copy to host memory); computed once, never to be
        changed by the caller."""
        return self._input_packs(ui, ii)[0]

    def held_input_packs(self, ui: int, ii: int) -> dict[int, list[int]]:
        """The same for the inputs it saves that have no autograd history (position ids, masks): a hooked call
        saves them as they are, on the device (``HookRun.pack``), with or without ``offload_inputs``."""
        return self._input_packs(ui, ii)[1]

    def _input_packs(self, ui: int, ii: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        got = self._own_inputs.get((ui, ii))
        if got is None:
            got = self._own_inputs[(ui, ii)] = ({}, {})
            packs = self.profile.packs
            for s in self.units[ui].instances[ii].external_inputs:
                own = self._packs_made_by(s, ui, ii)
                if own:
                    got[0 if all(packs[pi].activation for pi in own) else 1][s] = own
        return got

    def _packs_made_by(self, s: int, ui: int, ii: int) -> list[int]:
        """The packs of storage ``s`` that instance ``ii`` of unit ``ui`` makes."""
        return [pi for pi in self.packs_of.get(s, ()) if self.pack_owner.get(pi) == (ui, ii)]

    def _hooked_copies(self, ui: int, ii: int, shared=(), offload_inputs: bool = False):
        """(storage, op its copy out starts at, the call's first unpack, end of the copy back) of what one hooked
        call copies out on its own: what it makes and saves (escaping storages stay on the device, NOTE [Hooked
        regions]) and, with ``offload_inputs``, the inputs it saves; storages in ``shared`` are copied once for
        all their calls (:meth:`hook_sharing`) and not here."""
        inst = self.units[ui].instances[ii]
        out = []
        for k, s in enumerate(inst.sids):
            if inst.packed[k] and not inst.escapes[k]:
                own = self._packs_made_by(s, ui, ii)
                out.append((s, self._alloc[s], inst.t_r, self._released(s, inst.bwd_end[k], inst.t_r, own)))
        if offload_inputs:
            for s, own in self.own_input_packs(ui, ii).items():
                if s not in shared:
                    out.append((s, *self._copy_span(s, own, inst.t_r)))
        return out

    def _copy_span(self, s: int, packs: list[int], t_r: int) -> tuple[int, int, int]:
        """(op the copy out starts at, the first unpack, end of the copy back) of storage ``s`` saved by ``packs``,
        first unpacked at ``t_r``."""
        last = max(self.profile.packs[pi].last_unpack for pi in packs)
        return min(self.profile.packs[pi].pack_op for pi in packs), t_r, self._released(s, last, t_r, packs)

    def _released(self, s: int, last: int, t_r: int, packs) -> int:
        """When autograd lets go of what ``packs`` saved of storage ``s`` (a hooked call's copy back lives as long):
        the last of their releases, which the profiler records (NOTE [Release after unpack] in regions.py). Profiles
        made by hand have none: there eager's free stands in where that comes in backward, else the last unpack,
        ``last`` (``t_r``: the first)."""
        released = [self.profile.packs[pi].released_op for pi in packs]
        if released and min(released) >= 0:
            return max(released)
        return max(last, self._free[s]) if self._free[s] >= t_r else last

    def _offload_span(self, s: int, start: int, t_r: int, end: int, prefetch: int, touched: dict, holders: dict,
                      extra_copies: list, exposed: "_ExactSum", lane: "_ExactSum") -> None:
        """One storage to host memory from op ``start`` and back from op ``prefetch`` (NOTE [Prefetch]) until
        ``end``, first needed at ``t_r``: the device copy lives until the copy out is done (and its other holders
        let go), the copy back from the prefetch; the link is busy both ways, and exposed where the prefetch is
        late."""
        seconds = self._nbytes[s] / self.host_bandwidth
        touched[s] = None
        done = bisect.bisect_left(self._op_time, self._op_time[start] + seconds)
        _hold(holders, s, min(done, self.n))
        if end >= t_r:
            extra_copies.append([prefetch, end, s])
        exposed.add(max(0.0, seconds - (self._op_time[t_r] - self._op_time[prefetch])))
        lane.add(2 * seconds)

    def _hooked_part(self, state: State, touched: dict, holders: dict, extra_copies: list, base: "_ExactSum",
                     exposed: "_ExactSum", lane: "_ExactSum") -> None:
        """The hooked calls' changes to the timeline and their seconds, added in place: they depend on which calls
        are hooked (their shared copies, NOTE [Shared hooked storages]), nothing else in the plan."""
        shared, offload_inputs = self.hook_sharing(state)
        for s, owners in shared.items():  # NOTE [Shared hooked storages]: one copy for all its calls
            t_r = min(self.units[ui].instances[ii].t_r for ui, ii in owners)  # the first of them in backward
            start, t_r, end = self._copy_span(s, self.packs_of[s], t_r)
            prefetch = min(self.prefetch_at(ui, ii, state[ui]) for ui, ii in owners)  # the first to come back
            self._offload_span(s, start, t_r, end, prefetch, touched, holders, extra_copies, exposed, lane)
        for ui, cached in state.items():
            if is_hooked(cached):
                self._hooked(ui, cached, touched, holders, extra_copies, base, exposed, lane, shared,
                             offload_inputs)

    def _hooked_time(self, hooked: State) -> tuple[int, int, int]:
        """The hooked calls' ``(base, lane, exposed)`` seconds as :class:`_ExactSum` totals, remembered per set of
        hooked calls (with their entries)."""
        key = frozenset(hooked.items())
        got = self._hooked_times.get(key)
        if got is None:
            base, exposed, lane = _ExactSum(), _ExactSum(), _ExactSum()
            self._hooked_part(hooked, {}, {}, [], base, exposed, lane)
            got = self._hooked_times[key] = (base.total, lane.total, exposed.total)
        return got

    def _hooked(self, ui: int, cached: frozenset[int], touched: dict, holders: dict, extra_copies: list,
                base: "_ExactSum", exposed: "_ExactSum", lane: "_ExactSum", shared: dict,
                offload_inputs: set[int]) -> None:
        """A hooked unit's changes to the timeline and its seconds (NOTE [Hooked regions]), added in place; the
        storages it shares with other hooked calls are the caller's (:meth:`hook_sharing`)."""
        for ii, inst in enumerate(self.units[ui].instances):
            prefetch = self.prefetch_at(ui, ii, cached)
            for s, start, t_r, end in self._hooked_copies(ui, ii, shared, ui in offload_inputs):
                self._offload_span(s, start, t_r, end, prefetch, touched, holders, extra_copies, exposed, lane)
            # the inputs it keeps are saved on the device as in eager: held until autograd lets go of their saves
            # (eager's free, where that comes in backward: NOTE [Release after unpack])
            kept = dict(self.held_input_packs(ui, ii))
            if ui not in offload_inputs:
                kept.update(self.own_input_packs(ui, ii))
            for s, own in kept.items():
                touched[s] = None
                _hold(holders, s, self._copy_span(s, own, inst.t_r)[2])
            for k, s in enumerate(inst.sids):
                if inst.packed[k] and inst.escapes[k] and s not in shared:
                    # what the call returns and saves stays on the device (``stay``), held by its saves until
                    # autograd lets go of them: a storage another planned call touches (a plain call's input)
                    # would otherwise end with that call's hold
                    touched[s] = None
                    own = self._packs_made_by(s, ui, ii)
                    if own:
                        _hold(holders, s, self._released(s, inst.bwd_end[k], inst.t_r, own))
            base.add(self._hook_call_seconds(inst))

    def _hook_call_seconds(self, inst) -> float:
        """What the hooks of one hooked call cost, at plain checkpoint's measured per-op and per-call costs (its
        own are its pack hooks)."""
        return (inst.end - inst.start) * self.plain_costs[0] + self.plain_costs[2]

    def _entry(self, ui: int, cached: frozenset[int]):
        """What unit ``ui``'s state entry means: ``(plain, offloaded, saved, forward seconds per op, seconds per
        call)``; a plain unit saves nothing, not even its escaping outputs (NOTE [Plain regions])."""
        if cached == PLAIN:
            return True, set(), set(), self.plain_costs[0], self.plain_costs[2]
        on_device, offloaded = kept_split(cached)
        return False, offloaded, self.units[ui].forced_save | on_device | offloaded, self.per_op, self.per_call

    def _replay(self, ui: int, ii: int, saved: set[int], bursts: list, seconds: "_ExactSum",
                plain: bool = False, rng: int = 0) -> None:
        """Appends the transient peak of one region's replay to ``bursts``, and its seconds to ``seconds``.

        NOTE [Replay moment]: ``t_r`` is the op about to run when the region's first saved tensor was unpacked, so
        the replay runs after op ``t_r - 1`` has let go of what it frees and before op ``t_r`` allocates anything.
        The curve has no point there; the point after op ``t_r`` stands for both moments: it has everything live at
        the replay except what op ``t_r`` allocates, plus the replayed saved storages, which live on as copies from
        ``t_r``. So the replay adds its peak less those copies and less op ``t_r``'s own allocations, when that is
        positive (charged on top of op ``t_r``'s outputs it would count them twice; on top of the point after
        ``t_r - 1``, what that op freed). The replay runs the module's own Python, so
        what held a storage in the forward holds it again: an unsaved storage lives to its eager end, within the
        replay. Remembered per call and kept set (options that differ only in where kept outputs live share it).
        """
        key = (ui, ii, frozenset(saved), plain, rng)
        got = self._replays.get(key)
        if got is None:
            got = self._replays[key] = self._replay_of(ui, ii, saved, plain, rng)
        burst, total = got
        if burst is not None:
            bursts.append(burst)
        seconds.total += total

    def _replay_of(self, ui: int, ii: int, saved: set[int], plain: bool, rng: int) -> tuple[tuple | None, int]:
        unit = self.units[ui]
        inst = unit.instances[ii]
        nb = self._nbytes
        by_op = self._outputs_of[ui][ii]
        cur = peak = kept = 0
        span = inst.stop - inst.start
        frees: dict[int, int] = {}
        transient = self._transient
        cur = peak = rng  # the replay forks the RNG: one more state lives while it runs (NOTE [RNG state])
        untracked = self._untracked
        carried = untracked[inst.start - 1] if inst.start > 0 else 0  # NOTE [Untracked bytes]
        for local in range(span):
            if local:
                carried = min(carried, untracked[inst.start + local - 1])
            if local not in saved:  # a saved op is served from the cache: it allocates nothing, but what dies at
                for k in by_op.get(local, ()):  # it (its inputs) dies there as in the forward
                    size = nb[inst.sids[k]]
                    cur += size
                    if inst.packed[k]:
                        if inst.bwd_end[k] >= inst.t_r:  # a copy in the curve from t_r (see _plan)
                            kept += size
                    else:
                        end = min(max(inst.fwd_end[k], self._free[inst.sids[k]]) - inst.start, span - 1)
                        frees[end] = frees.get(end, 0) + size
                peak = max(peak, cur + transient[inst.start + local] - carried)  # NOTE [Transient bytes]
            cur -= frees.pop(local, 0)
        # the point after t_r already carries op t_r's own transient bytes, which do not coexist with the replay
        # (it runs before op t_r): the point stands for the larger of the two moments; what the op before it left
        # untracked does (NOTE [Untracked bytes])
        extra = peak - kept - self._allocated_at[inst.t_r] - transient[inst.t_r] + untracked[inst.t_r - 1]
        seconds = _ExactSum()
        self._replay_seconds(ui, ii, saved, seconds, plain)
        return ((inst.t_r, extra, ui) if extra > 0 else None), seconds.total

    def _replay_seconds(self, ui: int, ii: int, saved: set[int], seconds: "_ExactSum", plain: bool = False) -> None:
        inst = self.units[ui].instances[ii]
        span = inst.stop - inst.start
        exact = self._exact_op_seconds(ui)
        skip = set() if plain else self.skip_of(ui, saved)
        seconds.total += sum(exact[local] for local in range(span) if local not in saved and local not in skip)
        seconds.add(span * (self.plain_replay_op(ui) if plain else self.per_replay_op))

    def plain_replay_op(self, ui: int) -> float:
        """Seconds a plain call of unit ``ui`` adds per replayed op: plain checkpoint's, and for a unit that writes
        module state (its replay under the guard's mode) what Libra's replay mode adds (NOTE [Plain regions])."""
        return self.per_replay_op if self.units[ui].protect else self.plain_costs[1]

    def _exact_op_seconds(self, ui: int) -> list[int]:
        """Each op's seconds per instance of unit ``ui`` as :class:`_ExactSum` terms (summed as integers, exactly as
        adding them one by one would), computed once per unit."""
        got = self._exact_ops.get(ui)
        if got is None:
            unit = self.units[ui]
            k_inst = len(unit.instances)
            got = self._exact_ops[ui] = [_ExactSum.term(x / k_inst) for x in unit.op_seconds]
        return got

    def _unit_time(self, ui: int, cached: frozenset[int]):
        """The terms of the added seconds that unit ``ui`` with ``cached`` kept contributes on its own, exactly as
        :meth:`_plan` sums them: ``(base, lane, exposed)`` as :class:`_ExactSum` totals, the same as
        :meth:`_unit_record`'s, without building the rest of a record the time model's trial states mostly never
        use. Remembered per (unit, cached)."""
        got = self._unit_times.get((ui, cached))
        if got is None:
            got = self._unit_times[(ui, cached)] = self._unit_time_of(ui, cached)
        return got

    def _unit_time_of(self, ui: int, cached: frozenset[int]):
        unit = self.units[ui]
        plain, offloaded, saved, per_op, per_call = self._entry(ui, cached)
        in_cache = saved - offloaded
        base = _ExactSum()
        lane = _ExactSum()
        exposed = _ExactSum()
        nb = self._nbytes
        op_time = self._op_time
        for ii, inst in enumerate(unit.instances):
            secs = [nb[s] / self.host_bandwidth for k, s in enumerate(inst.sids) if inst.producer[k] in offloaded]
            for x in secs:
                lane.add(2 * x)
            if inst.t_r >= 0:
                self._replay_seconds(ui, ii, saved, base, plain)
                window = op_time[inst.t_r] - op_time[self.prefetch_at(ui, ii, cached)]  # NOTE [Prefetch]
                for x in secs:
                    exposed.add(max(0.0, x - window))
            base.add((inst.end - inst.start) * per_op + per_call)
            self._clone_seconds(ui, ii, in_cache, base)
        return base.total, lane.total, exposed.total

    def _clone_seconds(self, ui: int, ii: int, cached: set[int], seconds: "_ExactSum") -> None:
        """Adds the copying time of one region call's clones to ``seconds``: a kept output that the forward
        writes in place later is cloned by the cache before the write (copy-on-write), and once more by each
        replay, which writes it again (NOTE [Region executor contract] in runtime/region.py): a stage that keeps
        its outputs ahead of in-place ReLUs and ``+=`` clones each of them twice, far more than its per-op costs."""
        inst = self.units[ui].instances[ii]
        nb = self._nbytes
        for k, s in enumerate(inst.sids):
            if inst.mutated_at[k] >= 0 and inst.producer[k] in cached:
                copies = 2 if inst.t_r >= 0 and inst.packed[k] and inst.bwd_end[k] >= inst.t_r else 1
                seconds.add(copies * nb[s] * self.copy_seconds_per_byte)

    def skip_of(self, ui: int, saved: set[int]) -> set[int]:
        """Ops of unit ``ui`` its replays need not run when ``saved`` are kept (planner/replay.py), cached."""
        key = (ui, frozenset(saved))
        skip = self._skips.get(key)
        if skip is None:
            skip = self._skips[key] = replay_skip(self.profile, self.units[ui], set(saved))
        return skip

    def changes(self, state: State) -> tuple[np.ndarray, np.ndarray, float]:
        """The plan's changes to eager's live-bytes curve as a sparse difference array, and the added seconds.

        ``live(state)[t] == live({})[t] + sum(val[pos <= t])``: each changed interval adds its bytes at its start and
        takes them off after its end. Linear in the size of the units in ``state``, not in the profile's length.
        """
        pos, val, terms = self.changes_and_terms(state)
        return pos, val, float(self.added_seconds(terms))

    def changes_and_terms(self, state: State) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
        """:meth:`changes`, with the added seconds as their ``(base, exposed, lane)`` terms (:meth:`added_seconds`):
        each sums over the units of ``state`` (NOTE [Prefetch]), but the busy lane is one for all."""
        held_until, copies, bursts, held, terms = self._plan(state)
        n = self.n
        # spans [start, end] of added bytes: each adds them at its start and takes them off after its end
        starts, ends, sizes = [], [], []
        if held_until:
            sids = np.fromiter(held_until.keys(), dtype=np.int64, count=len(held_until))
            end = np.minimum(np.fromiter(held_until.values(), dtype=np.int64, count=len(sids)), n)
            moved = end != self.free[sids]  # the start is eager's; only the end moves
            starts.append(self.free[sids[moved]] + 1)
            ends.append(end[moved])
            sizes.append(self.nbytes[sids[moved]])
        if copies:
            c = np.array(copies, dtype=np.int64).reshape(-1, 3)
            starts.append(c[:, 0])
            ends.append(np.minimum(c[:, 1], n))
            sizes.append(self.nbytes[c[:, 2]])
        if bursts:
            b = np.array(bursts, dtype=np.int64).reshape(-1, 3)
            starts.append(b[:, 0])
            ends.append(b[:, 0])
            sizes.append(b[:, 1])
        if held:
            h = np.array(held, dtype=np.int64).reshape(-1, 4)
            starts.append(h[:, 0])
            ends.append(np.minimum(h[:, 1], n))
            sizes.append(h[:, 2])
        if not starts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), terms
        size = np.concatenate(sizes).astype(np.int64)
        p = np.concatenate(starts + [np.concatenate(ends) + 1])
        v = np.concatenate([size, -size])
        keep = p <= n
        return p[keep], v[keep], terms

    def run(self, state: State) -> SimResult:
        """Simulates one step under ``state``."""
        live, added = self.live(state)
        peak_op = int(np.argmax(live))
        return SimResult(peak_bytes=int(live[peak_op]), peak_op=min(peak_op, self.n - 1), added_seconds=added)

    def live(self, state: State) -> tuple[np.ndarray, float]:
        """Live bytes after each op (index n: after the step), the op's transient bytes on top (NOTE [Transient
        bytes]), and the added seconds, under ``state``.

        The last few results are remembered (solvers ask for the same plan again); the array is read-only.
        """
        key = tuple(sorted(state.items()))
        got = self._recent.get(key)
        if got is None:
            pos, val, added = self.changes(state)
            delta = self.base_delta[: self.n + 1].copy()
            np.add.at(delta, pos, val)
            live = np.cumsum(delta) + self.transient  # NOTE [Transient bytes]
            live.flags.writeable = False
            got = self._recent[key] = (live, added)
            if len(self._recent) > _RECENT:
                del self._recent[next(iter(self._recent))]
        return got

    def replays_at(self, state: State, t: int) -> list[tuple[int, int]]:
        """(unit, bytes) of the replays that run right before op ``t`` under ``state``: what each adds to the live
        bytes after ``t`` (NOTE [Replay moment])."""
        return [(ui, extra) for pos, extra, ui in self._plan(state)[2] if pos == t]

    def live_at(self, state: State, t: int) -> list[tuple[int, int]]:
        """(storage id, bytes) of every storage live at op ``t`` under ``state``, largest first (replays that run
        after op ``t`` are not storages of the timeline: :meth:`replays_at`)."""
        held_until, copies, _, _, _ = self._plan(state)
        out = []
        for s in range(len(self.nbytes)):
            if self._alloc[s] <= t <= held_until.get(s, self._free[s]):
                out.append((s, int(self.nbytes[s])))
        for a, e, src in copies:
            if a <= t <= e:
                out.append((src, int(self.nbytes[src])))
        return sorted(out, key=lambda x: -x[1])


class TimeModel:
    """The simulator's added seconds of a state that changes one unit at a time, kept up to date in time linear in
    the size of the changed unit: always equal, to the last bit, to ``Simulator.run(state).added_seconds`` (both sum
    the same terms exactly, :class:`_ExactSum`, and each region unit's terms do not depend on the others: NOTE
    [Prefetch]; the hooked calls' terms depend on which calls are hooked, and are summed for them together,
    remembered per set)."""

    def __init__(self, sim: Simulator, state: State | None = None) -> None:
        self.sim = sim
        self.state: State = {}
        self._terms: dict[int, tuple[int, int, int]] = {}
        self._hooked: State = {}
        self._base = self._lane = self._exposed = 0
        for ui, cached in (state or {}).items():
            self.set(ui, cached)

    def seconds(self) -> float:
        scale = 1 << _ExactSum._SHIFT
        base, lane, exposed = self._base, self._lane, self._exposed
        if self._hooked:
            b, la, e = self.sim._hooked_time(self._hooked)
            base, lane, exposed = base + b, lane + la, exposed + e
        return float(self.sim.added_seconds((base / scale, exposed / scale, lane / scale)))

    def set(self, ui: int, cached: frozenset[int] | None) -> None:
        """Unit ``ui`` now keeps ``cached`` (None: it is not checkpointed)."""
        old = self._terms.pop(ui, None)
        self._hooked.pop(ui, None)
        self.state.pop(ui, None)
        if old is not None:
            self._base -= old[0]
            self._lane -= old[1]
            self._exposed -= old[2]
        if cached is not None and is_hooked(cached):
            # its copies depend on the other hooked calls (NOTE [Shared hooked storages]): summed with them
            self.state[ui] = self._hooked[ui] = cached
        elif cached is not None:
            self.state[ui] = cached
            terms = self._terms[ui] = self.sim._unit_time(ui, cached)
            self._base += terms[0]
            self._lane += terms[1]
            self._exposed += terms[2]
