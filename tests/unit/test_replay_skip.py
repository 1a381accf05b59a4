"""Dead ops in a replay (NOTE [Dead ops in a replay]): the planner lists the ops backward does not need from a
replay, the runtime does not run them, and gradients stay bit-identical."""

import copy
import logging

import torch
from torch.utils.flop_counter import FlopCounterMode

import libra
from libra.planner import Planning
from libra.planner.replay import needed_ops
from libra.testing import assert_grads_equal, fixed_times, models


def _gpt():
    model, x, y, loss_fn = models.make_gpt(batch=2, layers=4, d=64, seq=32, dropout=0.1)
    prof = fixed_times(libra.profile(model, lambda: loss_fn(model(x), y).backward()))
    # matmuls dear, the rest cheap (as on a GPU): plans keep matmul outputs and recompute around them, so replays
    # have matmuls to leave out, on every machine (measured times would make the plan vary from run to run)
    for op in prof.ops:
        op.seconds = 1e-3 if "mm" in op.name else 1e-5
    prof.eager_step_seconds = sum(op.seconds for op in prof.ops)
    model.zero_grad(set_to_none=True)
    return model, x, y, loss_fn, prof


def test_needed_ops_follow_storages_back_from_what_backward_saves():
    *_, prof = _gpt()
    planning = Planning(prof)
    unit = next(u for u in planning.units if u.module == "blocks.1")
    inst = unit.instances[0]
    # nothing kept: everything up to the last saved tensor is needed
    everything = needed_ops(prof, inst, set(unit.forced_save))
    assert len(everything) >= len(unit.candidates)
    # all candidates kept: no saved tensor is left to recompute, so no op that allocates is needed
    kept_all = set(unit.forced_save) | set(unit.candidates)
    for j in needed_ops(prof, inst, kept_all):
        op = prof.ops[inst.start + j]
        assert not op.outputs or op.python_value, (j, op.name)


def test_skipped_ops_do_not_run_and_gradients_are_exact(monkeypatch, caplog):
    model, x, y, loss_fn, prof = _gpt()
    planning = Planning(prof)
    def skips_a_matmul(plan) -> bool:  # what the flop counter below sees
        return any("mm" in r.ops[j] for r in plan.regions for j in r.skip)

    for share in (0.6, 0.7, 0.8, 0.5):  # a budget where the plan keeps some of a region's outputs
        plan = libra.plan(planning, max(prof.budget_for_share(share), planning.min_budget_bytes()))
        if skips_a_matmul(plan):
            break
    assert skips_a_matmul(plan), "a partial plan should leave some replayed matmuls out"
    eager, ours, plain = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    no_skip = copy.deepcopy(plan)
    for r in no_skip.regions:
        r.skip = []
    torch.manual_seed(7)
    loss_fn(eager(x), y).backward()
    flops = {}
    for name, m, p in (("skip", ours, plan), ("no skip", plain, no_skip)):
        torch.manual_seed(7)
        with libra.apply(m, p), FlopCounterMode(display=False) as counter:
            loss_fn(m(x), y).backward()
        flops[name] = counter.get_total_flops()
        assert_grads_equal(eager, m)
    assert flops["skip"] < flops["no skip"], flops  # the skipped matmuls really did not run

    monkeypatch.setenv("LIBRA_DEBUG", "1")
    again = copy.deepcopy(model)
    with caplog.at_level(logging.DEBUG, logger="libra"), libra.apply(again, plan):
        loss_fn(again(x), y).backward()
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().endswith(": skipped")]
    assert skipped, "LIBRA_DEBUG=1 logs every op a replay leaves out"
    assert len(skipped) == sum(len(r.skip) for r in plan.regions if r.skip), (len(skipped), skipped[:3])
    for h in list(logging.getLogger("libra").handlers):
        logging.getLogger("libra").removeHandler(h)
    logging.getLogger("libra").setLevel(logging.NOTSET)
