"""Greedy solver: at the simulated peak, recompute what frees the most bytes there per second of replay; repeat.

Each decision's effect on the live-bytes curve is measured once by the simulator, alone (checkpointing a unit with
everything cached; then recomputing one candidate in it). The greedy adds these effects while the summed curve
exceeds the budget, always at the current peak moment; when the sum fits, the full simulator checks the plan (it
sees the interactions between regions the sum ignores) and the greedy goes on from the simulated curve if needed.
Finally it undoes, most expensive first, every move the fitting plan does not need.
"""

from __future__ import annotations

import numpy as np

from libra.planner.simulate import REGION_OVERHEAD_SECONDS, Simulator, State

__all__ = ["Effects", "full_state", "state_for", "solve", "RECOMPUTE", "OFFLOAD"]

_UNDO_TRIES = 256
_POLISH_UNITS = 12
_EXCHANGE_UNITS = 4


RECOMPUTE, OFFLOAD = "recompute", "offload"


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


def full_state(sim: Simulator, kinds=(RECOMPUTE,)) -> State:
    """Every candidate of every unit evicted by one mechanism: the lowest peak that mechanism reaches.

    With several kinds allowed, the one whose full state has the lower simulated peak.
    """
    states = [
        state_for(sim, [(ui, j, kind) for ui, unit in enumerate(sim.units) for j in unit.candidates
                        if kind == RECOMPUTE or j in unit.offloadable])
        for kind in kinds
    ]
    return min(states, key=lambda st: (sim.run(st).peak_bytes, sim.run(st).added_seconds))


class Effects:
    """Per-decision effects on the live curve and their costs in seconds, measured one decision at a time.

    Moves are ``(unit, local op, kind)``: recompute the op's outputs, or offload them to host memory.
    """

    def __init__(self, sim: Simulator, kinds=(RECOMPUTE,)) -> None:
        self.kinds = tuple(kinds)
        self.eager, _ = sim.live({})
        per_op = sim.per_op
        self.moves: list[tuple[int, int, str]] = []
        self.cand_of: list[tuple[int, int]] = []  # candidate index -> (unit, local op)
        unit_cols, move_cols, unit_cost, move_cost, move_unit, move_cand = [], [], [], [], [], []
        for ui, unit in enumerate(sim.units):
            k = len(unit.instances)
            cand = set(unit.candidates)
            on, on_added = sim.live({ui: frozenset(cand)})
            unit_cols.append(on - self.eager)
            always = sum(unit.op_seconds[j] / k for j in range(len(unit.op_names))
                         if j not in cand and j not in unit.forced_save)
            unit_cost.append(always + len(unit.op_names) * 2 * per_op + REGION_OVERHEAD_SECONDS)
            for j in unit.candidates:
                n_cand = len(self.cand_of)
                self.cand_of.append((ui, j))
                for kind in self.kinds:
                    if kind == OFFLOAD and j not in unit.offloadable:
                        continue
                    if kind == RECOMPUTE:
                        one, _ = sim.live({ui: frozenset(cand - {j})})
                        cost = unit.op_seconds[j] / k + 2 * per_op
                    else:
                        one, added = sim.live({ui: frozenset((cand - {j}) | {~j})})
                        cost = max(added - on_added, 1e-7)
                    move_cols.append(one - on)
                    move_cost.append(cost)
                    move_unit.append(ui)
                    move_cand.append(n_cand)
                    self.moves.append((ui, j, kind))
        n_t = len(self.eager)
        self.unit_delta = np.stack(unit_cols, axis=1) if unit_cols else np.zeros((n_t, 0), dtype=np.int64)
        self.move_delta = np.stack(move_cols, axis=1) if move_cols else np.zeros((n_t, 0), dtype=np.int64)
        self.unit_cost = np.array(unit_cost, dtype=np.float64)
        self.move_cost = np.array(move_cost, dtype=np.float64)
        self.move_unit = np.array(move_unit, dtype=np.int64)
        self.move_cand = np.array(move_cand, dtype=np.int64)  # moves of one candidate exclude each other

    def take(self, taken: np.ndarray, i: int) -> None:
        taken[self.move_cand == self.move_cand[i]] = True


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


