"""Greedy solver: recompute the activations that free the most bytes per second of replay, until the peak fits.

Moves are ordered once by bytes freed per second added (a region's first move also pays for replaying the ops that
must be replayed whenever the region is checkpointed); the shortest prefix that fits is found by bisection on the
simulated peak, then moves that the fitting plan does not need are undone, cheapest-per-byte first.
"""

from __future__ import annotations

import heapq

from libra.planner.simulate import REGION_OVERHEAD_SECONDS, Simulator, State

__all__ = ["move_order", "state_for", "solve"]

_UNDO_TRIES = 48


def move_order(sim: Simulator) -> list[tuple[int, int]]:
    """All moves ``(unit index, local op)`` in the order the greedy takes them."""
    per_op = sim.per_op
    queues: list[list[tuple[float, int]]] = []
    activation: list[float] = []
    for unit in sim.units:
        cand = set(unit.candidates)
        scored = []
        for j in unit.candidates:
            seconds = unit.op_seconds[j] / len(unit.instances) + 2 * per_op
            scored.append((unit.candidate_bytes[j] / len(unit.instances) / max(seconds, 1e-9), j))
        scored.sort(key=lambda x: (-x[0], x[1]))
        queues.append(scored)
        always = sum(
            unit.op_seconds[j] / len(unit.instances)
            for j in range(len(unit.op_names))
            if j not in cand and j not in unit.forced_save
        )
        activation.append(always + len(unit.op_names) * 2 * per_op + REGION_OVERHEAD_SECONDS)
    heap: list[tuple[float, int, int]] = []
    for ui, q in enumerate(queues):
        if q:
            score, j = q[0]
            unit = sim.units[ui]
            nbytes = unit.candidate_bytes[j] / len(unit.instances)
            first = nbytes / (nbytes / score + activation[ui])
            heapq.heappush(heap, (-first, ui, 0))
    order: list[tuple[int, int]] = []
    while heap:
        _, ui, pos = heapq.heappop(heap)
        order.append((ui, queues[ui][pos][1]))
        if pos + 1 < len(queues[ui]):
            heapq.heappush(heap, (-queues[ui][pos + 1][0], ui, pos + 1))
    return order


def state_for(sim: Simulator, moves: list[tuple[int, int]]) -> State:
    """The state in which exactly ``moves`` are recomputed."""
    recomputed: dict[int, set[int]] = {}
    for ui, j in moves:
        recomputed.setdefault(ui, set()).add(j)
    return {ui: frozenset(set(sim.units[ui].candidates) - js) for ui, js in recomputed.items()}


def solve(sim: Simulator, budget: int, order: list[tuple[int, int]] | None = None) -> State | None:
    """The greedy state for ``budget``, or None when even recomputing every candidate does not fit."""
    order = move_order(sim) if order is None else order
    if sim.run({}).peak_bytes <= budget:
        return {}
    if sim.run(state_for(sim, order)).peak_bytes > budget:
        return None
    lo, hi = 0, len(order)  # invariant: prefix hi fits, prefix lo does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sim.run(state_for(sim, order[:mid])).peak_bytes <= budget:
            hi = mid
        else:
            lo = mid
    chosen = list(order[:hi])
    for move in reversed(order[: hi][-_UNDO_TRIES:]):
        trial = [m for m in chosen if m != move]
        if sim.run(state_for(sim, trial)).peak_bytes <= budget:
            chosen = trial
    return state_for(sim, chosen)
