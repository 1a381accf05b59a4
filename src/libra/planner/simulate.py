"""The simulator: replays a profile's storage timeline under a plan and predicts peak bytes and added seconds.

Everything the planner decides is judged by this one function; tests hold it against measurement. The memory model
of a checkpointed region is NOTE [Region model] in ``regions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from libra.planner.regions import Unit
from libra.profiler.types import Profile

__all__ = ["Simulator", "SimResult", "State", "kept_split"]

# unit index -> the candidates (local op indices) whose outputs are kept: ``j`` keeps them on the device, ``~j``
# (that is -j-1) in host memory (offloaded). Candidates of a listed unit that are in neither form are recomputed.
State = dict[int, frozenset[int]]


def kept_split(cached: frozenset[int]) -> tuple[set[int], set[int]]:
    """(kept on the device, offloaded) local op indices of one unit's state entry."""
    return {j for j in cached if j >= 0}, {~j for j in cached if j < 0}

# Runtime cost model, per op dispatched through Libra's modes (in multiples of a do-nothing dispatch mode's cost),
# and per checkpointed region call (checkpoint's own bookkeeping, measured on CPU with torch 2.13).
MODE_OVERHEAD_FACTOR = 2.5
REGION_OVERHEAD_SECONDS = 120e-6


@dataclass
class SimResult:
    peak_bytes: int
    peak_op: int
    added_seconds: float


