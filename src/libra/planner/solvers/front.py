"""Plans that never get slower as the budget grows: the cheapest fitting plan of a budget-independent family.

NOTE [Monotone in the budget]: a larger budget must never give a plan with a higher predicted step time. A plan that
fits a budget fits every larger one, so choosing, for budget ``b``, the cheapest plan that fits ``b`` out of a family
of candidate plans that does *not* depend on ``b`` is monotone by construction: a larger budget admits a superset of
the candidates, and the cheapest of a superset costs no more. Taking the cheapest of the greedy's plan *for b* and of
its plans for a few smaller budgets is not enough: the greedy's plan for some ``b1 < b2`` can be cheaper than
everything the ladder of ``b2`` reaches, and a pure planner cannot remember it (on small chains the greedy alone
gets slower with more memory at some budget steps: ``bench/planner_scaling.py``'s ``monotonicity``). The family:

- anchors: the greedy's plan (``solve_at``) for each rung of a fixed ladder from the lowest peak the planner
  reaches to eager's (:func:`default_ladder`: 20 rungs, closer together near the floor);
- from every anchor, two chains: steps that each take back one decision (in the second chain, also all that is
  left of a unit at once, which saves checkpointing it, a fixed cost no single move shows until the last) or switch
  one candidate to the other mechanism, always the step that raises the estimated peak least per second it saves,
  until the peak passes the rung ten above. Every state of a chain is a candidate; the chains bridge the budgets
  between rungs, also from rungs far below.

Plans with plain or hooked units, a unit alone, and plans two units wide where the greedy adds a third half-used
one come from the option family beside it (NOTE [Option family] in ``options.py``), which the planner consults
too; the front keeps what the family does not reach (single moves, units traded for more evictions elsewhere).

A candidate counts for ``b`` when its estimated peak fits ``b`` and the simulator confirms it (each candidate is
simulated at most once); both are properties of the candidate alone, so the rule stays monotone. Candidates are
ranked by their simulated added seconds, which :class:`~libra.planner.simulate.TimeModel` follows exactly along a
chain, so equal plans tie exactly. Only rungs at or below ``b`` are solved, when first needed, and remembered with
the effects.

What the monotone rule costs against the greedy's plan for the exact budget is measured by
``bench/planner_scaling.py`` (``monotone_vs_exact_budget_greedy``): most where the cost of a plan changes fastest,
between rungs near the floor. The cost: a greedy solve per rung below ``b`` (they share one growth path) and two
chains per rung, each O(k (log n + unit size)) for a plan of k moves over n ops.
"""

from __future__ import annotations

import heapq

import numpy as np

from libra.planner.simulate import HOOKED, SimResult, Simulator, State, TimeModel, is_hooked
from libra.planner.solvers.effects import OFFLOAD, Effects, PeakTree

__all__ = ["Front", "default_ladder", "LADDER_STEPS"]

LADDER_STEPS = 20
_REACH = 10  # a chain stops once its estimated peak passes the rung this many above its anchor


def default_ladder(sim: Simulator, floor: int) -> list[int]:
    """Rungs from the lowest reachable peak (``floor``) to eager's, closer together near the floor, where the cost of
    a plan changes fastest with the budget: the k-th at ``(k / LADDER_STEPS) ** 1.5`` of the way."""
    eager = int(sim.profile.eager_peak_bytes)
    return sorted({floor + int((eager - floor) * (k / LADDER_STEPS) ** 1.5) for k in range(LADDER_STEPS)})


_MOVE, _UNIT, _SWITCH = 0, 1, 2


