"""Exact reference solver: a mixed-integer program over the same decisions, solved with SciPy's HiGHS.

Variables: ``a_u`` (unit u is checkpointed) and ``r_uj`` (candidate j of unit u is recomputed), binary, ``r_uj <= a_u``.
Objective: added seconds, ``sum act_u a_u + sum sec_uj r_uj`` with the costs the greedy uses. Memory: the simulator's
live-bytes curve is linear in the decisions up to interactions between regions, so the program uses
``live(t) = eager(t) + sum a_u A_u(t) + sum r_uj D_uj(t) <= budget`` with ``A_u`` and ``D_uj`` measured by the
simulator one decision at a time. Every solution is then checked by the full simulator; if the interactions push it
over the budget, the program is solved again with the memory row tightened by the excess (a few rounds at most).
"""

from __future__ import annotations

import time

import numpy as np

from libra.errors import LibraError
from libra.planner.simulate import REGION_OVERHEAD_SECONDS, Simulator, State

__all__ = ["solve", "MILP_MAX_VARIABLES"]

MILP_MAX_VARIABLES = 4000
_ROUNDS = 6


def _costs(sim: Simulator):
    per_op = sim.per_op
    act, sec, var = [], [], []
    for ui, unit in enumerate(sim.units):
        k = len(unit.instances)
        cand = set(unit.candidates)
        always = sum(unit.op_seconds[j] / k for j in range(len(unit.op_names)) if j not in cand and j not in unit.forced_save)
        act.append(always + len(unit.op_names) * 2 * per_op + REGION_OVERHEAD_SECONDS)
        for j in unit.candidates:
            var.append((ui, j))
            sec.append(unit.op_seconds[j] / k + 2 * per_op)
    return np.array(act), np.array(sec), var


def solve(sim: Simulator, budget: int, *, time_limit: float = 60.0) -> State | None:
    """The cheapest state found under ``budget``, or None when the program has no solution.

    Raises:
        LibraError: the profile is too large for the exact solver, or HiGHS hit the time limit without a solution.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, lil_matrix

    if sim.run({}).peak_bytes <= budget:
        return {}
    act, sec, var = _costs(sim)
    n_units, n_var = len(sim.units), len(var)
    if n_units + n_var > MILP_MAX_VARIABLES:
        raise LibraError(
            f"libra.plan: the profile has {n_units + n_var} decisions, more than the exact solver takes "
            f"({MILP_MAX_VARIABLES}). Fix: use solver='greedy' (the default)."
        )
    eager, _ = sim.live({})
    unit_cols, var_cols = [], []
    for ui, unit in enumerate(sim.units):
        on, _ = sim.live({ui: frozenset(unit.candidates)})
        unit_cols.append(on - eager)
        for j in unit.candidates:  # same order as ``var``
            one, _ = sim.live({ui: frozenset(set(unit.candidates) - {j})})
            var_cols.append(one - on)
    matrix = np.stack(unit_cols + var_cols, axis=1).astype(np.float64)  # (times, units then candidates)
    cost = np.concatenate([act, sec])
    link = lil_matrix((n_var, n_units + n_var))  # r_uj - a_u <= 0
    for k, (ui, _) in enumerate(var):
        link[k, n_units + k] = 1.0
        link[k, ui] = -1.0
    rows = np.flatnonzero(np.abs(matrix).sum(axis=1) > 0)
    target = float(budget)
    deadline = time.perf_counter() + time_limit
    for _ in range(_ROUNDS):
        mem = LinearConstraint(csr_matrix(matrix[rows]), -np.inf, target - eager[rows])
        links = LinearConstraint(link.tocsr(), -np.inf, 0.0)
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        res = milp(
            cost,
            constraints=[mem, links],
            integrality=np.ones(cost.size),
            bounds=Bounds(0, 1),
            options={"time_limit": remaining, "disp": False},
        )
        if res.x is None:
            if res.status == 1:  # time limit without a solution
                break
            return None
        x = np.round(res.x).astype(int)
        recomputed: dict[int, set[int]] = {}
        for k, (ui, j) in enumerate(var):
            if x[n_units + k]:
                recomputed.setdefault(ui, set()).add(j)
        state = {ui: frozenset(set(sim.units[ui].candidates) - js) for ui, js in recomputed.items()}
        peak = sim.run(state).peak_bytes
        if peak <= budget:
            return state
        target -= peak - budget
    raise LibraError(
        f"libra.plan: the exact solver found no verified plan within {time_limit:.0f} s. "
        "Fix: use solver='greedy' (the default), or a larger budget."
    )
