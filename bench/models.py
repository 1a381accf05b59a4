"""The benchmark's workloads: four models built from code (no downloads), each with inputs, targets, a loss and the
list of blocks that the checkpoint peers wrap.

GPT-2-like and ResNet-like come from :mod:`libra.testing.models`; the U-Net-like model (long skip connections) and the
MLP-Mixer-like model are defined here from plain ``torch.nn``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from libra.testing import models as libra_models

__all__ = ["UNet", "Mixer", "Workload", "WORKLOADS", "build"]


# ---- U-Net ----------------------------------------------------------------------------------------------------------
class DoubleConv(nn.Module):
    """(3x3 conv, BatchNorm, ReLU) twice, optionally with channel dropout at the end."""

    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout2d(dropout) if dropout else nn.Identity()

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return self.drop(F.relu(self.bn2(self.conv2(x))))


class Down(nn.Module):
    def __init__(self, cin: int, cout: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = DoubleConv(cin, cout, dropout)

    def forward(self, x):
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin // 2 + cout, cout)

    def forward(self, x, skip):
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    """U-Net-like segmentation model: an encoder whose every stage's output is carried by a long skip connection to
    the decoder stage of the same resolution, BatchNorm (train mode) and channel dropout at the bottleneck."""

    def __init__(self, widths=(16, 32, 64, 128), classes: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.inc = DoubleConv(3, widths[0])
        self.downs = nn.ModuleList(
            Down(widths[i], widths[i + 1], dropout if i == len(widths) - 2 else 0.0) for i in range(len(widths) - 1)
        )
        self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(len(widths) - 1)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        x = self.inc(x)
        skips = [x]
        for down in self.downs:
            x = down(x)
            skips.append(x)
        skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.head(x)


# ---- MLP-Mixer ------------------------------------------------------------------------------------------------------
class MixerMLP(nn.Module):
    def __init__(self, d: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, d: int, token_hidden: int, channel_hidden: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.token_mlp = MixerMLP(tokens, token_hidden, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.channel_mlp = MixerMLP(d, channel_hidden, dropout)

    def forward(self, x):
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class Mixer(nn.Module):
    """MLP-Mixer-like image classifier: patch embedding, blocks of token-mixing and channel-mixing MLPs with
    LayerNorm and dropout, mean pooling, linear head."""

    def __init__(self, image: int = 64, patch: int = 8, d: int = 256, depth: int = 8, token_hidden: int = 128,
                 channel_hidden: int = 1024, classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, d, patch, stride=patch)
        self.blocks = nn.ModuleList(MixerBlock(tokens, d, token_hidden, channel_hidden, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


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
    torch.manual_seed(seed)
    model = UNet(**kw)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, model.head.out_channels, (batch, size, size))
    return Workload("unet", model, x, y, F.cross_entropy, [model.inc, *model.downs, *model.ups])


def _mixer(cfg: dict, seed: int) -> Workload:
    kw = dict(cfg)
    batch = kw.pop("batch")
    torch.manual_seed(seed)
    model = Mixer(**kw)
    x = torch.randn(batch, 3, kw.get("image", 64), kw.get("image", 64))
    y = torch.randint(0, model.head.out_features, (batch,))
    return Workload("mixer", model, x, y, F.cross_entropy, list(model.blocks))


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
