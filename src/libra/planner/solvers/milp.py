"""The exact reference: one mixed-integer program over the options of each unit, solved with SciPy's HiGHS
(NOTE [Options per unit] in ``problem.py``).

Variables: ``y_o`` binary, option ``o`` taken, at most one per unit (a unit with none is not checkpointed), and
``w`` the copy time that shows. Objective: added seconds, ``sum base_o y_o + w`` with ``w >= sum exposed_o y_o``
(copies back that start late) and ``w >= sum lane_o y_o - eager step`` (a host link busier than the step): the
simulator's own sum, exact since copies come back at fixed points (NOTE [Prefetch] in ``simulate.py``). Memory:
``eager(t) + sum_o E_o(t) y_o <= budget`` at every op where some choice could reach the budget, with ``E_o`` the
option's effect measured by the simulator alone. The program starts from nothing another solver found (no
incumbent): it is what the greedy is measured against.

NOTE [Exact up to interactions]: the program is exact over the options as the estimate sees them; the estimate
ignores how units interact (a storage held by two units, copies hooked calls share), so every
solution is checked by the simulator, the single judge. Where it simulates over the budget, the memory rows are
tightened by the excess and the program is solved again; a plan so found is exact for the tightened program, not
for the simulator. On the test profiles without offload the first solution always verified.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from libra.errors import LibraError
from libra.planner.problem import Choice, Problem

__all__ = ["solve", "MILP_MAX_VARIABLES", "MILP_MAX_ENTRIES"]

log = logging.getLogger("libra")

MILP_MAX_VARIABLES = 4000  # options
MILP_MAX_ENTRIES = 20_000_000  # ops x options of the memory rows' dense form
_ROUNDS = 6


def _too_large(what: str, got: int, limit: int) -> LibraError:
    return LibraError(
        f"libra.plan: the exact solver takes at most {limit:,} {what}; this profile has {got:,}. "
        "Fix: use solver='greedy' (the default), which plans profiles of any size."
    )


def solve(problem: Problem, budget: int, *, time_limit: float = 60.0) -> Choice | None:
    """The cheapest choice of options the simulator fits under ``budget`` (NOTE [Exact up to interactions]), or
    None when the program has no solution.

    Raises:
        LibraError: the problem is too large for the exact solver, or HiGHS found no verified plan in time.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    if problem.eager.max() <= budget:
        return {}
    n_opt = len(problem.options)
    if n_opt > MILP_MAX_VARIABLES:
        raise _too_large("options", n_opt, MILP_MAX_VARIABLES)
    if problem.n_t * max(n_opt, 1) > MILP_MAX_ENTRIES:
        raise _too_large("op-option entries", problem.n_t * n_opt, MILP_MAX_ENTRIES)
    dense = problem.dense()
    eager = problem.eager.astype(np.float64)
    # the most each op can reach: eager plus, per unit, its option that adds the most there (rows that cannot reach
    # the budget under any choice constrain nothing)
    worst = np.zeros(problem.n_t)
    for opts in problem.of_unit:
        if opts:
            worst += np.maximum(dense[:, opts].max(axis=1), 0)
    one = csr_matrix((np.ones(n_opt), (problem.unit_of, np.arange(n_opt))), shape=(problem.n_units, n_opt + 1))
    base, exposed, lane = problem.terms.T
    # w - sum exposed_o y_o >= 0 and w - sum lane_o y_o >= -eager step
    shown = csr_matrix(np.vstack([np.append(-exposed, 1.0), np.append(-lane, 1.0)]))
    step = problem.sim.profile.eager_step_seconds
    deadline = time.perf_counter() + time_limit
    target = float(budget)
    for _ in range(_ROUNDS):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        rows = np.flatnonzero(eager + worst > target)
        memory = csr_matrix(dense[rows].astype(np.float64))
        memory.resize(len(rows), n_opt + 1)  # w takes no memory
        res = milp(
            np.append(base, 1.0),
            constraints=[LinearConstraint(memory, -np.inf, target - eager[rows]),
                         LinearConstraint(one, -np.inf, 1.0),
                         LinearConstraint(shown, [0.0, -step], np.inf)],
            integrality=np.append(np.ones(n_opt), 0.0),
            bounds=Bounds(np.zeros(n_opt + 1), np.append(np.ones(n_opt), np.inf)),
            options={"time_limit": remaining, "disp": False},
        )
        if res.x is None:
            if res.status == 1:  # out of time with no solution
                break
            return None  # infeasible: no choice of options fits, as the estimate sees them
        if res.status == 1:
            log.info("libra.plan: the exact solver ran out of time (%.0f s); its best plan so far is not proven "
                     "optimal", time_limit)
        choice = {int(problem.unit_of[o]): int(o) for o in np.flatnonzero(np.round(res.x[:n_opt]) > 0)}
        peak = problem.sim.run(problem.state(choice)).peak_bytes
        if peak <= budget:
            return choice
        target -= peak - budget  # NOTE [Exact up to interactions]
    raise LibraError(
        f"libra.plan: the exact solver found no verified plan within {time_limit:.0f} s. "
        "Fix: use solver='greedy' (the default), or a larger budget or time_limit."
    )
