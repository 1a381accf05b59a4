"""Helpers for testing code that uses Libra: gradient comparison against eager and meters that read nothing from the plan."""

from __future__ import annotations

import torch

from libra.testing.meter import AllocatorMeter, LiveBytesMeter, MemoryCap

__all__ = ["AllocatorMeter", "LiveBytesMeter", "MemoryCap", "assert_grads_equal", "bit_equal", "fixed_times"]

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits: same dtype, shape and bit pattern of every element.

    Stricter than ``torch.equal`` where floats compare equal without being the same (``-0.0 == 0.0``) and where
    they are the same without comparing equal (a NaN is not equal to itself, so a step whose values overflow to
    NaN would differ from itself by ``torch.equal``).
    """
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        as_int = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def assert_grads_equal(expected: torch.nn.Module, actual: torch.nn.Module) -> None:
    """Asserts every ``.grad``, parameter and buffer of two models are bit-identical (:func:`bit_equal`).

    Raises:
        AssertionError: naming the first tensor that differs and by how much.
    """
    pairs = []
    for (name, p), (_, q) in zip(expected.named_parameters(), actual.named_parameters()):
        pairs.append((f"{name}", p, q))
        pairs.append((f"{name}.grad", p.grad, q.grad))
    for (name, b), (_, c) in zip(expected.named_buffers(), actual.named_buffers()):
        pairs.append((f"buffer {name}", b, c))
    for name, a, b in pairs:
        if a is None or b is None:
            if a is not b:
                raise AssertionError(f"{name}: one model has it and the other does not")
            continue
        if not bit_equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape differs"
            raise AssertionError(f"{name} differs from eager (max abs difference {diff})")


def fixed_times(profile, seconds: float = 1e-5):
    """The profile with every op taking ``seconds`` (and the dispatch overhead too), in place; returns it. The
    region executor's and the clone's measured costs are cleared, so the planner's fixed fallbacks are used.

    The greedy ranks moves by bytes per second, so measured times make the plan, and with it a test's outcome, differ
    from run to run on a shared machine; with fixed times the plan depends only on what the step allocated and saved.
    """
    for op in profile.ops:
        op.seconds = seconds
    profile.dispatch_overhead_seconds = seconds
    profile.region_costs = []
    profile.copy_seconds_per_byte = 0.0
    profile.eager_step_seconds = seconds * len(profile.ops)
    return profile
