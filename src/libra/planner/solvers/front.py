"""Plans that never get slower as the budget grows: the cheapest fitting plan of a budget-independent family.

NOTE [Monotone in the budget]: a larger budget must never give a plan with a higher predicted step time. A plan that
fits a budget fits every larger one, so choosing, for budget ``b``, the cheapest plan that fits ``b`` out of a family
of candidate plans that does *not* depend on ``b`` is monotone by construction: a larger budget admits a superset of
the candidates, and the cheapest of a superset costs no more. Taking the cheapest of the greedy's plan *for b* and of
its plans for a few smaller budgets is not enough: the greedy's plan for some ``b1 < b2`` can be cheaper than
everything the ladder of ``b2`` reaches, and a pure planner cannot remember it (on chains of 2-8 blocks the greedy
alone got slower with more memory at 28 of 720 budget steps). The family:

- anchors: the greedy's plan (``solve_at``) for each rung of a fixed ladder, sixteenths of the way from the lowest
  peak the planner reaches to eager's (the lowest itself included);
- from every anchor, two chains of un-evictions: decisions taken back one at a time (in the second chain, also a
  whole unit at once, which saves checkpointing it, a fixed cost no single move shows until the last), each the one
  that raises the estimated peak least per second it saves, until the peak passes the rung eight above. Every state
  of a chain is a candidate; the chains bridge the budgets between rungs, also from rungs far below.

A candidate counts for ``b`` when its estimated peak fits ``b`` and the simulator confirms it (each candidate is
simulated at most once); both are properties of the candidate alone, so the rule stays monotone. Candidates are
ranked by their simulated added seconds, which :class:`~libra.planner.simulate.TimeModel` follows exactly along a
chain, so equal plans tie exactly. Only rungs at or below ``b`` are solved, when first needed, and remembered with
the effects. On the synthetic chains and test models this is on average as cheap as the greedy's plan for the exact
budget, often cheaper (it also tries plans made for smaller budgets), at most about 1.4x dearer on the smallest
profiles, between rungs. The cost: a greedy solve per rung below ``b`` (at most 17, sharing one growth path) and
two chains per rung, each O(k (log n + unit size)) for a plan of k moves over n ops.
"""

from __future__ import annotations

import heapq

import numpy as np

from libra.planner.simulate import Simulator, State, TimeModel
from libra.planner.solvers.effects import OFFLOAD, Effects, PeakTree

__all__ = ["Front", "default_ladder", "LADDER_STEPS"]

LADDER_STEPS = 16
_REACH = 8  # a chain stops once its estimated peak passes the rung this many above its anchor


def default_ladder(sim: Simulator, floor: int) -> list[int]:
    """Sixteenths of the way from the lowest reachable peak (``floor``) to eager's, and the floor itself."""
    eager = int(sim.profile.eager_peak_bytes)
    return sorted({floor + (eager - floor) * k // LADDER_STEPS for k in range(LADDER_STEPS)})


class _Chain:
    """One anchor plan and its un-evictions, one move or one whole unit at a time."""

    def __init__(self, sim: Simulator, fx: Effects, moves: list[int], live: np.ndarray, whole_units: bool,
                 ceiling: int | None = None) -> None:
        self.sim, self.fx = sim, fx
        self.moves = list(moves)
        tree = PeakTree(live)
        remaining: dict[int, set[int]] = {}
        for m in moves:
            remaining.setdefault(int(fx.move_unit[m]), set()).add(m)
        state = _state(sim, fx, moves)
        tm = TimeModel(sim, state)
        self.removed: list[int] = []
        self.ends = [0]  # state i is the anchor without removed[:ends[i]]
        peaks = [int(live.max())]
        costs = [tm.seconds()]

        def rise(rises) -> int:
            """The estimated peak once the bytes of ``rises`` are back."""
            peak, at = tree.peak()
            new = peak
            for a, b, up in rises:
                if a <= at <= b:
                    new = max(new, peak + up)
                elif new < peak + up:
                    new = max(new, tree.range_max(a, b) + up)
            return new - peak

        def key(option: int) -> tuple:
            """Peak increase per second saved: a move (``option >= 0``), or all that is left of unit ``~option``
            (taking a unit back whole also saves checkpointing it, which no single move shows until the last)."""
            if option >= 0:
                u = int(fx.move_unit[option])
                last = len(remaining[u]) == 1
                saved = float(fx.move_cost[option]) + (float(fx.unit_cost[u]) if last else 0.0)
                up = rise(fx.removal_rises(option, last))
            else:
                u = ~option
                ms = sorted(remaining[u])
                saved = float(fx.move_cost[ms].sum() + fx.unit_cost[u])
                merged: dict[int, int] = {}
                for m in ms:
                    for p, v in zip(*fx.move_points(m)):
                        merged[p] = merged.get(p, 0) + v
                for p, v in zip(*fx.unit_points(u)):
                    merged[p] = merged.get(p, 0) + v
                pos = sorted(merged)
                up = rise(fx.rises(pos, [merged[p] for p in pos]))
            return up / max(saved, 1e-12), -saved, option

        def take(m: int) -> None:
            u = int(fx.move_unit[m])
            tree.add_points(*fx.move_points(m), sign=-1)
            remaining[u].discard(m)
            if not remaining[u]:
                tree.add_points(*fx.unit_points(u), sign=-1)
                del remaining[u]
            tree.forget()
            self.removed.append(m)

        heap = [key(m) for m in moves]
        if whole_units:
            heap += [key(~u) for u, ms in remaining.items() if len(ms) > 1]
        heapq.heapify(heap)
        while heap and (ceiling is None or peaks[-1] <= ceiling):
            stale = heapq.heappop(heap)
            option = stale[2]
            if option >= 0 and option not in remaining.get(int(fx.move_unit[option]), ()):
                continue
            if option < 0 and len(remaining.get(~option, ())) < 2:
                continue
            fresh = key(option)
            if heap and fresh > stale and fresh > heap[0]:
                heapq.heappush(heap, fresh)
                continue
            u = int(fx.move_unit[option]) if option >= 0 else ~option
            for m in ([option] if option >= 0 else sorted(remaining[u])):
                take(m)
            tm.set(u, _unit_state(sim, fx, u, remaining.get(u)))
            peaks.append(tree.peak()[0])
            costs.append(tm.seconds())
            self.ends.append(len(self.removed))
            if whole_units and len(remaining.get(u, ())) > 1:
                heapq.heappush(heap, key(~u))
        self.peaks = np.array(peaks, dtype=np.int64)
        self.costs = np.array(costs, dtype=np.float64)

    def state(self, i: int) -> State:
        gone = set(self.removed[:self.ends[i]])
        return _state(self.sim, self.fx, [m for m in self.moves if m not in gone])


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
        """The chains from the anchor at ``d`` (none if the greedy finds no plan there), built when first asked."""
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
        for d in self.ladder:
            if d > budget:
                break
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


def _moves(fx: Effects, state: State) -> list[int]:
    out = []
    for i, (ui, j, kind) in enumerate(fx.moves):
        kept = state.get(ui)
        if kept is None:
            continue
        if (kind == OFFLOAD and ~j in kept) or (kind != OFFLOAD and j not in kept and ~j not in kept):
            out.append(i)
    return out
