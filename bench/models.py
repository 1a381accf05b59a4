"""The benchmark's workloads: four models built from code (no downloads), each with inputs, targets, a loss and the
list of blocks that the checkpoint peers wrap.

All four (GPT-2-like, ResNet-like, U-Net-like with long skip connections, MLP-Mixer-like) come from
:mod:`libra.testing.models`, where the tests use them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from libra.testing import models as libra_models

__all__ = ["Workload", "WORKLOADS", "build"]


# ---- workloads ------------------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """One model with its inputs and targets, and the blocks the checkpoint peers wrap."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable
    blocks: list[nn.Module]
    config: dict = field(default_factory=dict)


def _gpt(cfg: dict, seed: int) -> Workload:
    kw = dict(cfg)
    batch = kw.pop("batch")
    model, x, y, loss_fn = libra_models.make_gpt(batch=batch, seed=seed, **kw)
    return Workload("gpt", model, x, y, loss_fn, list(model.blocks))


def _resnet(cfg: dict, seed: int) -> Workload:
    kw = dict(cfg)
    batch, size = kw.pop("batch"), kw.pop("size")
    model, x, y, loss_fn = libra_models.make_resnet(batch=batch, size=size, seed=seed, **kw)
    blocks = [b for stage in model.layers for b in stage]
    return Workload("resnet", model, x, y, loss_fn, blocks)


def _unet(cfg: dict, seed: int) -> Workload:
    kw = dict(cfg)
    batch, size = kw.pop("batch"), kw.pop("size")
    model, x, y, loss_fn = libra_models.make_unet(batch=batch, size=size, seed=seed, **kw)
    return Workload("unet", model, x, y, loss_fn, [model.inc, *model.downs, *model.ups])


def _mixer(cfg: dict, seed: int) -> Workload:
    kw = dict(cfg)
    batch = kw.pop("batch")
    model, x, y, loss_fn = libra_models.make_mixer(batch=batch, seed=seed, **kw)
    return Workload("mixer", model, x, y, loss_fn, list(model.blocks))


# Sizes: a full-size step takes roughly 0.2-0.5 s forward+backward on 2 idle CPU cores; a quick one a few tens of ms.
WORKLOADS: dict[str, dict] = {
    "gpt": {
        "build": _gpt,
        "full": dict(batch=4, vocab=512, d=256, layers=12, heads=4, seq=128, dropout=0.1),
        "quick": dict(batch=2, vocab=256, d=128, layers=6, heads=4, seq=64, dropout=0.1),
    },
    "resnet": {
        "build": _resnet,
        "full": dict(batch=16, size=64, widths=(16, 32, 64, 128), blocks=(3, 4, 6, 3)),
        "quick": dict(batch=8, size=32, widths=(8, 16, 32), blocks=(2, 2, 2)),
    },
    "unet": {
        "build": _unet,
        "full": dict(batch=8, size=128, widths=(16, 32, 64, 128, 256), classes=4, dropout=0.1),
        "quick": dict(batch=4, size=32, widths=(8, 16, 32), classes=4, dropout=0.1),
    },
    "mixer": {
        "build": _mixer,
        "full": dict(batch=24, image=64, patch=8, d=256, depth=8, token_hidden=128, channel_hidden=1024, dropout=0.1),
        "quick": dict(batch=16, image=32, patch=8, d=128, depth=4, token_hidden=64, channel_hidden=256, dropout=0.1),
    },
}


def build(name: str, quick: bool, seed: int = 0) -> Workload:
    """The workload ``name`` at full or quick size, with weights and data drawn from ``seed``."""
    spec = WORKLOADS[name]
    cfg = spec["quick" if quick else "full"]
    work = spec["build"](cfg, seed)
    work.config = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    return work


def profile_workload(name: str, quick: bool = False, warmup: int = 2):
    """``(workload, profile)``: the workload ``name`` (seed 0) in train mode, profiled after ``warmup`` plain steps,
    with its gradients cleared."""
    import libra

    torch.manual_seed(0)
    work = build(name, quick=quick)
    model = work.model
    model.train()

    def step():
        work.loss_fn(model(work.inputs), work.targets).backward()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    prof = libra.profile(model, step)
    model.zero_grad(set_to_none=True)
    return work, prof
