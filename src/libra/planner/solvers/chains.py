"""Chains over options: from a plan, steps that each move one unit to a cheaper neighbouring option or give it
back, the step that raises the estimated peak least per second it saves first (NOTE [Option chains]).

NOTE [Option chains]: the option family's members (NOTE [Option family] in ``options.py``) are few near any given
budget, and the plan for a budget between two of them is the lower one, however close the upper one is. A chain from
a member walks up from it: each step moves one unit to a neighbouring option that costs less (:func:`neighbours`:
one candidate kept that it evicted, or recomputed that it offloaded, or offloaded that it recomputed; its copies
back at the other point; plain or hooked), or gives the unit back once at most one of its candidates is evicted
(or from plain or hooked), always the step that raises the estimated peak least per second it saves, until the peak
passes ``ceiling``. Every state of a chain is a candidate, so there is one at nearly every budget above the member.
Single steps, not whole units at once: a unit given back whole in one step frees its last candidates' bytes with
its first ones', where keeping them one by one finds the cheap ones to keep (on the bench Mixer at 30% of its
activations the whole-unit steps gave 1.4173x eager, single steps 1.4062x, the exact program 1.406x).

The estimate is the member's simulated curve plus the steps' effects (the difference of the two options' sparse
effects, on a :func:`~libra.planner.solvers.effects.peak_curve`); the cost the simulator's, exactly
(:class:`~libra.planner.simulate.TimeModel`), so a candidate chosen by cost is verified for its peak alone and the
rule stays monotone (NOTE [Monotone in the budget] in ``options.py``). The first steps, every unit's, are scored at
once on the start's curve (a sparse table of its maxima: most of a chain's scoring, as a chain takes a few steps);
the steps a move opens are offered scored 0, a lower bound, and scored exactly when they come up; a step scored
worse than the next one goes back (its score also goes stale as the curve moves). Cost: O(n log n) for the table,
per step O(log n) (a long profile's tree) or O(n) in numpy (a short one's array) per point of the changed effect and
the re-scoring of the steps that come up; a unit's neighbours are found by index, once per option, and the
difference of two options once per family.
"""

from __future__ import annotations

import heapq

import numpy as np

from libra.planner.problem import Choice, Mode, Option, Problem
from libra.planner.simulate import TimeModel
from libra.planner.solvers.effects import peak_curve

__all__ = ["Chain", "neighbours"]

_DROP = -1  # a step that gives the unit back


def neighbours(problem: Problem, o: int) -> list[int]:
    """The options of ``o``'s unit one change away from ``o`` (NOTE [Option chains]): one candidate kept, one
    offloaded candidate recomputed, one recomputed candidate offloaded, the copies back at the other point; and the
    unit's plain and hooked options. From a plain or hooked option, every other option of the unit."""
    ui = int(problem.unit_of[o])
    opt = problem.options[o]
    if opt.mode is not Mode.MODES:
        return [int(x) for x in problem.unit_options(ui) if x != o]
    unit = problem.sim.units[ui]
    keep, off = opt.keep, opt.offload
    found: dict[Option, None] = {}
    for j in unit.candidates:
        if j in keep:
            continue
        if j in off:
            rest = off - {j}
            found[Option(Mode.MODES, keep | {j}, rest, opt.early and bool(rest))] = None  # kept
            found[Option(Mode.MODES, keep, rest, opt.early and bool(rest))] = None  # recomputed
        elif j in unit.offloadable:
            found[Option(Mode.MODES, keep | {j}, off, opt.early)] = None
            found[Option(Mode.MODES, keep, off | {j}, opt.early)] = None  # offloaded
        else:
            found[Option(Mode.MODES, keep | {j}, off, opt.early)] = None
    if off:
        found[Option(Mode.MODES, keep, off, not opt.early)] = None
    found[Option(Mode.PLAIN)] = None
    found[Option(Mode.HOOKED)] = None
    found[Option(Mode.HOOKED, early=True)] = None
    out = []
    for cand in found:
        x = problem.index(ui, cand)
        if x is not None and x != o:
            out.append(x)
    return out