class Simulator:
    """Predicts the peak and the added time of any plan over one profile."""

    def __init__(self, profile: Profile, units: list[Unit], host_bandwidth: float | None = None) -> None:
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
        self.base_delta = delta
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
        # A local variable of the forward that made a storage may hold it until that forward returns: for storages
        # autograd also saves (so eager does not show when Python let go), assume the innermost non-root module call
        # that produced it holds it to its end.
        call_end = np.full(n, -1, dtype=np.int64)
        for c in sorted(profile.module_calls, key=lambda c: c.depth):
            if c.parent != -1:
                call_end[c.start_op : c.end_op] = c.end_op - 1
        producer = np.array([s.producer for s in st], dtype=np.int64)
        local_end = np.where(producer >= 0, call_end[np.maximum(producer, 0)], -1)
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
        self.per_op = MODE_OVERHEAD_FACTOR * profile.dispatch_overhead_seconds
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

    def _apply(self, state: State) -> tuple[np.ndarray, dict[int, list[list[int]]], float]:
        """The plan's changes to the eager timeline: a delta array with the replay bursts, changed intervals (key < 0:
        an extra copy ``[start, end, storage]``), and the added seconds.

        NOTE [Who holds a storage]: in eager a storage lives until its last Python use or until every autograd save
        of it is unpacked, whichever is later. Under a plan, saves made inside a checkpointed region hold nothing;
        instead that region's frame holds its inputs, and Libra's cache the outputs of saved ops, until the
        region's last unpack. The forward copy of a storage lives until the last of its remaining holders.
        """
        n = self.n
        nb = self.nbytes
        delta = self.base_delta.copy()
        intervals: dict[int, list[list[int]]] = {}
        extra_copies: list[list[int]] = []
        added = 0.0
        active = {(ui, ii) for ui in state for ii in range(len(self.units[ui].instances))}
        holders: dict[int, list[int]] = {}  # storage -> ends of its holders that the plan adds
        touched: set[int] = set()
        # NOTE [Prefetch]: a region's offloaded outputs are copied back when the region before it in backward order
        # starts its replay, so the copy overlaps that region's backward.
        replays = sorted(inst.t_r for ui in state for inst in self.units[ui].instances if inst.t_r >= 0)
        exposed = lane = 0.0

        for ui, cached in state.items():
            unit = self.units[ui]
            on_device, offloaded = kept_split(cached)
            saved = unit.forced_save | on_device | offloaded
            for ii, inst in enumerate(unit.instances):
                last = inst.l_r if inst.l_r >= 0 else n
                pos = int(np.searchsorted(replays, inst.t_r)) if inst.t_r >= 0 else 0
                prefetch = replays[pos - 1] if pos > 0 else max(inst.t_r, 0)
                for k, s in enumerate(inst.sids):
                    touched.add(s)
                    if inst.producer[k] in offloaded:
                        seconds = float(nb[s]) / self.host_bandwidth
                        done = int(np.searchsorted(self.op_time, self.op_time[self.alloc[s]] + seconds))
                        holders.setdefault(s, []).append(min(done, n))
                        if inst.t_r >= 0:
                            extra_copies.append([prefetch, max(last, inst.bwd_end[k]), s])
                            window = self.op_time[inst.t_r] - self.op_time[prefetch]
                            exposed += max(0.0, seconds - window)
                        lane += 2 * seconds
                    elif inst.producer[k] in saved:
                        if inst.mutated_at[k] >= 0:  # the cache holds a copy-on-write clone, not the storage
                            extra_copies.append([inst.mutated_at[k], last, s])
                        else:
                            holders.setdefault(s, []).append(last)
                    else:
                        if inst.packed[k] and inst.t_r >= 0 and inst.bwd_end[k] >= inst.t_r:
                            extra_copies.append([inst.t_r, inst.bwd_end[k], s])
                for s in inst.external_inputs:
                    touched.add(s)
                    holders.setdefault(s, []).append(last)
                if inst.t_r >= 0:
                    added += self._replay(ui, ii, saved, delta)
                added += (inst.end - inst.start) * self.per_op + REGION_OVERHEAD_SECONDS
        for s in touched:
            ends = [int(self.python_end[s])] + holders.get(s, [])
            for pi in self.packs_of.get(s, ()):
                if self.pack_owner.get(pi) not in active:
                    ends.append(self.pack_end[pi])
            intervals[s] = [[int(self.alloc[s]), max(ends + [int(self.alloc[s])])]]
        for i, copy in enumerate(extra_copies):
            intervals[-1 - i] = [copy]
        # copies run on their own lane: exposed where a prefetch is late, and wherever the lane is busier than the step
        added += max(exposed, lane - self.profile.eager_step_seconds)
        return delta, intervals, added

    def _replay(self, ui: int, ii: int, saved: set[int], delta: np.ndarray) -> float:
        """Adds the transient peak of one region's replay at its t_r to ``delta``; returns the replay's seconds."""
        unit = self.units[ui]
        inst = unit.instances[ii]
        nb = self.nbytes
        by_op = self._outputs_of[ui][ii]
        cur = peak = kept = 0
        span = inst.stop - inst.start
        frees: dict[int, int] = {}
        for local in range(span):
            if local in saved:
                continue
            for k in by_op.get(local, ()):
                size = int(nb[inst.sids[k]])
                cur += size
                if inst.packed[k]:
                    kept += size
                else:
                    end = min(inst.fwd_end[k] - inst.start, span - 1)
                    frees[end] = frees.get(end, 0) + size
            peak = max(peak, cur)
            cur -= frees.pop(local, 0)
        extra = peak - kept
        if extra > 0:
            delta[inst.t_r] += extra
            delta[inst.t_r + 1] -= extra
        seconds = sum(unit.op_seconds[j] for j in range(span) if j not in saved) / len(unit.instances)
        return seconds + span * self.per_op

    def run(self, state: State) -> SimResult:
        """Simulates one step under ``state``."""
        live, added = self.live(state)
        peak_op = int(np.argmax(live))
        return SimResult(peak_bytes=int(live[peak_op]), peak_op=min(peak_op, self.n - 1), added_seconds=added)

    def live(self, state: State) -> tuple[np.ndarray, float]:
        """Live bytes after each op (index n: after the step), and the added seconds, under ``state``."""
        n = self.n
        nb, alloc, free = self.nbytes, self.alloc, self.free
        delta, intervals, added = self._apply(state)
        for s, ivs in intervals.items():
            if s < 0:  # an extra copy of storage src: a cache clone or a replayed escaping storage
                a, e, src = ivs[0]
                delta[a] += nb[src]
                delta[min(e, n) + 1] -= nb[src]
                continue
            delta[alloc[s]] -= nb[s]
            delta[free[s] + 1] += nb[s]
            for a, e in ivs:
                e = min(e, n)
                delta[a] += nb[s]
                delta[e + 1] -= nb[s]
        return np.cumsum(delta[: n + 1]), added

    def live_at(self, state: State, t: int) -> list[tuple[int, int]]:
        """(storage id, bytes) of every storage live at op ``t`` under ``state``, largest first."""
        _, intervals, _ = self._apply(state)
        out = []
        for s in range(len(self.nbytes)):
            ivs = intervals.get(s, [[int(self.alloc[s]), int(self.free[s])]])
            if any(a <= t <= e for a, e in ivs):
                out.append((s, int(self.nbytes[s])))
        for key, ivs in intervals.items():
            if key < 0 and ivs[0][0] <= t <= ivs[0][1]:
                out.append((ivs[0][2], int(self.nbytes[ivs[0][2]])))
        return sorted(out, key=lambda x: -x[1])
