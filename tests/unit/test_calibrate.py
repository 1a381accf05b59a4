"""The region executor's own cost (NOTE [Region overhead]): measured by the profiler, carried by the profile, used
by the simulator instead of a guess; and plain regions (NOTE [Plain regions]), which it makes worth planning."""

import copy
import gc
import json
import math

import pytest
import torch

import libra
from libra.planner import Planning
from libra.planner.simulate import MODE_OVERHEAD_FACTOR, PLAIN, REGION_OVERHEAD_SECONDS, Simulator
from libra.runtime import calibrate
from libra.runtime.calibrate import cached_region_costs, region_costs
from libra.testing import AllocatorMeter, assert_grads_equal, fixed_times, models

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt():
    model, x, y, loss_fn = models.make_gpt(batch=2, layers=4, d=64, seq=32, dropout=0.1)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    return model, x, y, loss_fn, prof


def test_costs_are_measured_once_per_size_and_carried_by_the_profile(gpt):
    carried = gpt[-1].region_costs
    assert len(carried) == 6
    assert carried in [list(c) for c in calibrate._CACHE.values()]  # measured by libra.profile
    assert all(math.isfinite(c) and c >= 0 for c in carried)
    assert carried[0] + carried[1] > 0  # a dispatch mode is never free
    small = region_costs("cpu", 16 * 1024)
    assert region_costs("cpu", 17 * 1024) is small  # the same power-of-two size: measured once
    assert cached_region_costs("cpu", 20 * 1024) is small
    assert cached_region_costs("cuda:7", 16 * 1024) is None  # never measured there; measures nothing


def test_a_cnn_is_costed_on_conv_layers_and_a_transformer_on_dense_ones(gpt):
    """NOTE [Region overhead]: the block the costs are measured on has the step's kind of ops."""
    forward = [o.name for o in gpt[-1].ops if not o.backward]
    assert calibrate.conv_weight(forward) == 0.0  # no convolution, no batch norm: the dense block's figures
    model, x, y, loss_fn = models.make_resnet(batch=2, size=16)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    weight = calibrate.conv_weight([o.name for o in prof.ops if not o.backward])
    assert weight == 1.0  # as many heavy ops per op as the conv block has, or more
    conv = [list(c) for k, c in calibrate._CACHE.items() if k[3] == "conv"]
    assert prof.region_costs in conv  # measured on the conv block, at the ResNet's size
    assert calibrate.conv_weight(["aten.convolution.default"] + ["aten.add.Tensor"] * 5) == pytest.approx(0.5)
    block = calibrate._op_names(calibrate._Block(1, "conv"), calibrate._input("conv", 1, torch.device("cpu")))
    assert sum(map(calibrate._heavy, block)) / len(block) == calibrate.CONV_BLOCK_HEAVY_SHARE, block
    with pytest.raises(libra.LibraError, match="block family"):
        region_costs("cpu", 16 * 1024, family="attention")


@pytest.mark.parametrize("family", calibrate.FAMILIES)
def test_a_calibration_leaves_nothing_live(family, monkeypatch):
    """The conv block's ReLU and batch norm save their outputs: held by a pack hook, each was held by its own
    grad_fn, a cycle gc cannot see, and every calibration left its blocks' 1.2 MB allocated (a later step then began
    above what its profile counted as static)."""
    monkeypatch.setattr(calibrate, "_CACHE", {})  # measured afresh
    with AllocatorMeter() as meter:
        region_costs("cpu", 64 * 1024, family)
        gc.collect()
        assert meter.current_bytes == meter.start_bytes


def test_mixed_figures_lie_between_the_families():
    dense, conv = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0), (3.0, 2.0, 1.0, 8.0, 5.0, 0.0)
    assert calibrate._mixed(dense, conv, 0.25) == pytest.approx((1.5, 2.0, 2.5, 5.0, 5.0, 4.5))
    assert calibrate._mixed(dense, None, 0.25) == dense  # one family measured (the other weighed too little)
    assert calibrate._mixed(None, None, 0.5) == ()  # nothing measured: the planner's fallbacks


