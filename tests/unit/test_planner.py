"""The planner on real profiles: the greedy against the exact reference over options, and the simulator against
eager's own timeline."""

import copy
from pathlib import Path

import pytest

import libra
from libra.planner import Planning
from libra.planner.solvers import milp


def _steady_times(profile):
    """The profile with op times that depend only on the op's output bytes, and fixed costs of Libra's executor
    and of a copy: measured times, the calibrations included, vary from run to run on a shared machine (on a loaded
    one the ResNet's default plan with offload went from 1.2x to 1.76x the exact one's added time), and the
    greedy-vs-MILP comparison should not."""
    prof = copy.deepcopy(profile)
    for op in prof.ops:
        op.seconds = 1e-5 * (1 + sum(prof.storages[s].nbytes for s in op.outputs) / 2**20)
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    prof.dispatch_overhead_seconds = 1e-6
    prof.region_costs = [2e-5, 2e-5, 6e-5, 8e-6, 8e-6, 3e-5]
    prof.copy_seconds_per_byte = 1e-10
    return prof


@pytest.fixture
def planning(case):
    return Planning(case.profile)


def test_simulator_reproduces_eager_peak(case, planning):
    assert planning.eager.peak_bytes == case.profile.eager_peak_bytes
    # every module ran: nothing reserved for layers a step skipped (NOTE [Layers the profiled step skipped])
    assert planning.unprofiled == [] and planning.reserve_bytes == 0


@pytest.mark.parametrize("bandwidth", [None, 2e9], ids=["recompute", "offload-2GB/s"])
@pytest.mark.parametrize("share", [0.9, 0.75, 0.5, "min"])
def test_default_solver_within_1_percent_of_milp(case, share, bandwidth):
    # The exact solver starts from nothing the default found (NOTE [Exact up to interactions] in solvers/milp.py)
    # and picks from the same options: the default's plan may be faster (where the units interact, the simulator
    # is the judge, not the program's sum) but never more than 1% slower. Known misses this caught: ResNet at 75%
    # (three half-used bottleneck blocks where two whole ones fit, 1.33x: NOTE [Option family]), GPT and MLP
    # at 75% (three plain blocks where two fit, 1.5x: NOTE [Option family] in solvers/options.py); with offload,
    # hooked blocks each cheap alone that together kept the host link busier than the step (NOTE [Prefetch]);
    # ResNet at 75%, once BatchNorm blocks could go plain, three plain units where two larger ones fit (the rate path
    # never takes the larger, NOTE [Option family]); ResNet with offload at 75%, 12% above (two hooked bottlenecks to
    # swap for recompute at once), which the same bytes-first path fixed.
    planning = Planning(_steady_times(case.profile), bandwidth)
    prof = planning.profile
    solved = unreachable = 0
    misses = []
    # "min": the named minimum, the lowest peak of every selection's plans (the default's plan there was the
    # lowest-peak plan as found, 1.27x eager on the bench GPT with offload where the exact one is 1.11x)
    budget = planning.min_budget_bytes() if share == "min" else prof.budget_for_share(share)
    target = planning.target_bytes(budget)
    for sel in planning.selections:  # each region granularity (NOTE [Region granularity])
        state = planning._solve_in(sel, budget, target, "greedy", 60.0)
        if state is None:  # this selection's plans do not reach the named minimum; a finer one's do
            assert share == "min" and planning._lowest_of(sel)[1].peak_bytes > target
            continue
        choice = milp.solve(sel.problem, target)
        if choice is None:  # the lowest peak needs a plan out of the options' reach (NOTE [Options per unit])
            assert share == "min"
            unreachable += 1
            continue
        rg, rm = sel.sim.run(state), sel.sim.run(sel.problem.state(choice))
        assert rg.peak_bytes <= target and rm.peak_bytes <= target
        if rg.added_seconds > 1.01 * rm.added_seconds + 1e-12:
            misses.append((sel.granularity, rg.added_seconds, rm.added_seconds))
        solved += 1
    assert solved or unreachable  # (the test ResNet with offload at its minimum: no option plan reaches it)
    assert not misses, misses


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
    # NOTE [Monotone in the budget] (solvers/options.py), on real profiles, with offloading and without (steady op
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


