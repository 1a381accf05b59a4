"""Planner properties on random synthetic profiles (hypothesis): fits or names a minimum it then meets; a larger
budget is never slower; the solvers' fast structures agree with the simulator."""

import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import libra
from libra.planner import Planning
from libra.planner.simulate import EARLY, HOOKED, PLAIN, TimeModel
from libra.planner.solvers.chains import _range_max
from libra.planner.solvers.effects import DenseCurve, PeakTree
from libra.planner.solvers import milp
from libra.testing.synthetic import chain_profile

profiles = st.builds(
    chain_profile,
    n_blocks=st.integers(2, 8),
    ops_per_block=st.integers(2, 6),
    seed=st.integers(0, 10_000),
)


@settings(max_examples=40, deadline=None)
@given(prof=profiles, share=st.floats(0.0, 1.0))
def test_plan_fits_or_names_a_minimum_it_then_meets(prof, share):
    planning = Planning(prof)
    assert planning.eager.peak_bytes == prof.eager_peak_bytes
    budget = prof.budget_for_share(share)
    try:
        plan = libra.plan(planning, budget)
    except libra.BudgetInfeasibleError as e:
        assert e.min_budget_bytes > budget
        plan = libra.plan(planning, e.min_budget_bytes)
        assert plan.predicted_peak_bytes <= e.min_budget_bytes
        return
    assert plan.predicted_peak_bytes <= budget
    if budget >= prof.eager_peak_bytes:
        assert plan.regions == []


@settings(max_examples=25, deadline=None)
@given(prof=profiles, seed=st.integers(0, 2**16))
def test_option_effects_add_up_without_offload(prof, seed):
    # NOTE [Options per unit]: each option's effect is measured alone; without offload, eager's curve plus the
    # chosen options' effects is the simulated curve, to the byte (with offload it is not: prefetch points and
    # hooked calls' shared copies depend on the other units)
    sel = Planning(prof, decisions=("keep", "recompute")).selections[0]
    problem = sel.problem
    assert all(problem.of_unit)
    rng = random.Random(seed)
    for _ in range(10):
        choice = {ui: rng.choice(opts) for ui, opts in enumerate(problem.of_unit) if rng.random() < 0.6}
        assert np.array_equal(problem.estimate(choice), sel.sim.live(problem.state(choice))[0])
        assert problem.choice_of(problem.state(choice)) == choice


def _best_by_enumeration(problem, target):
    """The cheapest fitting choice's added seconds, every choice of options tried (None: none fits)."""
    dense = problem.dense()
    curves = problem.eager[None, :].astype(np.int64)
    costs = np.zeros(1)
    for opts in problem.of_unit:
        add_curves = [np.zeros(problem.n_t, dtype=np.int64)] + [dense[:, o] for o in opts]
        add_costs = [0.0] + [problem.cost[o] for o in opts]
        curves = (curves[:, None, :] + np.array(add_curves)[None, :, :]).reshape(-1, problem.n_t)
        costs = (costs[:, None] + np.array(add_costs)[None, :]).reshape(-1)
    fits = curves.max(axis=1) <= target
    return float(costs[fits].min()) if fits.any() else None


@settings(max_examples=30, deadline=None)
@given(n_blocks=st.integers(2, 3), ops=st.integers(2, 3), seed=st.integers(0, 10_000), x=st.floats(0.0, 1.0))
def test_milp_is_the_cheapest_choice_of_options(n_blocks, ops, seed, x):
    # the exact reference against every choice enumerated: it starts from no other solver's plan, so this is
    # what makes it a reference (without offload the estimate is the simulator, see the test above)
    prof = chain_profile(n_blocks, ops, seed=seed)
    planning = Planning(prof, decisions=("keep", "recompute"))
    sel = planning.selections[0]
    problem = sel.problem
    sizes = [len(opts) + 1 for opts in problem.of_unit]
    assume(np.prod(sizes) <= 20_000)
    target = int(sel.full.peak_bytes + x * (prof.eager_peak_bytes - sel.full.peak_bytes))
    best = _best_by_enumeration(problem, target)
    got = milp.solve(problem, target)
    if best is None:
        assert got is None
        return
    assert got is not None
    result = sel.sim.run(problem.state(got))
    assert result.peak_bytes <= target
    assert result.added_seconds <= best * (1 + 1e-4) + 1e-12  # HiGHS's relative gap
    assert sum(problem.cost[o] for o in got.values()) >= best * (1 - 1e-9) - 1e-12


@pytest.mark.parametrize("n_blocks", [4, 16])
def test_synthetic_profile_recomputes(n_blocks):
    prof = chain_profile(n_blocks, 4, seed=1)
    planning = Planning(prof)
    assert planning.min_budget_bytes() < prof.eager_peak_bytes
    plan = libra.plan(planning, planning.min_budget_bytes())
    assert plan.regions and plan.counts[libra.Decision.RECOMPUTE] > 0


def _budget(planning, x: float) -> int:
    """``x`` of the way from the smallest budget the planner meets to eager's peak (past 1: above eager's)."""
    lo, hi = planning.min_budget_bytes(), planning.profile.eager_peak_bytes
    return lo + int(x * (hi - lo))


bandwidths = st.sampled_from([None, None, 2e9, 2e10])  # offloading is planned only with a host bandwidth


