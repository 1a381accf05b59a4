"""The memory timeline: a plan maps back to the simulator state it was built from, and its curve peaks where the
plan says."""

import pytest

import libra
from libra.planner import Planning
from libra.planner.timeline import memory_timeline, state_of
from libra.testing import models
from libra.testing.synthetic import chain_profile


@pytest.fixture(scope="module")
def mlp_profile():
    model, x, y, loss_fn = models.make_mlp(batch=256, d=64, hidden=256, depth=4)
    return libra.profile(model, lambda: loss_fn(model(x), y).backward())


@pytest.mark.parametrize("host_bandwidth", [None, 1e9])
def test_plan_round_trips_to_its_state_and_peak(mlp_profile, tmp_path, host_bandwidth):
    planning = Planning(mlp_profile, host_bandwidth)
    for share in (1.0, 0.75, 0.5, 0.0):
        budget = max(mlp_profile.budget_for_share(share), planning.min_budget_bytes())
        plan = libra.plan(mlp_profile, budget, host_bandwidth=host_bandwidth)
        plan.save(tmp_path / "plan.json")
        loaded = libra.Plan.load(tmp_path / "plan.json")
        state = state_of(loaded, planning.units)
        rebuilt = planning.build(state, budget, planning.sim.run(state), "greedy", 0.0)
        assert rebuilt.regions == plan.regions and rebuilt.decisions == plan.decisions
        tl = memory_timeline(mlp_profile, loaded, host_bandwidth=host_bandwidth)
        assert max(tl.plan_bytes) == plan.predicted_peak_bytes <= budget
        assert max(tl.eager_bytes) == mlp_profile.eager_peak_bytes
        assert tl.eager_bytes[0] >= tl.static_bytes == mlp_profile.static_bytes
        assert 0 < tl.first_backward_op < tl.n_ops == mlp_profile.n_ops
        assert len(tl.op_start_seconds) == len(tl.plan_bytes) == tl.n_ops + 1
        assert tl.budget_bytes == budget
        if share == 1.0:
            assert tl.plan_bytes == tl.eager_bytes


def test_synthetic_profile_state_round_trip():
    prof = chain_profile(6, 5, seed=3)
    planning = Planning(prof)
    plan = libra.plan(prof, planning.min_budget_bytes())
    assert plan.regions
    state = state_of(plan, planning.units)
    assert planning.build(state, plan.budget_bytes, planning.sim.run(state), "greedy", 0.0).regions == plan.regions
    assert planning.sim.run(state).peak_bytes == plan.predicted_peak_bytes
    assert state_of(libra.plan(prof, prof.eager_peak_bytes), planning.units) == {}


def test_other_profile_or_missing_bandwidth_is_a_clear_error(mlp_profile):
    other = chain_profile(4, 4)
    plan = libra.plan(mlp_profile, Planning(mlp_profile).min_budget_bytes())
    with pytest.raises(libra.LibraError, match=r"^libra.memory_timeline: .*Fix: pass the profile"):
        memory_timeline(other, plan)
    only_offload = Planning(mlp_profile, 1e9, decisions={"keep", "offload"})
    offloading = libra.plan(only_offload, max(mlp_profile.budget_for_share(0.75), only_offload.min_budget_bytes()))
    assert any(r.offload or r.hooked for r in offloading.regions)  # in the cache, or whole calls hooked
    with pytest.raises(libra.LibraError, match="host_bandwidth"):
        memory_timeline(mlp_profile, offloading)