def _range_max(curve: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``curve[lo[i]:hi[i] + 1].max()`` for every i, from a sparse table of the curve's maxima over spans of 2**k."""
    level = np.log2(hi - lo + 1).astype(np.int64)
    table = [curve]
    for k in range(1, int(level.max()) + 1):
        half = 1 << (k - 1)
        table.append(np.maximum(table[-1][:-half], table[-1][half:]))
    out = np.empty(len(lo), dtype=np.int64)
    for k in np.unique(level).tolist():
        at = level == k
        out[at] = np.maximum(table[k][lo[at]], table[k][hi[at] - (1 << k) + 1])
    return out


class Chain:
    """One chain from ``choice`` (NOTE [Option chains]): ``steps[i]`` is ``(unit, option or -1)``, state ``i`` the
    choice with the first ``i`` steps made, its estimated peak ``peaks[i]`` and simulated added seconds
    ``costs[i]``.

    Args:
        problem: the units' options.
        choice: where the chain starts.
        live: its simulated live-bytes curve.
        ceiling: the chain stops once its estimated peak is above this.
        near: ``near(o)``, the options a unit at option ``o`` may step to (default :func:`neighbours`).
    """

    def __init__(self, problem: Problem, choice: Choice, live: np.ndarray, ceiling: int | None,
                 near=None, diffs: dict | None = None) -> None:
        self.problem = problem
        self.start = dict(choice)
        near = near or (lambda x: neighbours(problem, x))
        sim = problem.sim
        n_t = problem.n_t
        base = np.asarray(live[:n_t], dtype=np.int64)
        tree = peak_curve(base)
        current = dict(choice)
        tm = TimeModel(sim, problem.state(current))
        terms = problem.term_tuples
        step_seconds = float(sim.profile.eager_step_seconds)
        totals = tuple(problem.terms[list(current.values())].sum(axis=0).tolist()) if current else (0.0, 0.0, 0.0)

        def added(t) -> float:  # Simulator.added_seconds of one plan's terms, in plain floats
            return t[0] + max(t[1], t[2] - step_seconds)

        def switched(t, cur: int, o: int):
            a, b = terms[cur], terms[o] if o != _DROP else (0.0, 0.0, 0.0)
            return t[0] - a[0] + b[0], t[1] - a[1] + b[1], t[2] - a[2] + b[2]
        self.steps: list[tuple[int, int]] = []
        peaks = [tree.peak()[0]]
        costs = [tm.seconds()]
        # (from, to) -> (points of the switch, where it raises the curve): shared by a family's chains
        diffs = {} if diffs is None else diffs

        def diff(cur: int, o: int):
            """The points ``(pos, val)`` of the switch from ``cur`` to ``o`` (-1: none), and the ``(first op, last
            op, bytes)`` spans where it raises the curve, as a list and as an array."""
            got = diffs.get((cur, o))
            if got is None:
                merged: dict[int, int] = {}
                for x, sign in ((o, 1), (cur, -1)):
                    if x == _DROP:
                        continue
                    for p, v in zip(*problem.points(x, clipped=True)):
                        merged[p] = merged.get(p, 0) + sign * v
                pos = sorted(p for p, v in merged.items() if v)
                val = [merged[p] for p in pos]
                rises, run = [], 0
                for i, p in enumerate(pos):
                    run += val[i]
                    if run > 0:
                        end = pos[i + 1] - 1 if i + 1 < len(pos) else n_t - 1
                        if end >= p:
                            rises.append((p, end, run))
                got = diffs[(cur, o)] = (pos, val, rises, np.array(rises, dtype=np.int64).reshape(-1, 3))
            return got

        def rise(rises) -> int:
            peak, at = tree.peak()
            new = peak
            for lo, hi, up in rises:
                if lo <= at <= hi:
                    new = max(new, peak + up)
                elif new < peak + up:
                    new = max(new, tree.range_max(lo, hi) + up)
            return new - peak

        def key(ui: int, cur: int, o: int):
            saved = added(totals) - added(switched(totals, cur, o))
            if saved <= 0:
                return None
            return rise(diff(cur, o)[2]) / saved, -saved, ui, o, cur

        heap: list = []

        def push(ui: int, cur: int) -> None:
            """Offers unit ``ui``'s steps from ``cur``, scored 0 (no step raises the peak less: the score is a
            lower bound, made exact when the step comes up)."""
            for o, saved in steps(ui, cur):
                heapq.heappush(heap, (0.0, -saved, ui, o, cur))

        def steps(ui: int, cur: int):
            """Unit ``ui``'s steps from ``cur`` that save time, with the seconds each saves."""
            opt = problem.options[cur]
            last = opt.mode is not Mode.MODES or len(sim.units[ui].candidates) - len(opt.keep) <= 1
            now = added(totals)
            for o in ([_DROP] if last else []) + near(cur):
                saved = now - added(switched(totals, cur, o))
                if saved > 0:
                    yield o, saved

        # the first steps scored at once, from the start's curve (most of a chain's scoring: a chain takes a few
        # steps, and every unit's steps are scored before the first)
        first = [(ui, cur, o, saved) for ui, cur in current.items() for o, saved in steps(ui, cur)]
        if first:
            rises = [diff(cur, o)[3] for _, cur, o, _ in first]
            owner = np.repeat(np.arange(len(first)), [len(r) for r in rises])
            spans = np.concatenate(rises)
            high = np.full(len(first), peaks[0], dtype=np.int64)
            if len(spans):
                np.maximum.at(high, owner, _range_max(base, spans[:, 0], spans[:, 1]) + spans[:, 2])
            score = (high - peaks[0]).tolist()
            heap = [(score[i] / saved, -saved, ui, o, cur) for i, (ui, cur, o, saved) in enumerate(first)]
            heapq.heapify(heap)
        while heap and (ceiling is None or peaks[-1] <= ceiling):
            stale = heapq.heappop(heap)
            ui, o, cur = stale[2], stale[3], stale[4]
            if current.get(ui) != cur:
                continue
            fresh = key(ui, cur, o)
            if fresh is None:
                continue
            if heap and fresh > stale and fresh > heap[0]:
                heapq.heappush(heap, fresh)
                continue
            pos, val = diff(cur, o)[:2]
            tree.add_points(pos, val)
            tree.forget()
            totals = switched(totals, cur, o)
            if o == _DROP:
                del current[ui]
                tm.set(ui, None)
            else:
                current[ui] = o
                tm.set(ui, problem.entry(o))
                push(ui, o)
            self.steps.append((ui, o))
            peaks.append(tree.peak()[0])
            costs.append(tm.seconds())
        self.peaks = np.array(peaks, dtype=np.int64)
        self.costs = np.array(costs, dtype=np.float64)

    def choice(self, i: int) -> Choice:
        """State ``i`` of the chain."""
        out = dict(self.start)
        for ui, o in self.steps[:i]:
            if o == _DROP:
                del out[ui]
            else:
                out[ui] = o
        return out
