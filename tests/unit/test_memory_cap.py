"""A device with less memory (``libra.testing.MemoryCap``): the eager step does not fit under the cap, and the plan
made from a fake profile, which needs no eager step, trains under it, bit for bit as eager does without the cap."""

from __future__ import annotations

import pytest
import torch

import libra
from libra.testing import MemoryCap, models


def _gpt():
    return models.make_gpt(batch=8, vocab=256, d=64, layers=4, heads=4, seq=128)


def _train(model, x, y, loss_fn, steps, *, plan=None, cap=None):
    """``steps`` SGD steps (under ``plan`` and ``cap`` when given); returns the last step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        if plan is None:
            loss_fn(model(x), y).backward()
        else:
            with cap, libra.apply(model, plan):
                loss_fn(model(x), y).backward()
        if i < steps - 1:
            opt.step()
    return [p.grad.clone() for p in model.parameters()]


def test_fake_plan_trains_where_eager_does_not_fit():
    reference, x, y, loss_fn = _gpt()
    expected_grads = _train(reference, x, y, loss_fn, 3)
    expected_params = [p.detach().clone() for p in reference.parameters()]
    del reference  # what the test holds aside: the expected values, counted by the cap like anything else
    aside = sum(t.untyped_storage().nbytes() for t in expected_grads + expected_params)

    model, x, y, loss_fn = _gpt()
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward(), fake=True)
    plan = libra.plan(prof, prof.budget_for_share(0.5))
    assert plan.counts[libra.Decision.RECOMPUTE] > 0
    cap_bytes = plan.budget_bytes + aside

    torch.manual_seed(100)
    with pytest.raises(torch.OutOfMemoryError, match="past the cap"):
        with MemoryCap(cap_bytes, extra=model.parameters()):
            loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)  # the failed step's partial gradients

    cap = MemoryCap(cap_bytes, extra=model.parameters())
    grads = _train(model, x, y, loss_fn, 3, plan=plan, cap=cap)
    assert plan.budget_bytes // 2 < cap.peak_bytes - aside <= plan.budget_bytes, (cap.peak_bytes, aside)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)


def test_the_cap_refuses_nonsense():
    with pytest.raises(libra.LibraError, match="positive int of bytes"):
        MemoryCap(0)
    with pytest.raises(libra.LibraError, match="positive int of bytes"):
        MemoryCap("1GiB")
