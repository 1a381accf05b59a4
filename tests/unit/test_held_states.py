"""What a checkpointed call holds besides tensors, and until when (NOTE [RNG state] in planner/simulate.py, NOTE
[Release after unpack] in planner/regions.py): predicted peaks equal the allocator's to the byte where regions keep
or skip random ops."""

import copy

import pytest
import torch
import torch.nn as nn

import libra
from libra.planner import Planning
from libra.testing import AllocatorMeter, assert_grads_equal, fixed_times

pytestmark = pytest.mark.usefixtures("one_thread")


class _NoisyBlock(nn.Module):
    """A linear, then a mask drawn from ``rand_like``: backward needs the mask (a bool tensor, cheap to keep) and the
    linear's output, not the uniform draws, so a plan that keeps the mask skips ``rand_like`` in the replay and
    keeps the generator state it left instead."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return x + self.out(h * (torch.rand_like(h) > 0.2))


@pytest.fixture(scope="module")
def noisy():
    torch.manual_seed(0)
    model = nn.Sequential(*[_NoisyBlock(64) for _ in range(4)])
    x = torch.randn(256, 64)
    step = lambda m: m(x).square().mean().backward()  # noqa: E731
    step(model)  # a warm-up step, so that the profiled one is like the later ones
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    prof = fixed_times(libra.profile(model, lambda: step(model)))  # fixed op times: the same plans on every run
    model.zero_grad(set_to_none=True)
    return model, step, prof


SHARES = [0.9, 0.75, 0.6, "min"]


def _plan(prof, share) -> libra.Plan:
    return libra.plan(prof, Planning(prof).min_budget_bytes() if share == "min" else prof.budget_for_share(share))


def _draws(prof, plan) -> list:
    """(module, op) of each random op a region of ``plan`` keeps or skips: one generator state each."""
    random = {o.name for o in prof.ops if o.random}
    return [(r.module, i) for r in plan.regions if not r.plain and not r.hooked
            for i in set(r.save) | set(r.skip) if r.ops[i] in random]


def test_the_shares_reach_plans_that_do_not_rerun_a_random_op(noisy):
    prof = noisy[2]
    assert any(_draws(prof, _plan(prof, share)) for share in SHARES)


@pytest.mark.parametrize("share", SHARES)
def test_random_ops_a_region_does_not_rerun_keep_their_generator_state(noisy, share):
    model, step, prof = noisy
    plan = _plan(prof, share)
    ours, eager = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(11)
    with AllocatorMeter(extra=list(ours.parameters())) as meter:
        with libra.apply(ours, plan):
            step(ours)
    torch.manual_seed(11)
    step(eager)
    assert_grads_equal(eager, ours)
    # the eager copy and the profiled model are alive here too: compare what the step added to what it started with
    measured, predicted = meter.peak_bytes - meter.start_bytes, plan.predicted_peak_bytes - prof.static_bytes
    assert measured == predicted, (
        f"measured {measured} B above the step's start vs predicted {predicted} "
        f"({(measured - predicted) / prof.rng_state_bytes:+.2f} RNG states; {len(_draws(prof, plan))} random ops "
        "kept or skipped)")