@pytest.mark.parametrize("bandwidth", [None, 2e9, 1e10], ids=["recompute", "offload-2GB/s", "offload-10GB/s"])
def test_no_unit_of_the_minimum_plan_has_a_cheaper_option_at_its_peak(case, bandwidth):
    # The plan at the named minimum is the lowest peak the searches found; each unit then takes its cheapest option
    # that keeps that peak (Selection._cheapest_at). Checked here by the simulator alone, one unit at a time, over
    # every option of the unit and none: on the bench GPT with a 2 GB/s link the plan as found hooked every block
    # with its copies back at the first unpack, 1.27x eager, where copies back at the prefetch trigger for half
    # the blocks give the same peak at 1.11x.
    planning = Planning(_steady_times(case.profile), bandwidth)
    sel = planning.lowest
    state, got = planning._lowest_of(sel)
    problem = sel.problem
    if problem.choice_of(state) is None:
        pytest.skip("the minimum plan has an entry outside the options (a hooked or offloading lowest state): no "
                    "trim applies")
    cheaper = []
    for ui in state:
        for o in [None, *problem.of_unit[ui]]:
            trial = {u: e for u, e in state.items() if u != ui}
            if o is not None:
                trial[ui] = problem.options[o].entry()
            r = sel.sim.run(trial)
            if r.peak_bytes <= got.peak_bytes and r.added_seconds < got.added_seconds * (1 - 1e-9) - 1e-12:
                cheaper.append((ui, o, r.added_seconds, got.added_seconds))
    assert not cheaper, cheaper


@pytest.mark.parametrize("bandwidth", [None, 2e9], ids=["recompute", "offload-2GB/s"])
def test_no_single_option_alone_is_cheaper_than_the_plan(case, bandwidth):
    # A plan of one unit under one option is in the family where no other lone option beats it on both peak and
    # cost (NOTE [Option family]); checked here against every option of every unit, each simulated alone. The
    # growth rule ranks bytes per second, so before, a unit that fits alone at a lower rate was never chosen (the
    # bench U-Net at 90%: two blocks at 1.49x eager where its input block alone fits at 1.22x).
    planning = Planning(_steady_times(case.profile), bandwidth)
    prof = planning.profile
    for share in (0.9, 0.75, 0.5):
        budget = max(planning.min_budget_bytes(), prof.budget_for_share(share))
        plan = libra.plan(planning, budget)
        added = plan.predicted_step_seconds - prof.eager_step_seconds
        target = planning.target_bytes(budget)
        cheaper = []
        for sel in planning.selections:
            problem = sel.problem
            for o, opt in enumerate(problem.options):
                r = sel.sim.run({int(problem.unit_of[o]): opt.entry()})
                if r.peak_bytes <= target and r.added_seconds < added * (1 - 1e-9) - 1e-12:
                    cheaper.append((share, sel.granularity, o, r.added_seconds, added))
        assert not cheaper, cheaper[:5]


_BENCH_PROFILES = Path(__file__).resolve().parents[2] / "bench" / "results" / "profiles"
# (model, bandwidth, share) -> the most the default's added time may exceed the exact program's, where it misses 1%
_BENCH_MISSES = {
    # with the suite's steady op times, the U-Net with the link: a plan well inside a wide gap between members (6.7%
    # before the gap middles, NOTE [Option family]; 1.3% since)
    ("unet-steady", 2e9, 0.75): 0.02,
}


# with offload, the U-Net and the Mixer only: the exact program takes 10-20 s per budget on the others
@pytest.mark.parametrize("model, bandwidth", [(m, None) for m in ("gpt", "resnet", "unet", "mixer")]
                         + [(m, 2e9) for m in ("unet", "mixer", "unet-steady")])
def test_default_solver_on_the_bench_profiles(model, bandwidth):
    """The default against the exact option program on the bench models' saved profiles (their measured op times,
    fixed in the file, so the comparison does not move with the machine; ``-steady``: the suite's steady ones):
    within 1% of the added time at 90/75/50% and at the minimum, but for the recorded misses, each held to its own
    bound (the Mixer at 75% missed by 2.3% while chains reached four members up only: its exact plan is a member
    less two plain blocks, 22 MB up; NOTE [Option family])."""
    name, _, times = model.partition("-")
    prof = libra.Profile.load(_BENCH_PROFILES / f"{name}.json.gz")
    if times == "steady":
        prof = _steady_times(prof)
    planning = Planning(prof, bandwidth)
    worse = {}
    for share in (0.9, 0.75, 0.5, "min"):
        budget = planning.min_budget_bytes() if share == "min" else max(prof.budget_for_share(share),
                                                                        planning.min_budget_bytes())
        target = planning.target_bytes(budget)
        found = planning.solve(budget)
        assert found is not None
        got = found[0].sim.run(found[1])
        assert got.peak_bytes <= target
        exact = None
        for sel in planning.selections:
            choice = milp.solve(sel.problem, target)
            if choice is not None:
                r = sel.sim.run(sel.problem.state(choice))
                assert r.peak_bytes <= target
                exact = r.added_seconds if exact is None else min(exact, r.added_seconds)
        if exact is not None and got.added_seconds > 1.01 * exact + 1e-12:
            worse[share] = got.added_seconds / exact - 1
    for share, over in worse.items():
        assert over <= _BENCH_MISSES.get((model, bandwidth, share), 0.0), (share, over)