def _best_option(fx: Effects, t: int, on: np.ndarray, taken: np.ndarray) -> list[int]:
    """Moves to take next, judged by bytes freed at op ``t`` per second added.

    In a checkpointed unit one candidate is an option; an idle unit is offered as a bundle, its best-ratio prefix of
    candidates together with the cost of checkpointing it at all (a fixed charge that single moves would each seem
    to pay alone, which steers a plain ratio greedy to many half-used units).
    """
    reduction = -fx.move_delta[t]
    best: list[int] = []
    best_score = 0.0
    for ui in range(len(on)):
        idx = np.flatnonzero((fx.move_unit == ui) & ~taken)
        if idx.size == 0:
            continue
        red, cost = reduction[idx], fx.move_cost[idx]
        if on[ui]:
            scores = np.where(red > 0, red / np.maximum(cost, 1e-9), -np.inf)
            k = int(np.argmax(scores))
            if scores[k] > best_score:
                best, best_score = [int(idx[k])], float(scores[k])
            continue
        good = red > 0
        if not good.any():
            continue
        idx, red, cost = idx[good], red[good], cost[good]
        order = np.argsort(-(red / np.maximum(cost, 1e-9)), kind="stable")
        _, first = np.unique(fx.move_cand[idx[order]], return_index=True)  # one mechanism per candidate
        order = order[np.sort(first)]
        total_red = -fx.unit_delta[t, ui] + np.cumsum(red[order])
        total_cost = fx.unit_cost[ui] + np.cumsum(cost[order])
        ratio = np.where(total_red > 0, total_red / np.maximum(total_cost, 1e-9), -np.inf)
        k = int(np.argmax(ratio))
        if ratio[k] > best_score:
            best, best_score = [int(i) for i in idx[order[: k + 1]]], float(ratio[k])
    return best


def _undo(sim: Simulator, fx: Effects, chosen: list[int], budget: int) -> list[int]:
    """Undoes, most expensive first, every move the plan does not need to fit.

    Each undo is screened on the summed effects (a vector operation) and only then checked by the simulator.
    """
    live, _ = sim.live(state_for(sim, [fx.moves[c] for c in chosen]))
    live = live.astype(np.int64)
    for i in sorted(chosen, key=lambda i: -fx.move_cost[i])[:_UNDO_TRIES]:
        trial = [c for c in chosen if c != i]
        ui = fx.move_unit[i]
        estimate = live - fx.move_delta[:, i]
        if not any(fx.move_unit[c] == ui for c in trial):
            estimate = estimate - fx.unit_delta[:, ui]
        if estimate.max() > budget:
            continue
        actual, _ = sim.live(state_for(sim, [fx.moves[c] for c in trial]))
        if actual.max() <= budget:
            chosen, live = trial, actual.astype(np.int64)
    return chosen


def _grow(sim: Simulator, fx: Effects, budget: int, chosen: list[int], banned: set[int],
          allowed: np.ndarray) -> list[int] | None:
    """Adds ``allowed`` moves to ``chosen`` (never in units of ``banned``) until the simulated peak fits; None if
    stuck."""
    on = np.zeros(len(sim.units), dtype=bool)
    taken = ~allowed
    for ui in banned:
        taken[fx.move_unit == ui] = True
    if chosen:
        live, _ = sim.live(state_for(sim, [fx.moves[i] for i in chosen]))
        live = live.astype(np.int64)
        for i in chosen:
            fx.take(taken, i)
            on[fx.move_unit[i]] = True
    else:
        live = fx.eager.astype(np.int64).copy()
    chosen = list(chosen)
    while True:
        t = int(np.argmax(live))
        if live[t] <= budget:
            actual, _ = sim.live(state_for(sim, [fx.moves[i] for i in chosen]))
            if actual.max() <= budget:
                return chosen
            live = actual.astype(np.int64)
            continue
        option = _best_option(fx, t, on, taken)
        if not option:
            return None
        for i in option:
            ui = int(fx.move_unit[i])
            live += fx.move_delta[:, i]
            if not on[ui]:
                live += fx.unit_delta[:, ui]
                on[ui] = True
            fx.take(taken, i)
            chosen.append(i)