@settings(max_examples=40, deadline=None)
@given(prof=profiles, bandwidth=bandwidths, x=st.floats(0.0, 1.05), y=st.floats(0.0, 1.05))
def test_a_larger_budget_is_never_slower(prof, bandwidth, x, y):
    # NOTE [Monotone in the budget] (solvers/options.py)
    planning = Planning(prof, host_bandwidth=bandwidth)
    b1, b2 = sorted((_budget(planning, x), _budget(planning, y)))
    p1, p2 = libra.plan(planning, b1), libra.plan(planning, b2)
    assert p1.predicted_peak_bytes <= b1 and p2.predicted_peak_bytes <= b2
    assert p2.predicted_step_seconds <= p1.predicted_step_seconds


@settings(max_examples=12, deadline=None)
@given(prof=profiles, x=st.floats(0.0, 1.0), y=st.floats(0.0, 1.0))
def test_a_larger_budget_is_never_slower_with_the_milp(prof, x, y):
    # HiGHS stops within its relative gap (1e-4) of the program's optimum: monotone up to that gap
    planning = Planning(prof)
    b1, b2 = sorted((_budget(planning, x), _budget(planning, y)))
    p1, p2 = libra.plan(planning, b1, solver="milp"), libra.plan(planning, b2, solver="milp")
    assert p1.predicted_peak_bytes <= b1 and p2.predicted_peak_bytes <= b2
    added1, added2 = (p.predicted_step_seconds - prof.eager_step_seconds for p in (p1, p2))
    assert added2 <= added1 * (1 + 1e-3) + 1e-12


@settings(max_examples=25, deadline=None)
@given(prof=profiles, bandwidth=bandwidths, seed=st.integers(0, 2**16))
def test_time_model_and_effects_agree_with_the_simulator(prof, bandwidth, seed):
    # The chains rank candidates by TimeModel: it must equal the simulator to the last bit. One option's sparse
    # effect must reproduce the simulated curve exactly, and the peak tree must track the summed effects.
    planning = Planning(prof, host_bandwidth=bandwidth)
    sim = planning.sim
    rng = random.Random(seed)
    tm = TimeModel(sim)
    for _ in range(30):
        ui = rng.randrange(len(sim.units))
        unit = sim.units[ui]
        kept = [j if rng.random() < 0.5 or j not in unit.offloadable or bandwidth is None else ~j
                for j in unit.candidates if rng.random() < 0.6]
        entry = None if rng.random() < 0.2 else frozenset(kept)
        if bandwidth is not None and sim.hook_ok(ui) and rng.random() < 0.3:
            entry = HOOKED | (frozenset({EARLY}) if rng.random() < 0.5 else frozenset())  # summed with the others
        elif unit.plain_ok and sim.plain_costs is not None and rng.random() < 0.2:
            entry = PLAIN
        tm.set(ui, entry)
        assert tm.seconds() == sim.run(tm.state).added_seconds
    pr = planning.selections[0].problem
    for o in rng.sample(range(len(pr.options)), min(10, len(pr.options))):
        choice = {int(pr.unit_of[o]): o}
        assert np.array_equal(sim.live(pr.state(choice))[0], pr.estimate(choice))
    choice = {ui: rng.choice(pr.of_unit[ui]) for ui in range(pr.n_units) if pr.of_unit[ui] and rng.random() < 0.5}
    curve = pr.estimate(choice)
    lo = np.array([rng.randrange(len(curve)) for _ in range(20)])
    hi = np.array([rng.randrange(a, len(curve)) for a in lo.tolist()])
    wanted = [curve[a:b + 1].max() for a, b in zip(lo, hi)]
    assert _range_max(curve, lo, hi).tolist() == wanted  # the chains' first scoring
    for tree in (PeakTree(pr.eager), DenseCurve(pr.eager)):  # the estimate of long and of short profiles
        for o in choice.values():
            tree.add_points(*pr.points(o, clipped=True))
        assert tree.peak() == (int(curve.max()), int(np.argmax(curve)))
        assert [tree.range_max(a, b) for a, b in zip(lo.tolist(), hi.tolist())] == wanted
    assert np.array_equal(tree.values, curve)


def test_lowest_state_simulates_a_handful_of_times():
    """The lowest state drops units whose checkpointing does not lower the peak: screened on each unit's sparse
    effect, checked by a few simulations, not one per unit (that made ``min_budget_bytes`` quadratic: 23 s on a
    10k-storage chain). Its peak is never above every candidate evicted."""
    prof = chain_profile(300, 5, seed=0)
    sel = Planning(prof).selections[0]
    calls = []
    live = sel.sim.live
    sel.sim.live = lambda state: calls.append(1) or live(state)
    lowest = sel.lowest_state
    assert len(calls) <= 12, len(calls)
    assert sel.sim.run(lowest).peak_bytes <= sel.full.peak_bytes
    assert len(lowest) < len(sel.full_state)  # the last blocks in forward gain nothing


def test_the_estimate_on_a_tree_plans_as_the_dense_one(monkeypatch):
    """Long profiles keep the estimated curve on a PeakTree, short ones as an array (``peak_curve``): the same
    numbers either way, so the same plans (here a short profile planned both ways, with and without a host link)."""
    from libra.planner.solvers import effects

    prof = chain_profile(40, 5, seed=4)
    budgets = [prof.budget_for_share(share) for share in (0.8, 0.5, 0.3)]

    def plans():
        out = []
        for bandwidth in (None, 2e9):
            planning = Planning(prof, host_bandwidth=bandwidth)
            for b in budgets:
                b = max(b, planning.min_budget_bytes())
                p = libra.plan(planning, b)
                out.append((p.predicted_peak_bytes, p.predicted_step_seconds, [(r.module, r.save) for r in p.regions]))
        return out

    dense = plans()
    monkeypatch.setattr(effects, "DENSE_OPS", 0)
    assert plans() == dense