def test_simulator_charges_the_measured_costs(gpt):
    prof = copy.deepcopy(gpt[-1])
    prof.region_costs = [1e-5, 2e-5, 1e-4, 1e-6, 3e-6, 5e-5]
    planning = Planning(prof)
    state = planning.full_state
    assert state, "the GPT has blocks to recompute"
    sim = planning.sim
    assert (sim.per_op, sim.per_replay_op, sim.per_call) == (1e-5, 2e-5, 1e-4)
    assert sim.plain_costs == (1e-6, 3e-6, 5e-5)
    base = sim.run(state).added_seconds
    # one more microsecond per forward op, per replayed op and per call: exactly that much more per region
    calls = [inst for ui in state for inst in planning.units[ui].instances]
    more = Simulator(prof, planning.units)
    more.per_op += 1e-6
    more.per_replay_op += 1e-6
    more.per_call += 1e-6
    expected = sum((i.end - i.start) * 1e-6 + 1e-6 + ((i.stop - i.start) * 1e-6 if i.t_r >= 0 else 0) for i in calls)
    assert more.run(state).added_seconds - base == pytest.approx(expected, rel=1e-6)


def test_profiles_without_measured_costs_fall_back_and_plan_no_plain_regions(gpt, tmp_path):
    path = tmp_path / "profile.json"
    gpt[-1].save(path)
    data = json.loads(path.read_text())
    assert data["region_costs"] == gpt[-1].region_costs  # saved with the profile
    del data["region_costs"]  # a profile written before they were measured
    path.write_text(json.dumps(data))
    old = libra.Profile.load(path)
    sim = Simulator(old, Planning(old).units)
    guess = MODE_OVERHEAD_FACTOR * old.dispatch_overhead_seconds
    assert (sim.per_op, sim.per_replay_op, sim.per_call) == (guess, guess, REGION_OVERHEAD_SECONDS)
    assert sim.plain_costs is None
    plan = libra.plan(old, Planning(old).min_budget_bytes())
    assert plan.regions and not any(r.plain for r in plan.regions)


def _cheap_plain(prof):
    """Fixed op times, Libra's modes dear and plain checkpoint cheap: plans turn every fully recomputed unit plain."""
    prof = fixed_times(copy.deepcopy(prof))
    prof.region_costs = [1e-4, 1e-4, 1e-3, 1e-6, 1e-6, 1e-5]
    return prof


def test_plain_regions_are_simulated_without_cache_skip_or_modes(gpt):
    planning = Planning(_cheap_plain(gpt[-1]))
    state = dict(planning.full_state)
    modes = planning.sim.run(state)
    for ui in state:
        state[ui] = PLAIN
    plain = planning.sim.run(state)
    assert plain.added_seconds < modes.added_seconds
    built = planning.build(state, 0, plain, "greedy", 0.0).regions
    assert built and all(r.plain and not (r.save or r.skip) for r in built)  # nothing cached, nothing skipped


@pytest.mark.parametrize("share", [0.5, "min"])
def test_plain_regions_run_exactly_and_within_budget(gpt, share):
    model, x, y, loss_fn, measured = gpt
    prof = _cheap_plain(measured)
    planning = Planning(prof)
    budget = planning.min_budget_bytes() if share == "min" else max(prof.budget_for_share(share),
                                                                     planning.min_budget_bytes())
    plan = libra.plan(planning, budget)
    assert any(r.plain for r in plan.regions), [r.module for r in plan.regions]
    assert all(not (r.save or r.skip or r.offload) for r in plan.regions if r.plain)
    again = libra.Plan.load(_saved(plan))
    assert [r.plain for r in again.regions] == [r.plain for r in plan.regions]

    eager, ours = copy.deepcopy(model), copy.deepcopy(model)
    for meter in _side_by_side(eager, ours, x, y, loss_fn, plan):  # dropout replays draw what the forward drew
        # the meter sees every live tensor (the fixture's and the eager copy's too): compare above what was live
        above, predicted = meter.peak_bytes - meter.start_bytes, plan.predicted_peak_bytes - prof.static_bytes
        assert above <= budget - prof.static_bytes
        assert abs(above - predicted) <= 0.05 * plan.predicted_peak_bytes


def _side_by_side(eager, ours, x, y, loss_fn, plan, steps: int = 2) -> list:
    """``steps`` steps of ``eager`` as it is and of ``ours`` under ``plan``, each checked equal (loss, gradients,
    parameters, buffers); the meter of each of ours."""
    meters = []
    for i in range(steps):
        torch.manual_seed(10 + i)
        with AllocatorMeter(extra=list(ours.parameters())) as meter, libra.apply(ours, plan):
            loss_o = loss_fn(ours(x), y)
            loss_o.backward()
        torch.manual_seed(10 + i)
        loss_e = loss_fn(eager(x), y)
        loss_e.backward()
        assert torch.equal(loss_e, loss_o)
        assert_grads_equal(eager, ours)
        del loss_e, loss_o
        for m in (eager, ours):
            m.zero_grad(set_to_none=True)
        meters.append(meter)
    return meters