class _Chain:
    """One anchor plan and its chain of un-evictions (NOTE [Monotone in the budget]).

    A step takes back one move, or (``whole_units``) all that is left of a unit, or switches one candidate to the
    other mechanism (recompute <-> offload) where that is estimated cheaper: each the one that raises the estimated
    peak least per second saved. State ``i`` is the anchor with the first ``i`` steps made.
    """

    def __init__(self, sim: Simulator, fx: Effects, moves: list[int], live: np.ndarray, whole_units: bool,
                 ceiling: int | None = None) -> None:
        self.sim, self.fx = sim, fx
        self.moves = list(moves)
        tree = PeakTree(live)
        current: dict[int, set[int]] = {}  # unit -> its moves in the current state
        for m in moves:
            current.setdefault(int(fx.move_unit[m]), set()).add(m)
        tm = TimeModel(sim, _state(sim, fx, moves))
        self.steps: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (moves dropped, moves added) per step
        peaks = [int(live.max())]
        costs = [tm.seconds()]
        partner = {}  # move -> the other mechanism's move of its candidate
        for ms in fx._moves_of_cand:
            if len(ms) == 2:
                partner[ms[0]], partner[ms[1]] = ms[1], ms[0]

        def rise(rises) -> int:
            """How much the estimated peak grows once the bytes of ``rises`` are back."""
            peak, at = tree.peak()
            new = peak
            for lo, hi, up in rises:
                if lo <= at <= hi:
                    new = max(new, peak + up)
                elif new < peak + up:
                    new = max(new, tree.range_max(lo, hi) + up)
            return new - peak

        def merged_rises(dropped, added, unit: int | None):
            merged: dict[int, int] = {}
            for m in dropped:
                for q, v in zip(*fx.move_points(m)):
                    merged[q] = merged.get(q, 0) + v
            for m in added:
                for q, v in zip(*fx.move_points(m)):
                    merged[q] = merged.get(q, 0) - v
            if unit is not None:
                for q, v in zip(*fx.unit_points(unit)):
                    merged[q] = merged.get(q, 0) + v
            pos = sorted(merged)
            return fx.rises(pos, [merged[q] for q in pos])

        def change(kind: int, x: int):
            """(unit, moves dropped, moves added, seconds saved) of an option, or None if it is no longer open."""
            if kind == _UNIT:
                ms = current.get(x, ())
                if len(ms) < 2:
                    return None
                ms = sorted(ms)
                return x, ms, [], float(fx.move_cost[ms].sum() + fx.unit_cost[x])
            u = int(fx.move_unit[x])
            if x not in current.get(u, ()):
                return None
            if kind == _MOVE:
                last = len(current[u]) == 1
                return u, [x], [], float(fx.move_cost[x]) + (float(fx.unit_cost[u]) if last else 0.0)
            other = partner[x]
            saved = float(fx.move_cost[x] - fx.move_cost[other])
            return (u, [x], [other], saved) if saved > 0 else None

        def key(kind: int, x: int):
            got = change(kind, x)
            if got is None:
                return None
            u, dropped, added, saved = got
            if any(fx.moves[m][2] == OFFLOAD for m in dropped) or added:
                # the move costs are measured one move at a time: ask the time model for the unit's whole change
                before = tm.seconds()
                rest = (current[u] - set(dropped)) | set(added)
                tm.set(u, _unit_state(sim, fx, u, rest))
                saved = before - tm.seconds()
                tm.set(u, _unit_state(sim, fx, u, current[u]))
                if kind == _SWITCH and saved <= 0:
                    return None
            if kind == _MOVE:
                up = rise(fx.removal_rises(x, len(current[u]) == 1))
            else:
                up = rise(merged_rises(dropped, added, u if kind == _UNIT else None))
            return up / max(saved, 1e-12), -saved, kind, x

        def push(kind: int, x: int) -> None:
            entry = key(kind, x)
            if entry is not None:
                heapq.heappush(heap, entry)

        heap: list = []
        for m in moves:
            push(_MOVE, m)
            if m in partner:
                push(_SWITCH, m)
        if whole_units:
            for u in current:
                push(_UNIT, u)
        while heap and (ceiling is None or peaks[-1] <= ceiling):
            stale = heapq.heappop(heap)
            kind, x = stale[2], stale[3]
            fresh = key(kind, x)
            if fresh is None:
                continue
            if heap and fresh > stale and fresh > heap[0]:
                heapq.heappush(heap, fresh)
                continue
            u, dropped, added, _ = change(kind, x)
            groups = [(*fx.move_points(m), -1) for m in dropped] + [(*fx.move_points(m), 1) for m in added]
            for m in dropped:
                current[u].discard(m)
            current[u].update(added)
            if not current[u]:
                groups.append((*fx.unit_points(u), -1))
                del current[u]
            if len(groups) == 1:
                tree.add_points(*groups[0])
            else:
                tree.add_merged(groups)
            tree.forget()
            tm.set(u, _unit_state(sim, fx, u, current.get(u)))
            self.steps.append((tuple(dropped), tuple(added)))
            peaks.append(tree.peak()[0])
            costs.append(tm.seconds())
            for m in added:
                push(_MOVE, m)  # a switched candidate can still be taken back, or switched again
            if whole_units and len(current.get(u, ())) > 1:
                push(_UNIT, u)
        self.peaks = np.array(peaks, dtype=np.int64)
        self.costs = np.array(costs, dtype=np.float64)

    def state(self, i: int) -> State:
        moves = set(self.moves)
        for dropped, added in self.steps[:i]:
            moves.difference_update(dropped)
            moves.update(added)
        return _state(self.sim, self.fx, sorted(moves))


