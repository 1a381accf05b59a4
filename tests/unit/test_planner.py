"""The planner on real profiles: the greedy against the exact MILP, and the simulator against eager's own timeline."""

import time

import pytest

import libra
from libra.planner import Planning
from libra.planner.solvers import greedy, milp


@pytest.fixture
def planning(case):
    return Planning(case.profile)


def test_simulator_reproduces_eager_peak(case, planning):
    assert planning.eager.peak_bytes == case.profile.eager_peak_bytes


@pytest.mark.parametrize("share", [0.75, 0.5, "min"])
def test_greedy_within_3_percent_of_milp(case, planning, share):
    prof = case.profile
    budget = planning.min_budget_bytes() if share == "min" else prof.budget_for_share(share)
    target = budget - planning.margin_bytes
    g = greedy.solve(planning.sim, target, planning.effects)
    m = milp.solve(planning.sim, target, planning.effects)
    assert g is not None and m is not None
    rg, rm = planning.sim.run(g), planning.sim.run(m)
    assert rg.peak_bytes <= target and rm.peak_bytes <= target
    assert rg.added_seconds <= 1.03 * rm.added_seconds + 1e-9


def test_milp_through_plan(case):
    prof = case.profile
    plan = libra.plan(prof, prof.budget_for_share(0.5), solver="milp")
    assert plan.solver == "milp" and plan.predicted_peak_bytes <= plan.budget_bytes


def test_greedy_is_fast_on_test_profiles(case, planning):
    t0 = time.perf_counter()
    libra.plan(planning, case.profile.budget_for_share(0.5))
    assert time.perf_counter() - t0 < 1.0


def test_plan_is_deterministic(case):
    prof = case.profile
    a = libra.plan(prof, prof.budget_for_share(0.5))
    b = libra.plan(prof, prof.budget_for_share(0.5))
    a.planner_seconds = b.planner_seconds = 0.0
    assert a == b
