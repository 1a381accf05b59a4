"""Steps of a Libra copy next to an eager copy, for the tests that check a plan on the real model."""

from __future__ import annotations

from typing import Callable

import torch

import libra
from libra.testing import AllocatorMeter, assert_grads_equal


def train_pair(eager: torch.nn.Module, ours: torch.nn.Module, plan: libra.Plan,
               step: Callable[[torch.nn.Module], object], steps: int = 2, seed: int = 0) -> list[AllocatorMeter]:
    """``steps`` seeded steps of ``step(model)`` on both copies, ``ours`` under ``plan`` inside an allocator meter;
    asserts bit-equal gradients, parameters and buffers after each and clears both copies' gradients. Returns the
    meters."""
    meters = []
    for i in range(steps):
        torch.manual_seed(seed + i)
        with AllocatorMeter(extra=list(ours.parameters())) as meter:
            with libra.apply(ours, plan):
                step(ours)
        torch.manual_seed(seed + i)
        step(eager)
        assert_grads_equal(eager, ours)
        eager.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        meters.append(meter)
    return meters


def plan_anew(model: torch.nn.Module, plan: libra.Plan, step: Callable[[], object]) -> libra.Plan:
    """Runs ``step`` twice under ``plan`` with ``on_over_budget="warn"``: inputs the plan was not made for are
    profiled in the first and run under a plan of their own in the second. Returns that plan."""
    for _ in range(2):
        with libra.apply(model, plan, on_over_budget="warn"):
            step()
        model.zero_grad(set_to_none=True)
    (other,) = plan.__dict__["_libra_variants"].plans.values()
    return other
