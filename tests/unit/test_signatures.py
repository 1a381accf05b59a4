"""Steps whose inputs differ from the profiled ones: each input signature gets a plan of its own, made for the same
budget, and no step runs under a plan made for other inputs (NOTE [Plans per input signature] in runtime/apply.py).

Every test trains an eager copy alongside and compares every gradient, parameter and buffer bit for bit after each
step, whether the step ran under a plan, was profiled, or ran plainly.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import awkward_models as am
import libra
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import AllocatorMeter, LiveBytesMeter, assert_grads_equal

RECOMPUTE = libra.Decision.RECOMPUTE
NEW_INPUTS = "differ from the planned"


pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, am.VOCAB, (batch, seq), generator=g),
            torch.randint(0, am.VOCAB, (batch, seq), generator=g))


def lm_step(model, batch):
    idx, y = batch
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    return loss.detach()


class Pair:
    """An eager model and a Libra copy trained side by side on the same batches and seeds."""

    def __init__(self, share: float = 0.5) -> None:
        torch.manual_seed(0)
        self.eager = am.TokenModel(am.ExplicitAttentionBlock, depth=4)
        self.ours = copy.deepcopy(self.eager)
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (self.eager, self.ours)]
        # every batch is made now and stays alive: the same tensors are live at every step's start
        self.batches = {
            "planned": tokens(am.TOK_BATCH, am.SEQ, 1),
            "shorter": tokens(am.TOK_BATCH, am.SEQ - 8, 2),
            "half": tokens(am.TOK_BATCH, am.SEQ // 2, 3),
            "double batch": tokens(2 * am.TOK_BATCH, am.SEQ, 4),
        }
        torch.manual_seed(1234)
        self.profile = libra.profile(self.ours, lambda: lm_step(self.ours, self.batches["planned"]))
        torch.manual_seed(1234)
        lm_step(self.eager, self.batches["planned"])
        self.finish()
        budget = max(self.profile.budget_for_share(share), libra.planner.Planning(self.profile).min_budget_bytes())
        self.plan = libra.plan(self.profile, budget)
        assert self.plan.counts[RECOMPUTE] > 0
        assert self.plan.input_signature == [f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ}]"]
        self.step_index = 0

    def finish(self) -> None:
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def step(self, name: str) -> AllocatorMeter:
        """One step on both copies (Libra's under whatever ``apply`` block is open); asserts bit-equality."""
        self.step_index += 1
        batch = self.batches[name]
        torch.manual_seed(100 + self.step_index)
        with AllocatorMeter(extra=list(self.ours.parameters())) as meter:
            loss_o = lm_step(self.ours, batch)
        torch.manual_seed(100 + self.step_index)
        loss_e = lm_step(self.eager, batch)
        assert torch.equal(loss_e, loss_o), f"step {self.step_index} ({name}): loss differs from eager"
        assert_grads_equal(self.eager, self.ours)
        self.finish()
        del loss_o, loss_e
        return meter


def _new_input_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if NEW_INPUTS in r.getMessage()]


def _nothing_installed(model) -> bool:
    return all("forward" not in m.__dict__ and not m._forward_pre_hooks and not m._forward_hooks
               for m in model.modules()) and _ACTIVE_ATTR not in model.__dict__