def _unit_state(sim: Simulator, fx: Effects, u: int, moves) -> frozenset[int] | None:
    if not moves:
        return None
    kinds = {fx.moves[m][1]: fx.moves[m][2] for m in moves}
    kept = [j for j in sim.units[u].candidates if j not in kinds]
    kept += [~j for j, kind in kinds.items() if kind == OFFLOAD]
    return frozenset(kept)


def _state(sim: Simulator, fx: Effects, moves) -> State:
    by_unit: dict[int, list[int]] = {}
    for m in moves:
        by_unit.setdefault(int(fx.move_unit[m]), []).append(m)
    return {u: _unit_state(sim, fx, u, ms) for u, ms in by_unit.items()}


class Front:
    """The budget-independent family of candidate plans of one profile (NOTE [Monotone in the budget]).

    Args:
        sim: the simulator.
        fx: the effects of the decisions the solver may take.
        anchor: ``anchor(budget) -> State | None``, the greedy's plan for exactly that budget.
        ladder: the anchor budgets; must not depend on the budgets asked for.
    """

    def __init__(self, sim: Simulator, fx: Effects, anchor, ladder: list[int]) -> None:
        self.sim, self.fx = sim, fx
        self._anchor = anchor
        self.ladder = sorted(set(int(d) for d in ladder))
        self._chains: dict[int, list[_Chain]] = {}
        self._fits: dict[tuple[int, int, int], int] = {}  # (anchor, chain, state) -> simulated peak

    def chains(self, d: int) -> list[_Chain]:
        """The chains from the anchor at rung ``d`` (none if the greedy finds no plan there), built when first
        asked."""
        if d not in self._chains:
            state = self._anchor(d)
            chains = []
            if state is not None:
                moves = _moves(self.fx, state)
                live, _ = self.sim.live(state)
                i = self.ladder.index(d)
                reach = self.ladder[i + _REACH] if i + _REACH < len(self.ladder) else None
                chains = [_Chain(self.sim, self.fx, moves, live, whole, reach) for whole in (False, True)]
                for c in range(len(chains)):
                    self._fits[(d, c, 0)] = int(live.max())
            self._chains[d] = chains
        return self._chains[d]

    def solve(self, budget: int) -> State | None:
        """The cheapest candidate whose estimated and simulated peaks both fit ``budget``; None when none does."""
        found = []
        for d in [d for d in self.ladder if d <= budget]:
            for c, chain in enumerate(self.chains(d)):
                idx = np.flatnonzero(chain.peaks <= budget)
                found.extend((float(chain.costs[i]), d, c, int(i)) for i in idx)
        found.sort()
        for _, d, c, i in found:
            chain = self._chains[d][c]
            peak = self._fits.get((d, c, i))
            if peak is None:
                peak = self._fits[(d, c, i)] = self.sim.run(chain.state(i)).peak_bytes
            if peak <= budget:
                return chain.state(i)
        return None


def hook_lowest(sim: Simulator, state: State) -> tuple[State, SimResult]:
    """``state`` with units (any that may, also ones it leaves alone) turned hooked, one at a time in forward order,
    wherever that lowers the simulated peak, or keeps it and is faster: for the lowest plan, where a hooked call
    that offloads what a region would keep on the device frees more (NOTE [Hooked regions])."""
    best, current = sim.run(state), dict(state)
    for ui in sorted(range(len(sim.units)), key=lambda u: sim.units[u].instances[0].start):
        if is_hooked(current.get(ui, frozenset())) or not sim.hook_ok(ui):
            continue
        trial = dict(current)
        trial[ui] = HOOKED
        got = sim.run(trial)
        if (got.peak_bytes, got.added_seconds) < (best.peak_bytes, best.added_seconds):
            best, current = got, trial
    return current, best


def _moves(fx: Effects, state: State) -> list[int]:
    out = []
    for i, (ui, j, kind) in enumerate(fx.moves):
        kept = state.get(ui)
        if kept is None:
            continue
        if (kind == OFFLOAD and ~j in kept) or (kind != OFFLOAD and j not in kept and ~j not in kept):
            out.append(i)
    return out
