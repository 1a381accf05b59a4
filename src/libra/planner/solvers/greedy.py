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

__all__ = ["Effects", "full_state", "state_for", "solve"]

_UNDO_TRIES = 256


def full_state(sim: Simulator) -> State:
    """Every candidate of every unit recomputed: the lowest peak the region executor reaches."""
    return {ui: frozenset() for ui, unit in enumerate(sim.units) if unit.candidates}


def state_for(sim: Simulator, moves) -> State:
    """The state in which exactly ``moves`` (``(unit, local op)`` pairs) are recomputed."""
    recomputed: dict[int, set[int]] = {}
    for ui, j in moves:
        recomputed.setdefault(ui, set()).add(j)
    return {ui: frozenset(set(sim.units[ui].candidates) - js) for ui, js in recomputed.items()}


class Effects:
    """Per-decision effects on the live curve and their costs in seconds, measured one decision at a time."""

    def __init__(self, sim: Simulator) -> None:
        self.eager, _ = sim.live({})
        per_op = sim.per_op
        self.moves: list[tuple[int, int]] = []
        unit_cols, move_cols, unit_cost, move_cost, move_unit = [], [], [], [], []
        for ui, unit in enumerate(sim.units):
            k = len(unit.instances)
            cand = set(unit.candidates)
            on, _ = sim.live({ui: frozenset(cand)})
            unit_cols.append(on - self.eager)
            always = sum(unit.op_seconds[j] / k for j in range(len(unit.op_names))
                         if j not in cand and j not in unit.forced_save)
            unit_cost.append(always + len(unit.op_names) * 2 * per_op + REGION_OVERHEAD_SECONDS)
            for j in unit.candidates:
                one, _ = sim.live({ui: frozenset(cand - {j})})
                move_cols.append(one - on)
                move_cost.append(unit.op_seconds[j] / k + 2 * per_op)
                move_unit.append(ui)
                self.moves.append((ui, j))
        n_t = len(self.eager)
        self.unit_delta = np.stack(unit_cols, axis=1) if unit_cols else np.zeros((n_t, 0), dtype=np.int64)
        self.move_delta = np.stack(move_cols, axis=1) if move_cols else np.zeros((n_t, 0), dtype=np.int64)
        self.unit_cost = np.array(unit_cost, dtype=np.float64)
        self.move_cost = np.array(move_cost, dtype=np.float64)
        self.move_unit = np.array(move_unit, dtype=np.int64)


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


def _grow(sim: Simulator, fx: Effects, budget: int, chosen: list[int], banned: set[int]) -> list[int] | None:
    """Adds moves to ``chosen`` (never in units of ``banned``) until the simulated peak fits; None if stuck."""
    on = np.zeros(len(sim.units), dtype=bool)
    taken = np.zeros(len(fx.moves), dtype=bool)
    for ui in banned:
        taken[fx.move_unit == ui] = True
    if chosen:
        live, _ = sim.live(state_for(sim, [fx.moves[i] for i in chosen]))
        live = live.astype(np.int64)
        for i in chosen:
            taken[i] = True
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
            taken[i] = True
            chosen.append(i)


def _cost(fx: Effects, chosen: list[int]) -> float:
    units = {int(fx.move_unit[i]) for i in chosen}
    return float(fx.move_cost[chosen].sum() + fx.unit_cost[list(units)].sum()) if chosen else 0.0


def solve(sim: Simulator, budget: int, effects: Effects | None = None) -> State | None:
    """The greedy state for ``budget``, or None when even recomputing every candidate does not fit."""
    if sim.run({}).peak_bytes <= budget:
        return {}
    if sim.run(full_state(sim)).peak_bytes > budget:
        return None
    fx = Effects(sim) if effects is None else effects
    chosen = _grow(sim, fx, budget, [], set())
    if chosen is None:
        # Nothing frees bytes at some peak (a replay's own transient, say): start from recomputing everything,
        # which fits, and keep what is not needed.
        chosen = list(range(len(fx.moves)))
    chosen = _undo(sim, fx, chosen, budget)
    # Polish: try doing without each checkpointed unit, regrowing elsewhere; keep what is cheaper.
    for ui in sorted({int(fx.move_unit[i]) for i in chosen}):
        if ui not in {int(fx.move_unit[i]) for i in chosen}:
            continue
        rest = [i for i in chosen if fx.move_unit[i] != ui]
        trial = _grow(sim, fx, budget, rest, {ui})
        if trial is not None:
            trial = _undo(sim, fx, trial, budget)
            if _cost(fx, trial) < _cost(fx, chosen):
                chosen = trial
    return state_for(sim, [fx.moves[c] for c in chosen])