def test_each_input_signature_gets_its_own_plan(caplog):
    pair = Pair()
    schedule = ["planned", "shorter", "shorter", "planned", "half", "half", "shorter", "planned"]
    meters = []
    with caplog.at_level(logging.INFO, logger="libra"):
        with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
            for name in schedule:
                meters.append((name, pair.step(name)))
    assert _nothing_installed(pair.ours)
    # one warning per new signature, at its first step only (that step is profiled)
    warned = _new_input_warnings(caplog)
    assert len(warned) == 2 and "24, 24" in warned[0] and "24, 16" in warned[1], warned
    variants = pair.plan.__dict__["_libra_variants"].plans
    assert sorted(variants) == [(f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ // 2}]",),
                                (f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ - 8}]",)]
    for variant in variants.values():
        assert variant.budget_bytes == pair.plan.budget_bytes
        assert variant.predicted_peak_bytes <= variant.budget_bytes
    by_name = {"planned": pair.plan, "shorter": variants[(f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ - 8}]",)],
               "half": variants[(f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ // 2}]",)]}
    assert by_name["shorter"].counts[RECOMPUTE] > 0
    seen = set()
    for name, meter in meters:
        assert meter.start_bytes == pair.profile.static_bytes
        if name in seen or name == "planned":  # under the plan for its own inputs: the budget and prediction hold
            plan = by_name[name]
            assert meter.peak_bytes <= plan.budget_bytes, (name, meter.peak_bytes, plan.budget_bytes)
            assert abs(meter.peak_bytes - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, name
        else:  # profiled: ran plainly, as eager
            assert meter.peak_bytes > pair.plan.budget_bytes or name == "half"
        seen.add(name)


def test_a_mode_entered_around_the_steps_survives_profiling():
    # the recording starts inside the root call and ends inside backward, under the user's meter: it must leave
    # the mode stack before the meter does (NOTE [Leaving a recording])
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    pair = Pair()
    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks

    def pack(t):
        return t

    with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
        with LiveBytesMeter(extra=list(pair.ours.parameters())), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mode = _get_current_dispatch_mode()
            pair.step("shorter")  # profiled
            assert _get_current_dispatch_mode() is mode and top_hooks(False)[0] is pack
            pair.step("shorter")
            assert _get_current_dispatch_mode() is mode and top_hooks(False)[0] is pack
    assert _get_current_dispatch_mode() is None and top_hooks(False) is None
    assert len(pair.plan.__dict__["_libra_variants"].plans) == 1  # the profiled step was planned


def test_plans_for_other_inputs_outlive_the_with_block(caplog):
    pair = Pair()
    with caplog.at_level(logging.WARNING, logger="libra"):
        for name in ["shorter", "shorter", "planned", "shorter"]:
            with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
                meter = pair.step(name)
            assert _nothing_installed(pair.ours)
    assert len(_new_input_warnings(caplog)) == 1  # profiled once, its plan reused by the later blocks
    assert meter.peak_bytes <= pair.plan.budget_bytes


def test_inputs_too_big_for_the_budget_get_the_smallest_peak(caplog):
    pair = Pair(share=0.35)
    with caplog.at_level(logging.WARNING, logger="libra"):
        with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
            pair.step("double batch")
            meter = pair.step("double batch")
    assert any("no plan fits the budget" in m.getMessage() for m in caplog.records)
    (variant,) = pair.plan.__dict__["_libra_variants"].plans.values()
    assert variant.budget_bytes > pair.plan.budget_bytes and variant.counts[RECOMPUTE] > 0
    assert meter.peak_bytes <= variant.budget_bytes


def test_replan_false_runs_new_inputs_plainly(caplog):
    pair = Pair()
    with caplog.at_level(logging.WARNING, logger="libra"):
        with libra.apply(pair.ours, pair.plan, on_over_budget="warn", replan=False):
            for name in ["shorter", "planned", "shorter"]:
                pair.step(name)
    warned = _new_input_warnings(caplog)
    assert len(warned) == 1 and "replan=False" in warned[0]
    assert "_libra_variants" not in pair.plan.__dict__ or not pair.plan.__dict__["_libra_variants"].plans


def test_plans_for_other_inputs_are_bounded():
    pair = Pair()
    with libra.apply(pair.ours, pair.plan, on_over_budget="warn", max_plans=1):
        for name in ["shorter", "half", "half", "shorter"]:
            pair.step(name)
    variants = pair.plan.__dict__["_libra_variants"]
    assert len(variants.plans) == 1 and variants.profiled == 3  # "shorter" was dropped for "half", then profiled again


def test_a_profiled_forward_without_backward_is_discarded():
    pair = Pair()
    idx, _ = pair.batches["shorter"]
    with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
        pair.ours(idx).sum()  # grad enabled, but no backward: the recording is dropped at the next step
        pair.step("shorter")  # profiled again, now with its backward
        pair.step("shorter")
    variants = pair.plan.__dict__["_libra_variants"]
    assert len(variants.plans) == 1 and variants.profiled == 1
    assert _nothing_installed(pair.ours)


def test_an_exception_in_a_profiled_step_leaves_nothing_behind():
    pair = Pair()
    idx, _ = pair.batches["shorter"]
    with pytest.raises(ZeroDivisionError):
        with libra.apply(pair.ours, pair.plan, on_over_budget="warn"):
            pair.ours(idx)
            raise ZeroDivisionError
    assert _nothing_installed(pair.ours)
    pair.step("shorter")  # a plain step afterwards equals eager's


def test_plan_without_a_recorded_signature_matches_every_step(tmp_path):
    pair = Pair()
    path = tmp_path / "plan.json"
    pair.plan.save(path)
    import json

    data = json.loads(path.read_text())
    del data["input_signature"]  # a plan file written before signatures were recorded
    path.write_text(json.dumps(data))
    old = libra.Plan.load(path)
    assert old.input_signature == []
    with libra.apply(pair.ours, old):
        pair.step("planned")
        pair.step("shorter")  # the regions' own shape guard runs them plainly
    assert "_libra_variants" not in old.__dict__ or not old.__dict__["_libra_variants"].plans


def test_new_inputs_raise_before_they_allocate_anything():
    """The default: a step whose inputs no plan was made for would run over the budget while it is profiled, so it
    raises from the root's forward pre-hook instead (NOTE [Plans per input signature])."""
    pair = Pair()
    idx, _ = pair.batches["shorter"]
    with libra.apply(pair.ours, pair.plan):
        pair.step("planned")
        with AllocatorMeter(extra=list(pair.ours.parameters())) as meter:
            with pytest.raises(libra.UnplannedInputsError, match=r"fake=True.*on_over_budget=\"warn\"") as info:
                pair.ours(idx)
        pair.step("planned")  # the block goes on
    assert info.value.signature == [f"0:torch.int64[{am.TOK_BATCH}, {am.SEQ - 8}]"]
    assert meter.peak_bytes - meter.start_bytes <= 4096, "the step allocated before it was refused"
    assert _nothing_installed(pair.ours)


def test_plans_made_ahead_from_fake_profiles_run_each_shape_under_its_budget():
    pair = Pair()
    shapes = ["shorter", "half"]
    plans = [pair.plan]
    for name in shapes:
        fake = libra.profile(pair.ours, lambda name=name: lm_step(pair.ours, pair.batches[name]), fake=True)
        plans.append(libra.plan(fake, max(pair.plan.budget_bytes, libra.planner.Planning(fake).min_budget_bytes())))
    assert all(p.grad is None for p in pair.ours.parameters()), "a fake profile trains nothing"
    by_name = dict(zip(["planned", *shapes], plans))
    with libra.apply(pair.ours, plans):
        for name in ["planned", "shorter", "half", "shorter", "planned", "half"]:
            meter = pair.step(name)  # bit-equal to eager (asserted inside)
            assert meter.peak_bytes <= by_name[name].budget_bytes, (name, meter.peak_bytes, by_name[name].budget_bytes)
    assert "_libra_variants" not in pair.plan.__dict__ or not pair.plan.__dict__["_libra_variants"].plans


def test_apply_refuses_two_plans_for_one_signature():
    pair = Pair()
    with pytest.raises(libra.LibraError, match="different input signatures"):
        with libra.apply(pair.ours, [pair.plan, copy.deepcopy(pair.plan)]):
            pass
    with pytest.raises(libra.LibraError, match="on_over_budget"):
        with libra.apply(pair.ours, pair.plan, on_over_budget="ignore"):
            pass
    assert _nothing_installed(pair.ours)
