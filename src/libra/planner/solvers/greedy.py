"""Greedy solver: at the peak, recompute or offload what frees the most bytes there per second added; repeat.

Each decision's effect on the live-bytes curve is measured once by the simulator, alone, and kept sparsely
(NOTE [Sparse effects] in ``effects.py``). The greedy adds these effects while their sum exceeds the budget, always
at the current peak (kept by a :class:`~libra.planner.solvers.effects.PeakTree`); when the sum fits, the full
simulator checks the plan (it sees the interactions between regions the sum ignores) and the greedy goes on from
the simulated curve if needed. It then undoes, most expensive first, every move the fitting plan does not need.
:meth:`Greedy.solve` makes the result monotone in the budget (NOTE [Monotone in the budget]).

NOTE [Planner cost]: with m moves and n ops, the effects cost O(sum of unit sizes x candidates per unit) to measure;
one greedy growth O(k log n) for k options taken plus O(m) each time the peak moves to another op (all options are
ranked again there; on the profiles measured the peak moves a handful of times per solve); an undo pass O(k log n);
and every solve runs the full simulator O(log k) times, not once per move.
"""

from __future__ import annotations

import heapq

import numpy as np

from libra.planner.simulate import SimResult, Simulator, State
from libra.planner.solvers.effects import OFFLOAD, RECOMPUTE, Effects, PeakTree, longest_prefix
from libra.planner.solvers.front import Front, default_ladder

__all__ = ["Effects", "Greedy", "full_state", "state_for", "RECOMPUTE", "OFFLOAD"]

_VERIFY_ROUNDS = 32


def state_for(sim: Simulator, moves) -> State:
    """The state in which exactly ``moves`` (``(unit, local op, kind)``) are taken; other candidates stay kept."""
    changed: dict[int, dict[int, str]] = {}
    for ui, j, kind in moves:
        changed.setdefault(ui, {})[j] = kind
    state: State = {}
    for ui, kinds in changed.items():
        kept = [j for j in sim.units[ui].candidates if j not in kinds]
        kept += [~j for j, kind in kinds.items() if kind == OFFLOAD]
        state[ui] = frozenset(kept)
    return state


def _evict_all(sim: Simulator, kind: str) -> State:
    return state_for(sim, [(ui, j, kind) for ui, unit in enumerate(sim.units) for j in unit.candidates
                           if kind == RECOMPUTE or j in unit.offloadable])


def full_state(sim: Simulator, kinds=(RECOMPUTE,)) -> State:
    """Every candidate of every unit evicted by one mechanism: the lowest peak that mechanism reaches.

    With several kinds allowed, the one whose full state has the lower simulated peak.
    """
    best, key = {}, None
    for kind in kinds:
        state = _evict_all(sim, kind)
        r = sim.run(state)
        if key is None or (r.peak_bytes, r.added_seconds) < key:
            best, key = state, (r.peak_bytes, r.added_seconds)
    return best


def without_idle_units(sim: Simulator, fx: Effects, state: State) -> State:
    """``state`` less every unit whose checkpointing does not lower its simulated peak, tried in backward order (the
    first units to replay are the likeliest to gain nothing). Each drop is screened on the estimate (the state's
    simulated curve less the unit's effects, O(unit size log n)), and the simulator checks the result; where it
    disagrees, the longest prefix of the drops it accepts (a bisection: O(log units) runs)."""
    chosen = _moves_of(fx, state)
    live, _ = sim.live(state)
    peak = int(live.max())
    tree = PeakTree(live)
    by_unit: dict[int, list[int]] = {}
    for m in chosen:
        by_unit.setdefault(int(fx.move_unit[m]), []).append(m)
    dropped: list[int] = []
    for ui in sorted(by_unit, key=lambda u: -sim.units[u].instances[0].start):
        mark = tree.mark()
        tree.add_merged([(*fx.move_points(m), -1) for m in by_unit[ui]] + [(*fx.unit_points(ui), -1)])
        if tree.peak()[0] <= peak:
            dropped.append(ui)
            peak = tree.peak()[0]
        else:
            tree.rollback(mark)

    def rest(k: int) -> State:
        gone = set(dropped[:k])
        return {u: c for u, c in state.items() if u not in gone}

    limit = int(live.max())
    return rest(longest_prefix(len(dropped), lambda k: sim.run(rest(k)).peak_bytes <= limit))


def _moves_of(fx: Effects, state: State) -> list[int]:
    """Indices of the moves that make ``state``."""
    out = []
    for i, (ui, j, kind) in enumerate(fx.moves):
        kept = state.get(ui)
        if kept is None:
            continue
        if (kind == OFFLOAD and ~j in kept) or (kind == RECOMPUTE and j not in kept and ~j not in kept):
            out.append(i)
    return out


