"""A step that raises, nested apply, and bad arguments: clear errors, no hook left behind."""

import copy
import logging

import pytest
import torch

import libra
from libra.planner import Planning
from libra.testing import assert_grads_equal, fixed_times, models


@pytest.fixture(scope="module")
def setup():
    model, x, y, loss_fn = models.make_mlp(batch=2048, d=64, hidden=256, depth=4)
    base = copy.deepcopy(model)
    # fixed times: the plan runs Libra's modes (no plain regions), whose per-op log the LIBRA_DEBUG test reads
    prof = fixed_times(libra.profile(model, lambda: loss_fn(model(x), y).backward()))
    return base, x, y, loss_fn, prof, libra.plan(prof, Planning(prof).min_budget_bytes())


class Boom(Exception):
    pass


def _no_hooks(model):
    return all("forward" not in m.__dict__ and not m._forward_pre_hooks and not m._forward_hooks
               for m in model.modules())


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_exception_inside_apply_propagates_and_leaves_nothing(setup, exc):
    base, x, y, loss_fn, _, plan = setup
    model = copy.deepcopy(base)
    with pytest.raises(exc):
        with libra.apply(model, plan):
            loss_fn(model(x), y).backward()
            raise exc()
    assert _no_hooks(model)
    model.zero_grad(set_to_none=True)
    ref = copy.deepcopy(base)
    loss_fn(model(x), y).backward()
    loss_fn(ref(x), y).backward()
    assert_grads_equal(ref, model)


def test_step_that_raises_during_profile_propagates_unchanged(setup):
    base, x, *_ = setup
    model = copy.deepcopy(base)

    def step():
        model(x).sum().backward()
        raise Boom("from the step")

    with pytest.raises(Boom, match="from the step"):
        libra.profile(model, step)
    assert _no_hooks(model)


def test_apply_twice_at_once_is_refused(setup):
    base, *_, plan = setup
    model = copy.deepcopy(base)
    with libra.apply(model, plan):
        with pytest.raises(libra.LibraError, match="already applied"):
            with libra.apply(model, plan):
                pass
    assert _no_hooks(model)


def test_bad_arguments(setup):
    base, *_, prof, plan = setup
    with pytest.raises(libra.LibraError, match="expected a torch.nn.Module"):
        libra.profile("model", lambda: None)
    with pytest.raises(libra.LibraError, match="callable"):
        libra.profile(base, 3)
    with pytest.raises(libra.LibraError, match="libra.Profile"):
        libra.plan({"not": "a profile"}, "1GiB")
    with pytest.raises(libra.LibraError, match="unknown solver"):
        libra.plan(prof, "1GiB", solver="magic")
    with pytest.raises(libra.LibraError, match="libra.Plan"):
        with libra.apply(base, "plan.json"):
            pass
    for bad in (0, -1, "abc", "1.5 XB"):
        with pytest.raises(libra.LibraError, match="budget"):
            libra.plan(prof, bad)


def test_no_grad_step_inside_apply_is_plain(setup):
    base, x, y, loss_fn, _, plan = setup
    model = copy.deepcopy(base)
    with libra.apply(model, plan), torch.no_grad():
        out = model(x)
    assert torch.equal(out, base(x).detach())


def test_kill_switch(setup, monkeypatch):
    base, *_, plan = setup
    model = copy.deepcopy(base)
    monkeypatch.setenv("LIBRA_DISABLE", "1")
    with libra.apply(model, plan):
        assert _no_hooks(model)


def test_info_line_per_applied_plan(setup, caplog):
    base, x, y, loss_fn, _, plan = setup
    model = copy.deepcopy(base)
    counts = plan.counts
    with caplog.at_level(logging.INFO, logger="libra"), libra.apply(model, plan):
        pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan applied")]
    assert lines == [
        f"plan applied: {counts[libra.Decision.KEEP]} kept / {counts[libra.Decision.RECOMPUTE]} recomputed / "
        f"{counts[libra.Decision.OFFLOAD]} offloaded, predicted peak {libra.units.format_bytes(plan.predicted_peak_bytes)}"
        f" of budget {libra.units.format_bytes(plan.budget_bytes)}"
    ]


