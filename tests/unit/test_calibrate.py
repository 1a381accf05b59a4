"""The region executor's own cost (NOTE [Region overhead]): measured by the profiler, carried by the profile, used
by the simulator instead of a guess."""

import json
import math

import pytest

import libra
from libra.planner import Planning
from libra.planner.simulate import MODE_OVERHEAD_FACTOR, REGION_OVERHEAD_SECONDS, Simulator
from libra.runtime import calibrate
from libra.runtime.calibrate import cached_region_costs, region_costs
from libra.testing import models

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mlp_profile():
    model, x, y, loss_fn = models.make_mlp(batch=8)
    return libra.profile(model, lambda: loss_fn(model(x), y).backward())


def test_costs_are_measured_once_per_size_and_carried_by_the_profile(mlp_profile):
    carried = (mlp_profile.region_forward_op_seconds, mlp_profile.region_replay_op_seconds,
               mlp_profile.region_call_seconds)
    assert carried in [tuple(c) for c in calibrate._CACHE.values()]  # measured by libra.profile
    assert all(math.isfinite(c) and c >= 0 for c in carried)
    assert carried[0] + carried[1] > 0  # a dispatch mode is never free
    small = region_costs("cpu", 16 * 1024)
    assert region_costs("cpu", 17 * 1024) is small  # the same power-of-two size: measured once
    assert cached_region_costs("cpu", 20 * 1024) is small
    assert cached_region_costs("cuda:7", 16 * 1024) is None  # never measured there; measures nothing


def test_simulator_charges_the_measured_costs(mlp_profile):
    prof = mlp_profile
    planning = Planning(prof)
    state = planning.full_state
    assert state, "the MLP has blocks to recompute"
    sim = Simulator(prof, planning.units)
    assert (sim.per_op, sim.per_replay_op, sim.per_call) == (
        prof.region_forward_op_seconds, prof.region_replay_op_seconds, prof.region_call_seconds)
    base = sim.run(state).added_seconds
    # one more microsecond per forward op, per replayed op and per call: exactly that much more per region
    calls = [inst for ui in state for inst in planning.units[ui].instances]
    more = Simulator(prof, planning.units)
    more.per_op += 1e-6
    more.per_replay_op += 1e-6
    more.per_call += 1e-6
    expected = sum((i.end - i.start) * 1e-6 + 1e-6 + ((i.stop - i.start) * 1e-6 if i.t_r >= 0 else 0) for i in calls)
    assert more.run(state).added_seconds - base == pytest.approx(expected, rel=1e-6)


def test_profiles_without_measured_costs_fall_back(mlp_profile, tmp_path):
    path = tmp_path / "profile.json"
    mlp_profile.save(path)
    data = json.loads(path.read_text())
    assert data["region_replay_op_seconds"] == mlp_profile.region_replay_op_seconds  # saved with the profile
    for key in ("region_forward_op_seconds", "region_replay_op_seconds", "region_call_seconds"):
        del data[key]  # a profile written before they were measured
    path.write_text(json.dumps(data))
    old = libra.Profile.load(path)
    sim = Simulator(old, Planning(old).units)
    guess = MODE_OVERHEAD_FACTOR * old.dispatch_overhead_seconds
    assert (sim.per_op, sim.per_replay_op, sim.per_call) == (guess, guess, REGION_OVERHEAD_SECONDS)