class _Ranking:
    """The options at op ``t``, best first: a move in a checkpointed unit, or an idle unit offered as a bundle.

    In a checkpointed unit one candidate is an option, judged by bytes freed at ``t`` per second added; an idle
    unit is offered as a bundle, its best-ratio prefix of candidates together with the cost of checkpointing it at
    all (a fixed charge that single moves would each seem to pay alone, which steers a plain ratio greedy to many
    half-used units). An option's score at ``t`` depends on nothing else, so the ranking stays valid while the peak
    stays at ``t``; options made stale by later choices are dropped when they come up.
    """

    def __init__(self, fx: Effects, t: int, on: np.ndarray, taken: np.ndarray) -> None:
        self.fx = fx
        self.t = t
        mv, uv = fx.values_at(t)
        red = -mv
        self.red = red
        cost = np.maximum(fx.move_cost, 1e-9)
        self.score = np.where(red > 0, red / cost, -np.inf)
        free = ~taken & (red > 0)
        unit_of = fx.move_unit
        heap: list = []
        singles = np.flatnonzero(free & on[unit_of])
        for m, s, u in zip(singles.tolist(), self.score[singles].tolist(), unit_of[singles].tolist()):
            heap.append((-s, u, m, (m,)))
        idle = np.flatnonzero(free & ~on[unit_of])
        if idle.size:
            ratio = self.score[idle]
            u = unit_of[idle]
            order = np.lexsort((idle, -ratio, u))  # by unit, best ratio first, then move index
            idle, u = idle[order], u[order]
            cand = fx.move_cand[idle]
            _, first = np.unique(cand, return_index=True)  # one mechanism per candidate: its best
            keep = np.sort(first)
            idle, u = idle[keep], u[keep]
            starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
            cum_red = np.cumsum(red[idle])
            cum_cost = np.cumsum(fx.move_cost[idle])
            base_red = np.r_[0, cum_red[:-1]][starts]
            base_cost = np.r_[0.0, cum_cost[:-1]][starts]
            group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, idle.size]))
            total_red = -uv[u] + cum_red - base_red[group]
            total_cost = fx.unit_cost[u] + cum_cost - base_cost[group]
            bundle = np.where(total_red > 0, total_red / np.maximum(total_cost, 1e-9), -np.inf)
            best = np.maximum.reduceat(bundle, starts)
            at_best = np.flatnonzero(bundle == best[group])
            _, first_best = np.unique(group[at_best], return_index=True)
            ends = at_best[first_best]
            for g, (a, e) in enumerate(zip(starts.tolist(), ends.tolist())):
                if best[g] > 0:
                    heap.append((-float(best[g]), int(u[a]), -1, tuple(idle[a:e + 1].tolist())))
        heapq.heapify(heap)
        self.heap = heap

    def pop(self, on: np.ndarray, taken: np.ndarray) -> tuple[int, ...] | None:
        """The best option still open, or None."""
        heap = self.heap
        while heap:
            _, u, m, moves = heapq.heappop(heap)
            if m >= 0:
                if not taken[m]:
                    return moves
            elif not on[u]:
                return moves
        return None

    def unit_on(self, u: int, taken: np.ndarray) -> None:
        """Unit ``u`` was just checkpointed: its other candidates become options of their own."""
        for m in self.fx.moves_of_unit(u).tolist():
            if not taken[m] and self.red[m] > 0:
                heapq.heappush(self.heap, (-float(self.score[m]), u, m, (m,)))


class _Path:
    """The greedy's growth from eager with no budget, recorded option by option: growth for any budget follows it
    until the estimate first fits, so solves for several budgets share it."""

    def __init__(self, fx: Effects, allowed: np.ndarray) -> None:
        self.fx = fx
        self.on = np.zeros(fx.n_units, dtype=bool)
        self.taken = ~allowed
        self.tree = PeakTree(fx.eager)
        self.ranking: _Ranking | None = None
        self.moves: list[int] = []
        self.ends: list[int] = [0]  # after option i the plan is moves[:ends[i]]
        self.peaks: list[int] = [self.tree.peak()[0]]
        self.stuck = False

    def prefix(self, budget: int) -> list[int] | None:
        """The moves of the path up to where the estimate first fits ``budget``; None if it never does."""
        i = self.first_fit(budget)
        return None if i is None else self.moves[: self.ends[i]]

    def first_fit(self, budget: int) -> int | None:
        """The first position ``i`` of the path (the plan ``moves[:ends[i]]``) whose estimate fits ``budget``."""
        for i, peak in enumerate(self.peaks):
            if peak <= budget:
                return i
        while self.grow():
            if self.peaks[-1] <= budget:
                return len(self.peaks) - 1
        return None

    def grow(self) -> bool:
        """Takes the next option at the estimated peak; False once none frees bytes there (the path is stuck)."""
        if self.stuck:
            return False
        _, t = self.tree.peak()
        if self.ranking is None or self.ranking.t != t:
            self.ranking = _Ranking(self.fx, t, self.on, self.taken)
        option = self.ranking.pop(self.on, self.taken)
        if option is None:
            self.stuck = True
            return False
        _take(self.fx, self.tree, option, self.on, self.taken, self.moves, self.ranking)
        self.tree.forget()
        self.ends.append(len(self.moves))
        self.peaks.append(self.tree.peak()[0])
        return True