def test_libra_debug_logs_every_region_op(setup, monkeypatch, caplog):
    base, x, y, loss_fn, _, plan = setup
    model, eager = copy.deepcopy(base), copy.deepcopy(base)
    monkeypatch.setenv("LIBRA_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="libra"), libra.apply(model, plan):
        loss_fn(model(x), y).backward()
    loss_fn(eager(x), y).backward()
    assert_grads_equal(eager, model)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    n_ops = sum(len(r.ops) for r in plan.regions)
    forward = [m for m in lines if " forward op " in m]
    replay = [m for m in lines if " replay op " in m]
    # every forward op once; a replay stops once it made what backward needs (checkpoint's early stop)
    assert len(forward) == n_ops and 0 < len(replay) <= n_ops, (len(forward), len(replay), n_ops)
    assert all(m.endswith(("recomputed later", "saved", "offloaded")) for m in forward)
    assert all(m.endswith(("recomputed", "from the cache")) for m in replay)
    assert any(m.endswith("recomputed") for m in replay)
    libra_logger = logging.getLogger("libra")
    for h in list(libra_logger.handlers):  # the handler LIBRA_DEBUG added for users without logging set up
        libra_logger.removeHandler(h)
    libra_logger.setLevel(logging.NOTSET)


# ---- the runtime's guards against wrong gradients: each refuses loudly when the step differs from the profiled one
class _Flagged(torch.nn.Module):
    """Three residual blocks; ``flags`` make the next step do what the profiled one did not."""

    def __init__(self, flags: dict) -> None:
        super().__init__()
        self.flags = flags
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 128), _Act(flags), torch.nn.Linear(128, 32)) for _ in range(3))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            before = x
            x = block(x)
            if i == 0 and self.flags.get("change input"):
                before.mul_(1.5)  # the block's input, changed after the block ran
            if i == 0 and self.flags.get("change output"):
                x.mul_(1.5)  # the block's output, changed after it returned
            x = torch.tanh(x)
        return self.head(x)


class _Act(torch.nn.Module):
    def __init__(self, flags: dict) -> None:
        super().__init__()
        self.flags = flags

    def forward(self, x):
        return torch.sigmoid(x) if self.flags.get("other op") else torch.relu(x)


def _guarded(flag: str):
    flags: dict = {}
    torch.manual_seed(0)
    model, x, y = _Flagged(flags), torch.randn(64, 32), torch.randint(0, 4, (64,))
    step = lambda: torch.nn.functional.cross_entropy(model(x), y).backward()  # noqa: E731
    prof = fixed_times(libra.profile(model, step))  # fixed times: Libra's modes, never plain checkpoint
    model.zero_grad(set_to_none=True)
    plan = libra.plan(prof, Planning(prof).min_budget_bytes())
    assert plan.regions and not any(r.plain for r in plan.regions)
    return model, x, y, flags, plan


def test_a_replay_that_runs_other_ops_than_its_forward_raises():
    model, x, y, flags, plan = _guarded("other op")
    with libra.apply(model, plan):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        flags["other op"] = True  # the replay in backward takes another branch than the forward did
        with pytest.raises(libra.LibraError, match="not deterministic given its inputs"):
            loss.backward()
    assert _no_hooks(model)


def test_an_input_changed_in_place_after_its_region_ran_raises():
    model, x, y, flags, plan = _guarded("change input")
    assert any(r.module == "blocks.0" for r in plan.regions)
    flags["change input"] = True
    with libra.apply(model, plan):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        # Libra's own guard, or autograd's version check on what checkpoint saved: an error, never wrong gradients
        with pytest.raises(RuntimeError, match="changed in place after its forward ran|modified by an inplace"):
            loss.backward()
    assert _no_hooks(model)


def test_a_cached_output_changed_in_place_after_its_region_returned_raises_or_matches_eager():
    """An output the cache keeps, changed in place after the module returned: the replay would see the changed
    value, so it refuses, unless nothing the replay needs depends on it; then the gradients are eager's."""
    model, x, y, flags, plan = _guarded("change output")
    eager = copy.deepcopy(model)
    flags["change output"] = True
    eager.flags = eager.blocks[0][1].flags = flags
    torch.manual_seed(3)
    try:
        with libra.apply(model, plan):
            torch.nn.functional.cross_entropy(model(x), y).backward()
    except libra.LibraError as e:
        assert "was changed in place after the module returned" in str(e)
        return
    torch.manual_seed(3)
    torch.nn.functional.cross_entropy(eager(x), y).backward()
    assert_grads_equal(eager, model)
