"""The methods the benchmark compares: eager, PyTorch's own memory savers, and Libra.

Each :class:`Method` is a context manager factory (what is installed on the model for one step) plus the callable the
step runs (the model itself, or a compiled wrapper of it). Every method runs on the same model object, so parameters,
buffers and inputs are the same tensors for all of them and the static bytes are equal.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import libra

__all__ = ["Method", "eager", "checkpoint_blocks", "selective_checkpoint", "save_on_cpu", "libra_method", "SAVE_OPS"]

aten = torch.ops.aten


@dataclass
class Method:
    """One way of running the training step.

    Attributes:
        name: row label, e.g. ``"ckpt_every_block"`` or ``"libra@50%"``.
        family: ``"eager"``, ``"peer"``, ``"libra"`` or ``"compile"``.
        context: returns the context manager that installs the method on the model for one step.
        forward: what the step calls with the inputs (the model, or a compiled wrapper of it).
        info: what the JSON records about the method's setup (budget, plan counts, ...).
    """

    name: str
    family: str
    context: Callable[[], ContextManager]
    forward: Callable
    info: dict = field(default_factory=dict)


def eager(model: nn.Module) -> Method:
    return Method("eager", "eager", contextlib.nullcontext, model)


class _CheckpointedForward:
    """Stands in for one block's ``forward`` (an instance attribute): runs the original under non-reentrant
    ``torch.utils.checkpoint``."""

    def __init__(self, forward, context_fn) -> None:
        self.forward = forward
        self.context_fn = context_fn

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


@contextlib.contextmanager
def _wrapped(blocks: list[nn.Module], every: int, context_fn=None):
    patched = []
    try:
        for i, block in enumerate(blocks):
            if i % every == 0:
                block.forward = _CheckpointedForward(block.forward, context_fn)
                patched.append(block)
        yield
    finally:
        for block in patched:
            del block.__dict__["forward"]


def checkpoint_blocks(model: nn.Module, blocks: list[nn.Module], every: int) -> Method:
    """``torch.utils.checkpoint(use_reentrant=False)`` on every block (``every=1``) or every second one (``every=2``,
    blocks 0, 2, 4, ...)."""
    name = "ckpt_every_block" if every == 1 else f"ckpt_every_{every}nd_block" if every == 2 else f"ckpt_every_{every}"
    return Method(name, "peer", functools.partial(_wrapped, blocks, every), model,
                  {"blocks": len(blocks), "checkpointed": len(range(0, len(blocks), every))})


# The common selective-activation-checkpoint policy: keep what is expensive to recompute, recompute the rest.
SAVE_OPS = frozenset(
    op
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.convolution.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    )
)


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(model: nn.Module, blocks: list[nn.Module]) -> Method:
    """Selective activation checkpoint on every block: save matmuls, convolutions and SDPA, recompute the rest."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy)
    return Method("sac_save_matmuls", "peer", functools.partial(_wrapped, blocks, 1, context_fn), model,
                  {"blocks": len(blocks), "policy": sorted(str(op) for op in SAVE_OPS)})


def save_on_cpu(model: nn.Module) -> Method:
    """``torch.autograd.graph.save_on_cpu`` around the whole step. On a CPU-only machine this copies every saved
    tensor to another CPU tensor: it is recorded for completeness, not as a memory saver here."""
    return Method("save_on_cpu", "peer", functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=False), model,
                  {"pin_memory": False, "note": "on CPU the 'offload' is a CPU-to-CPU copy"})


def libra_method(model: nn.Module, name: str, plan: libra.Plan, info: dict) -> Method:
    return Method(name, "libra", functools.partial(libra.apply, model, plan), model, info)