def _take(fx: Effects, tree: PeakTree, moves, on: np.ndarray, taken: np.ndarray, chosen: list,
          ranking: _Ranking | None = None) -> None:
    """Takes ``moves``: their effects (and their units', when new) go on ``tree``."""
    new_units = []
    groups = []
    for m in moves:
        u = int(fx.move_unit[m])
        groups.append((*fx.move_points(m), 1))
        if not on[u]:
            groups.append((*fx.unit_points(u), 1))
            on[u] = True
            new_units.append(u)
        fx.take(taken, m)
        chosen.append(m)
    if len(groups) == 1:
        tree.add_points(*groups[0])
    else:
        tree.add_merged(groups)
    if ranking is not None:
        for u in new_units:
            ranking.unit_on(u, taken)


class _Search:
    """One greedy solve for one budget, with moves of the allowed kinds only."""

    def __init__(self, sim: Simulator, fx: Effects, budget: int, allowed: np.ndarray) -> None:
        self.sim = sim
        self.fx = fx
        self.budget = budget
        self.allowed = allowed

    # ---- helpers ------------------------------------------------------------------------------------------------
    def simulate(self, chosen) -> np.ndarray:
        live, _ = self.sim.live(state_for(self.sim, [self.fx.moves[m] for m in chosen]))
        return live

    def _flags(self, chosen) -> tuple[np.ndarray, np.ndarray]:
        """(checkpointed units, moves no longer open) for a plan made of ``chosen``."""
        fx = self.fx
        on = np.zeros(fx.n_units, dtype=bool)
        chosen = np.asarray(chosen, dtype=np.int64)
        on[fx.move_unit[chosen]] = True
        cand = np.zeros(len(fx.cand_of), dtype=bool)
        cand[fx.move_cand[chosen]] = True
        return on, ~self.allowed | cand[fx.move_cand]

    # ---- growth -------------------------------------------------------------------------------------------------
    def grow(self, tree: PeakTree, chosen: list, on: np.ndarray, taken: np.ndarray) -> bool:
        """Adds options at the estimated peak until the estimate fits; False when nothing frees bytes there."""
        ranking = None
        while True:
            value, t = tree.peak()
            if value <= self.budget:
                return True
            if ranking is None or ranking.t != t:
                ranking = _Ranking(self.fx, t, on, taken)
            option = ranking.pop(on, taken)
            if option is None:
                return False
            _take(self.fx, tree, option, on, taken, chosen, ranking)

    def grow_verified(self, chosen: list, on: np.ndarray, taken: np.ndarray,
                      tree: PeakTree) -> tuple[list, np.ndarray] | None:
        """Grows until the simulator, not just the estimate, fits; (moves, simulated curve), or None if stuck."""
        for _ in range(_VERIFY_ROUNDS):
            if not self.grow(tree, chosen, on, taken):
                return None
            live = self.simulate(chosen)
            if live.max() <= self.budget:
                return chosen, live
            tree = PeakTree(live)
        return None

    # ---- undo ---------------------------------------------------------------------------------------------------
    def _undo_estimate(self, tree: PeakTree, chosen: list) -> list[int]:
        """Moves of ``chosen`` to drop, most expensive first, each if the estimate still fits; ``tree`` keeps them
        dropped."""
        fx = self.fx
        count: dict[int, int] = {}
        for m in chosen:
            u = int(fx.move_unit[m])
            count[u] = count.get(u, 0) + 1
        removed = []
        budget = self.budget
        peak, at = tree.peak()
        for m in sorted(chosen, key=lambda m: (-fx.move_cost[m], m)):
            u = int(fx.move_unit[m])
            last = count[u] == 1
            # The curve fits now, so dropping m fits unless it rises over the budget where it takes bytes back.
            # Where that stretch holds the peak, the peak decides; where even the peak plus the rise fits, it fits.
            fits = True
            for a, b, up in fx.removal_rises(m, last):
                if peak + up <= budget:
                    continue
                if a <= at <= b or tree.range_max(a, b) + up > budget:
                    fits = False
                    break
            if fits:
                tree.add_points(*fx.move_points(m), sign=-1)
                if last:
                    tree.add_points(*fx.unit_points(u), sign=-1)
                removed.append(m)
                count[u] -= 1
                peak, at = tree.peak()
        return removed

    def undo(self, chosen: list, live: np.ndarray) -> tuple[list, np.ndarray]:
        """Undoes every move the plan does not need to fit, screened on the estimate; the simulator checks the
        result, and if it disagrees, the longest prefix of the undos it accepts (a bisection: O(log k) runs)."""
        removed = self._undo_estimate(PeakTree(live), chosen)
        if not removed:
            return chosen, live

        fitting = {0: (chosen, live)}

        def fits(k: int) -> bool:
            gone = set(removed[:k])
            rest = [m for m in chosen if m not in gone]
            curve = self.simulate(rest)
            if curve.max() <= self.budget:
                fitting[k] = (rest, curve)
            return k in fitting

        return fitting[longest_prefix(len(removed), fits)]

    def run(self, full: State, path: _Path) -> tuple[list[int], np.ndarray]:
        """Greedy growth along the shared path and undo: (moves, simulated curve)."""
        fx = self.fx
        grown = None
        start = path.prefix(self.budget)
        if start is not None:
            live = self.simulate(start)
            if live.max() <= self.budget:
                grown = start, live
            else:  # the regions interact: go on from the simulated curve
                on, taken = self._flags(start)
                grown = self.grow_verified(list(start), on, taken, PeakTree(live))
        if grown is None:
            # Nothing frees bytes at some peak (a replay's own transient, say): start from evicting everything,
            # which fits, and keep what is not needed.
            chosen = _moves_of(fx, full)
            grown = chosen, self.simulate(chosen)
        return self.undo(*grown)


