"""Plans on disk: round trip, and clear errors for corrupt, foreign or hand-edited files."""

import json

import pytest
import torch

import libra
from libra.planner import Planning
from libra.testing import models
from libra.units import format_bytes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, x, y, loss_fn = models.make_mlp(batch=2048, d=64, hidden=256, depth=4)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    plan = libra.plan(prof, Planning(prof).min_budget_bytes())
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    plan.save(path)
    return plan, path, model


def test_round_trip(saved):
    plan, path, _ = saved
    loaded = libra.Plan.load(path)
    assert loaded == plan
    assert json.loads(path.read_text())["schema_version"] == 1
    assert loaded.regions and loaded.counts[libra.Decision.RECOMPUTE] > 0
    # how it was made: what re-planning for new inputs repeats (a CPU profile measures no host link)
    assert loaded.allowed == ["keep", "offload", "recompute"] and loaded.host_bandwidth == 0.0
    assert loaded.provenance == {"memory": "step", "op_seconds": "step", "host_bandwidth": "none"}


def test_a_plan_records_a_given_host_link(saved):
    plan, path, model = saved
    x = torch.randn(2048, 64)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    model.zero_grad(set_to_none=True)
    offloading = libra.plan(prof, prof.budget_for_share(0.9), decisions={"keep", "offload"}, host_bandwidth=5e9)
    assert offloading.allowed == ["keep", "offload"] and offloading.host_bandwidth == 5e9
    assert offloading.provenance["host_bandwidth"] == "given"
    assert "host link       5.0 GB/s (given)" in offloading.explain()


def test_round_trip_of_a_hooked_plan(tmp_path):
    """A hooked region's ``stay`` (the saves left on the device) and prefetch trigger survive the file."""
    from libra.planner.simulate import EARLY, HOOKED

    model, x, y, loss_fn = models.make_resnet(batch=2, size=16)
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    planning = Planning(prof, 1e10)
    sel = planning.selections[0]
    state = {ui: HOOKED | {EARLY} for ui in range(len(sel.units)) if sel.sim.hook_ok(ui)}
    plan = planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)
    assert any(r.hooked and r.stay for r in plan.regions)
    assert any(r.prefetch_after for r in plan.regions)
    plan.save(tmp_path / "hooked.json")
    assert libra.Plan.load(tmp_path / "hooked.json") == plan


def _edit(path, tmp_path, fn):
    data = json.loads(path.read_text())
    fn(data)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.update(surprise=1), "unknown field"),
        (lambda d: d.pop("regions"), "lacks field"),
        (lambda d: d.update(budget_bytes=-1), "negative"),
        (lambda d: d["regions"][0].update(save=[-3]), "non-negative"),
        (lambda d: d["regions"][0].update(save=[10**6]), "beyond"),
        (lambda d: d["decisions"].update({"x:y#0": "teleport"}), "teleport"),
        (lambda d: d.update(predicted_step_seconds="fast"), "should be float"),
        (lambda d: d["regions"][0].update(stay=[0], hooked=False), "not hooked"),
        (lambda d: d["regions"][0].update(prefetch_after=["blocks.0"]), "prefetch_after should be [module, call]"),
        (lambda d: d.update(granularity="coarse"), "granularity should be one of"),
        (lambda d: d.update(allowed=["keep", "teleport"]), "allowed should list decisions"),
        (lambda d: d.update(host_bandwidth=-1.0), "negative"),
        (lambda d: d.update(provenance={"memory": 3}), "provenance should map"),
    ],
)
def test_hand_edited_plans_are_refused(saved, tmp_path, edit, message):
    _, path, _ = saved
    with pytest.raises(libra.PlanFormatError) as info:
        libra.Plan.load(_edit(path, tmp_path, edit))
    assert message in str(info.value)
    assert "Fix:" in str(info.value)


def test_truncated_and_foreign_files(saved, tmp_path):
    _, path, _ = saved
    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:200])
    with pytest.raises(libra.PlanFormatError, match="truncated"):
        libra.Plan.load(truncated)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(libra.PlanFormatError):
        libra.Plan.load(foreign)
    with pytest.raises(libra.PlanFormatError, match="cannot read"):
        libra.Plan.load(tmp_path / "missing.json")


def test_plan_for_another_model_names_the_first_differing_tensor(saved):
    plan, _, _ = saved
    other, *_ = models.make_mlp(batch=8, d=64, hidden=128, depth=3)
    with pytest.raises(libra.PlanMismatchError) as info:
        with libra.apply(other, plan):
            pass
    assert "blocks.0.fc1.weight" in str(info.value)
    assert "Fix:" in str(info.value)
    assert "forward" not in other.blocks[0].__dict__


def test_explain_reads_like_a_report(saved):
    plan, _, _ = saved
    text = plan.explain()
    assert "predicted peak" in text and "checkpointed modules" in text and "blocks.0" in text
    assert format_bytes(plan.predicted_peak_bytes) in text and format_bytes(plan.budget_bytes) in text
    assert "memory from one real step; op times timed in the step" in text
    for region in plan.regions:
        assert region.module in text
