"""The plan of the lowest peak: every candidate evicted, less the units that do not lower the peak, hooked calls where
they lower it further (``Selection.minimum`` in ``planner/__init__.py`` puts these together)."""

from __future__ import annotations

from libra.planner.simulate import HOOKED, SimResult, Simulator, State, is_hooked
from libra.planner.solvers.effects import RECOMPUTE, PeakTree, longest_prefix

__all__ = ["full_state", "without_idle_units", "hook_lowest"]


def _evict_all(sim: Simulator, kind: str) -> State:
    """Every candidate of every unit recomputed, or (``OFFLOAD``) every one that may be offloaded offloaded."""
    state: State = {}
    for ui, unit in enumerate(sim.units):
        if kind == RECOMPUTE and unit.candidates:
            state[ui] = frozenset()
        elif unit.offloadable:
            state[ui] = frozenset(j for j in unit.candidates if j not in unit.offloadable) | frozenset(
                ~j for j in unit.offloadable)
    return state


def full_state(sim: Simulator, kinds=(RECOMPUTE,)) -> State:
    """Every candidate of every unit evicted by one mechanism: the lowest peak that mechanism reaches. With several
    kinds allowed, the one whose full state has the lower simulated peak (then the fewer added seconds)."""
    best, key = {}, None
    for kind in kinds:
        state = _evict_all(sim, kind)
        r = sim.run(state)
        if key is None or (r.peak_bytes, r.added_seconds) < key:
            best, key = state, (r.peak_bytes, r.added_seconds)
    return best


def without_idle_units(sim: Simulator, state: State) -> State:
    """``state`` less every unit whose checkpointing does not lower its simulated peak, tried in backward order (the
    first units to replay are the likeliest to gain nothing). Each drop is screened on the estimate (the state's
    simulated curve less the unit's own effect, measured alone: NOTE [Sparse effects] in ``effects.py``), and the
    simulator checks the result; where it disagrees, the longest prefix of the drops it accepts (a bisection:
    O(log units) runs)."""
    live, _ = sim.live(state)
    n = len(live)
    limit = peak = int(live.max())
    tree = PeakTree(live)
    dropped: list[int] = []
    for ui in sorted(state, key=lambda u: -sim.units[u].instances[0].start):
        pos, val, _ = sim.changes({ui: state[ui]})
        keep = pos < n
        pos, val = pos[keep].tolist(), val[keep].tolist()
        mark = tree.mark()
        tree.add_points(pos, val, -1)
        if tree.peak()[0] <= peak:
            dropped.append(ui)
            peak = tree.peak()[0]
        else:
            tree.rollback(mark)

    def rest(k: int) -> State:
        gone = set(dropped[:k])
        return {u: c for u, c in state.items() if u not in gone}

    return rest(longest_prefix(len(dropped), lambda k: sim.run(rest(k)).peak_bytes <= limit))


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