class Greedy:
    """The greedy over one simulator's moves, and what every solve on them shares (the full state, the growth path,
    the fronts of :func:`solve`), built when first needed.

    Args:
        sim: the simulator.
        effects: the moves' measured effects (default: measured here, for ``kinds``).
        kinds: the mechanisms allowed, where ``effects`` is not given.
    """

    def __init__(self, sim: Simulator, effects: Effects | None = None, kinds=(RECOMPUTE,)) -> None:
        self.sim = sim
        self.fx = Effects(sim, kinds) if effects is None else effects
        self._full: tuple[State, SimResult] | None = None
        self._path: tuple[np.ndarray, _Path] | None = None
        self._fronts: dict[tuple[int, ...], Front] = {}

    @property
    def full(self) -> tuple[State, SimResult]:
        """The full state of the moves' mechanisms and its result."""
        if self._full is None:
            state = full_state(self.sim, self.fx.kinds)
            self._full = (state, self.sim.run(state))
        return self._full

    @property
    def path(self) -> tuple[np.ndarray, _Path]:
        """(the moves of the allowed kinds, the growth path over them)."""
        if self._path is None:
            allowed = np.array([kind in self.fx.kinds for _, _, kind in self.fx.moves], dtype=bool)
            self._path = (allowed, _Path(self.fx, allowed))
        return self._path

    def solve_at(self, budget: int) -> State | None:
        """The greedy state for exactly ``budget`` (not monotone in it; see :meth:`solve`), or None when
        even evicting every candidate does not fit."""
        if self.sim.run({}).peak_bytes <= budget:
            return {}
        state, result = self.full
        if result.peak_bytes > budget:
            return None
        allowed, path = self.path
        search = _Search(self.sim, self.fx, budget, allowed)
        chosen, _ = search.run(state, path)
        return state_for(self.sim, [self.fx.moves[c] for c in chosen])

    def solve(self, budget: int, ladder: list[int] | None = None) -> State | None:
        """The greedy state for ``budget``, or None when even evicting every candidate does not fit.

        Monotone: a larger budget never gives a state with more simulated added seconds (NOTE [Monotone in the
        budget] in ``front.py``). ``ladder`` is the budgets solved exactly (default: :func:`default_ladder` from
        the lowest reachable peak to eager's); it must not depend on the budget.
        """
        if self.sim.run({}).peak_bytes <= budget:
            return {}
        floor = self.full[1].peak_bytes
        if floor > budget:
            return None
        if ladder is None:
            ladder = default_ladder(self.sim, floor)
        key = tuple(sorted({max(int(d), floor) for d in ladder} | {floor}))
        if key not in self._fronts:
            self._fronts[key] = Front(self.sim, self.fx, self.solve_at, list(key))
        return self._fronts[key].solve(budget)
