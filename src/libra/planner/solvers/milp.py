"""Exact reference solver: a mixed-integer program over the greedy's decisions, solved with SciPy's HiGHS.

Variables: ``a_u`` (unit u is checkpointed) and ``x_m`` (move m: recompute or offload one candidate), binary, with
``x_m <= a_u`` and at most one move per candidate. Objective: added seconds, ``sum unit_cost a + sum move_cost x``.
Memory: the simulator's live-bytes curve is linear in the decisions up to interactions between regions, so the
program uses ``live(t) = eager(t) + sum a_u A_u(t) + sum x_m D_m(t) <= budget`` with the effects ``A`` and ``D`` the
greedy measures (:class:`~libra.planner.solvers.greedy.Effects`). Every solution is then checked by the full
simulator; if the interactions push it over, the memory rows are tightened by the excess and it is solved again.
"""

from __future__ import annotations

import time

import numpy as np

from libra.errors import LibraError
from libra.planner.simulate import Simulator, State
from libra.planner.solvers.greedy import Effects, state_for

__all__ = ["solve", "MILP_MAX_VARIABLES"]

MILP_MAX_VARIABLES = 4000
_ROUNDS = 6


def solve(sim: Simulator, budget: int, effects: Effects, *, time_limit: float = 60.0) -> State | None:
    """The cheapest verified state under ``budget``, or None when the program has no solution.

    Raises:
        LibraError: the profile is too large for the exact solver, or HiGHS found no verified plan in time.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, lil_matrix

    if sim.run({}).peak_bytes <= budget:
        return {}
    fx = effects
    n_units, n_moves = len(sim.units), len(fx.moves)
    n = n_units + n_moves
    if n > MILP_MAX_VARIABLES:
        raise LibraError(
            f"libra.plan: the profile has {n} decisions, more than the exact solver takes ({MILP_MAX_VARIABLES}). "
            "Fix: use solver='greedy' (the default)."
        )
    matrix = np.concatenate([fx.unit_delta, fx.move_delta], axis=1).astype(np.float64)
    cost = np.concatenate([fx.unit_cost, fx.move_cost])
    n_cand = len(fx.cand_of)
    link = lil_matrix((n_moves + n_cand, n))
    for m in range(n_moves):
        link[m, n_units + m] = 1.0  # x_m - a_u <= 0
        link[m, int(fx.move_unit[m])] = -1.0
        link[n_moves + int(fx.move_cand[m]), n_units + m] = 1.0  # one move per candidate
    rows = np.flatnonzero(np.abs(matrix).sum(axis=1) > 0)
    eager = fx.eager.astype(np.float64)
    target = float(budget)
    deadline = time.perf_counter() + time_limit
    for _ in range(_ROUNDS):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        res = milp(
            cost,
            constraints=[
                LinearConstraint(csr_matrix(matrix[rows]), -np.inf, target - eager[rows]),
                LinearConstraint(link.tocsr(), -np.inf, np.concatenate([np.zeros(n_moves), np.ones(n_cand)])),
            ],
            integrality=np.ones(n),
            bounds=Bounds(0, 1),
            options={"time_limit": remaining, "disp": False},
        )
        if res.x is None:
            if res.status == 1:  # time limit without a solution
                break
            return None
        x = np.round(res.x[n_units:]).astype(bool)
        state = state_for(sim, [fx.moves[m] for m in np.flatnonzero(x)])
        peak = sim.run(state).peak_bytes
        if peak <= budget:
            return state
        target -= peak - budget
    raise LibraError(
        f"libra.plan: the exact solver found no verified plan within {time_limit:.0f} s. "
        "Fix: use solver='greedy' (the default), or a larger budget."
    )