@pytest.mark.parametrize("make", [models.make_resnet, models.make_unet], ids=["resnet", "unet"])
@pytest.mark.parametrize("share", [0.5, "min"])
def test_units_that_write_module_state_go_plain_with_a_guarded_replay(make, share):
    """NOTE [Guarded replay]: BatchNorm blocks may be plain; their replay writes the running statistics and
    ``num_batches_tracked`` to private copies, so after each step every buffer equals eager's (plain checkpoint
    alone counts each BatchNorm twice), gradients too, and the step stays within its budget."""
    model, x, y, loss_fn = make(batch=2, size=16)
    eager = copy.deepcopy(model)
    torch.manual_seed(3)
    prof = _cheap_plain(libra.profile(model, lambda: loss_fn(model(x), y).backward()))
    torch.manual_seed(3)
    loss_fn(eager(x), y).backward()
    planning = Planning(prof)
    assert any(u.protect and u.plain_ok for u in planning.units)
    budget = planning.min_budget_bytes() if share == "min" else max(prof.budget_for_share(share),
                                                                     planning.min_budget_bytes())
    plan = libra.plan(planning, budget)
    guarded = [r for r in plan.regions if r.plain and r.protect]
    assert guarded, [(r.module, r.plain, bool(r.protect)) for r in plan.regions]
    again = libra.Plan.load(_saved(plan))
    assert [(r.plain, r.protect) for r in again.regions] == [(r.plain, r.protect) for r in plan.regions]
    for meter in _side_by_side(eager, model, x, y, loss_fn, plan):  # buffers equal: each BatchNorm counted once
        assert meter.peak_bytes - meter.start_bytes <= budget - prof.static_bytes
    tracked = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == 3 for b in tracked)  # the profiled step and two more


def test_plain_replay_guards_only_units_that_write_module_state():
    """NOTE [Plain regions]: a guarded plain unit pays a replay mode's cost per replayed op, an unguarded one plain
    checkpoint's."""
    model, x, y, loss_fn = models.make_resnet(batch=2, size=16)
    prof = _cheap_plain(libra.profile(model, lambda: loss_fn(model(x), y).backward()))
    sim = Planning(prof).sim
    costs = {bool(u.protect): sim.plain_replay_op(ui) for ui, u in enumerate(sim.units)}
    _, replay, _, _, plain_replay, _ = prof.region_costs
    assert costs[True] == replay  # a dispatch mode in the replay, as Libra's replay mode
    if False in costs:
        assert costs[False] == plain_replay


def _saved(plan):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "plan.json"
    plan.save(path)
    return path


class _OwnGeneratorBlock(torch.nn.Module):
    """A block whose dropout-like mask draws from its own torch.Generator."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.g = torch.Generator().manual_seed(5)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return x + h * torch.bernoulli(torch.full_like(h, 0.8), generator=self.g)


def test_units_drawing_from_their_own_generator_never_go_plain_and_replay_exactly():
    """NOTE [Own generators]: a replayed op gets its generator's state from before its forward run (this failed,
    max difference 45.9, before the region modes restored it); plain checkpoint cannot, so such units never go plain."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_OwnGeneratorBlock(64) for _ in range(4)])
    x = torch.randn(256, 64)
    eager = copy.deepcopy(model)
    for m in (model, eager):  # deepcopy copies the generators' states too; keep them in step explicitly
        for i, b in enumerate(m):
            b.g.manual_seed(5 + i)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    eager(x).sum().backward()
    assert any(o.generator for o in prof.ops if o.random)  # the profile knows which ops drew from their own
    cheap = _cheap_plain(prof)
    planning = Planning(cheap)
    assert planning.units and not any(u.plain_ok for u in planning.units)
    plan = libra.plan(planning, planning.min_budget_bytes())
    assert plan.regions and not any(r.plain for r in plan.regions)
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    with libra.apply(model, plan):
        model(x).sum().backward()
    eager(x).sum().backward()
    assert_grads_equal(eager, model)  # Libra's modes restore the block's own generator for the replay