def _cost(fx: Effects, chosen: list[int]) -> float:
    units = {int(fx.move_unit[i]) for i in chosen}
    return float(fx.move_cost[chosen].sum() + fx.unit_cost[list(units)].sum()) if chosen else 0.0


def _search(sim: Simulator, fx: Effects, budget: int, kinds: tuple[str, ...]) -> list[int] | None:
    """Greedy growth, undo and polish with moves of ``kinds`` only; None when even evicting everything fails."""
    allowed = np.array([kind in kinds for _, _, kind in fx.moves], dtype=bool)
    full = full_state(sim, kinds)
    if sim.run(full).peak_bytes > budget:
        return None
    chosen = _grow(sim, fx, budget, [], set(), allowed)
    if chosen is None:
        # Nothing frees bytes at some peak (a replay's own transient, say): start from evicting everything,
        # which fits, and keep what is not needed.
        chosen = _moves_of(fx, full)
    chosen = _undo(sim, fx, chosen, budget)
    # Polish: try doing without each checkpointed unit (the costliest few), regrowing elsewhere; keep what is cheaper.
    used = {int(fx.move_unit[i]) for i in chosen}
    spend = {ui: fx.unit_cost[ui] + sum(fx.move_cost[i] for i in chosen if fx.move_unit[i] == ui) for ui in used}
    for ui in sorted(used, key=lambda u: (-spend[u], u))[:_POLISH_UNITS]:
        if ui not in {int(fx.move_unit[i]) for i in chosen}:
            continue
        rest = [i for i in chosen if fx.move_unit[i] != ui]
        trial = _grow(sim, fx, budget, rest, {ui}, allowed)
        if trial is not None:
            trial = _undo(sim, fx, trial, budget)
            if _cost(fx, trial) < _cost(fx, chosen):
                chosen = trial
    # Exchange: drop one used unit and start from all of an idle one (the fixed cost of checkpointing a unit makes
    # "fewer units, more moves each" a plan single removals do not reach).
    live, _ = sim.live(state_for(sim, [fx.moves[c] for c in chosen]))
    t = int(np.argmax(live))
    used = {int(fx.move_unit[i]) for i in chosen}
    idle = [u for u in range(len(sim.units)) if u not in used]
    potential = {u: -(fx.unit_delta[t, u] + fx.move_delta[t, (fx.move_unit == u) & allowed].sum()) for u in idle}
    for ui in sorted(used, key=lambda u: (-spend.get(u, 0.0), u))[:_EXCHANGE_UNITS]:
        for vj in sorted(idle, key=lambda u: (-potential[u], u))[:_EXCHANGE_UNITS]:
            if ui not in {int(fx.move_unit[i]) for i in chosen}:
                break
            rest = [i for i in chosen if fx.move_unit[i] != ui]
            rest += [int(i) for i in np.flatnonzero((fx.move_unit == vj) & allowed)
                     if fx.moves[i][2] == kinds[0]]
            trial = _grow(sim, fx, budget, rest, {ui}, allowed)
            if trial is not None:
                trial = _undo(sim, fx, trial, budget)
                if _cost(fx, trial) < _cost(fx, chosen):
                    chosen = trial
    return chosen


def solve(sim: Simulator, budget: int, effects: Effects | None = None, kinds=(RECOMPUTE,)) -> State | None:
    """The greedy state for ``budget``, or None when even evicting every candidate does not fit.

    With both mechanisms allowed, the search also runs with each alone and the cheapest simulated plan wins: a
    greedy that mixes them from the first move can miss a plan that uses one throughout.
    """
    if sim.run({}).peak_bytes <= budget:
        return {}
    fx = Effects(sim, kinds) if effects is None else effects
    variants = [fx.kinds] + ([(k,) for k in fx.kinds] if len(fx.kinds) > 1 else [])
    best: State | None = None
    best_seconds = float("inf")
    for variant in variants:
        chosen = _search(sim, fx, budget, variant)
        if chosen is None:
            continue
        state = state_for(sim, [fx.moves[c] for c in chosen])
        seconds = sim.run(state).added_seconds
        if seconds < best_seconds:
            best, best_seconds = state, seconds
    return best
