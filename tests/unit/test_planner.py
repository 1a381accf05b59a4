"""The planner on real profiles: the greedy against the exact reference over options, and the simulator against
eager's own timeline."""

import copy

import pytest

import libra
from libra.planner import Planning
from libra.planner.solvers import greedy, milp


def _steady_times(profile):
    """The profile with op times that depend only on the op's output bytes: measured times vary from run to run on
    a shared machine, and the greedy-vs-MILP comparison should not."""
    prof = copy.deepcopy(profile)
    for op in prof.ops:
        op.seconds = 1e-5 * (1 + sum(prof.storages[s].nbytes for s in op.outputs) / 2**20)
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    return prof


@pytest.fixture
def planning(case):
    return Planning(case.profile)


@pytest.fixture
def steady(case):
    planning = Planning(_steady_times(case.profile))
    planning.name = case.name
    return planning


def test_simulator_reproduces_eager_peak(case, planning):
    assert planning.eager.peak_bytes == case.profile.eager_peak_bytes


# Where the default greedy is known to miss the exact solver's plan (issue 18): at 75% the exact solver runs two
# blocks as plain checkpoints, a plan the greedy's family has no member of (it picks three), 1.5x the added time.
GREEDY_GAPS = {
    ("gpt", 0.75): "issue 18: greedy 1.5x the exact added time (three plain blocks where two fit)",
    ("mlp", 0.75): "issue 18: greedy 1.5x the exact added time (three plain blocks where two fit)",
}


@pytest.mark.parametrize("share", [0.75, 0.5, "min"])
def test_greedy_within_3_percent_of_milp(steady, share):
    # The exact solver starts from nothing the greedy found (NOTE [Exact up to interactions] in solvers/milp.py)
    # and its options include plain and hooked calls: the greedy's plan may be faster (its keep-sets are not
    # limited to the options' orderings) but never more than 3% slower. ResNet at 75% was 1.33x before the detour
    # anchors (NOTE [Detours] in front.py): the greedy checkpointed three half-used bottleneck blocks where the
    # exact solver fully uses two.
    planning = steady
    prof = planning.profile
    solved = 0
    for sel in planning.selections:  # each region granularity (NOTE [Region granularity])
        # "min": the lowest peak both solvers start their search from, every candidate evicted
        target = sel.full.peak_bytes if share == "min" else planning.target_bytes(prof.budget_for_share(share))
        g = greedy.solve(sel.sim, target, sel.effects)
        choice = milp.solve(sel.problem, target)
        if sel.full.peak_bytes > target:
            assert g is None and choice is None
            continue
        assert g is not None and choice is not None
        rg, rm = sel.sim.run(g), sel.sim.run(sel.problem.state(choice))
        assert rg.peak_bytes <= target and rm.peak_bytes <= target
        ratio = rg.added_seconds / max(rm.added_seconds, 1e-12)
        if (planning.name, share) in GREEDY_GAPS:
            # strict: once the greedy closes the gap, the entry goes
            assert ratio > 1.03, f"the greedy now meets the exact solver at {planning.name} {share}: drop the gap"
            pytest.xfail(GREEDY_GAPS[planning.name, share])
        assert ratio <= 1.03, (sel.granularity, rg.added_seconds, rm.added_seconds)
        solved += 1
    assert solved


def test_milp_through_plan(case):
    prof = case.profile
    plan = libra.plan(prof, prof.budget_for_share(0.5), solver="milp")
    assert plan.solver == "milp" and plan.predicted_peak_bytes <= plan.budget_bytes


def test_plan_is_deterministic(case):
    prof = case.profile
    a = libra.plan(prof, prof.budget_for_share(0.5))
    b = libra.plan(prof, prof.budget_for_share(0.5))
    a.planner_seconds = b.planner_seconds = 0.0
    assert a == b


@pytest.mark.parametrize("bandwidth", [None, 2e9])
def test_a_larger_budget_is_never_slower(case, bandwidth):
    # NOTE [Monotone in the budget] (solvers/front.py), on real profiles, with offloading and without (steady op
    # times: a failure must reproduce)
    planning = Planning(_steady_times(case.profile), host_bandwidth=bandwidth)
    lo, hi = planning.min_budget_bytes(), case.profile.eager_peak_bytes
    previous = None
    for k in range(21):
        budget = lo + (hi - lo) * k // 20
        plan = libra.plan(planning, budget)
        assert plan.predicted_peak_bytes <= budget
        if previous is not None:
            assert plan.predicted_step_seconds <= previous
        previous = plan.predicted_step_seconds
