"""Small DAG models built from a plain spec (node kinds and input indices), for the random-DAG property test.

A spec is a tuple of :class:`Node`. Node ``i`` of a spec reads the values at its ``inputs``, where value 0 is the
DAG's input and value ``j > 0`` is node ``j - 1``'s output. Every node is a submodule (``nodes.3``); a ``"sub"`` node
is itself a DAG over its own children (``nodes.3.nodes.0``), so the module tree is nested. A DAG returns the sum of
its sinks, the values no node reads. Activations are ``(BATCH, C, L)``; every node keeps that shape.

No code is generated: the spec picks module classes from :data:`KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# a batch at which activations, not parameter gradients, make the peak (DESIGN.md pitfall 16)
BATCH, C, L = 32, 8, 32


@dataclass(frozen=True)
class Node:
    kind: str
    inputs: tuple[int, ...]
    children: tuple["Node", ...] = ()  # a "sub" node's own spec

    def __repr__(self) -> str:  # short, so that hypothesis' falsifying examples can be pasted back as code
        extra = f", {self.children!r}" if self.children else ""
        return f"Node({self.kind!r}, {self.inputs!r}{extra})"


# ---- one module per kind ------------------------------------------------------------------------------------------
class Linear(nn.Module):
    """Over the last (length) dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(L, L)

    def forward(self, x):
        return self.fc(x)


class ChannelLinear(nn.Module):
    """Over channels, through transposed views: its output is a non-contiguous view of the linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return self.fc(x.transpose(1, 2)).transpose(1, 2)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(C, C, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class Act(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class LinearInplaceReLU(nn.Module):
    """An in-place ReLU on a tensor made inside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(L, L)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.fc(x))


class LinearInplaceDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(L, L)
        self.drop = nn.Dropout(0.25, inplace=True)

    def forward(self, x):
        return self.drop(self.fc(x))


class Add(nn.Module):
    def forward(self, a, b):
        return a + b


class AddInto(nn.Module):
    """``h += b`` on a tensor made inside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(C, C, 1)

    def forward(self, a, b):
        h = self.conv(a)
        h += b
        return h


class AddToInput(nn.Module):
    """``a += b``: changes its own input in place (the input's producer and other readers see it)."""

    def forward(self, a, b):
        a += b
        return a


class MulInto(nn.Module):
    """``h.mul_(sigmoid(b))`` on a tensor made inside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(L, L)

    def forward(self, a, b):
        h = self.fc(a)
        h.mul_(torch.sigmoid(b))
        return h


class ScaleInput(nn.Module):
    """``x.mul_(0.5)``: changes its own input in place."""

    def forward(self, x):
        return x.mul_(0.5)


class Cat(nn.Module):
    """Concatenates two branches over channels, then a 1x1 convolution back to ``C`` channels."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv1d(2 * C, C, 1)

    def forward(self, a, b):
        return self.proj(torch.cat([a, b], dim=1))


KINDS = {
    "linear": (1, Linear),
    "chan_linear": (1, ChannelLinear),
    "conv": (1, Conv),
    "layernorm": (1, lambda: nn.LayerNorm(L)),
    "batchnorm": (1, lambda: nn.BatchNorm1d(C)),
    "groupnorm": (1, lambda: nn.GroupNorm(2, C)),
    "gelu": (1, nn.GELU),
    "tanh": (1, nn.Tanh),
    "sigmoid": (1, lambda: Act(torch.sigmoid)),
    "relu_": (1, lambda: nn.ReLU(inplace=True)),  # in place on its input
    "scale_": (1, ScaleInput),  # in place on its input
    "linear_relu_": (1, LinearInplaceReLU),
    "dropout": (1, lambda: nn.Dropout(0.25)),
    "linear_dropout_": (1, LinearInplaceDropout),
    "add": (2, Add),
    "add_into": (2, AddInto),
    "add_to_input": (2, AddToInput),  # in place on its first input
    "mul_into": (2, MulInto),
    "cat": (2, Cat),
    "sub": (1, None),  # a nested DAG
}
MUTATES_INPUT = {"relu_", "scale_", "add_to_input"}


def arity(kind: str) -> int:
    return KINDS[kind][0]


def sinks(spec) -> list[int]:
    """Values (1-based node outputs) that no node reads, in order; the last node's output is always one."""
    read = {i for node in spec for i in node.inputs}
    return [j for j in range(1, len(spec) + 1) if j not in read]


class Dag(nn.Module):
    def __init__(self, spec) -> None:
        super().__init__()
        self.spec = tuple(spec)
        self.nodes = nn.ModuleList(Dag(n.children) if n.kind == "sub" else KINDS[n.kind][1]() for n in self.spec)
        self.outputs = sinks(self.spec)

    def forward(self, x):
        values = [x]
        for node, module in zip(self.spec, self.nodes):
            values.append(module(*(values[i] for i in node.inputs)))
        out = values[self.outputs[0]]
        for j in self.outputs[1:]:
            out = out + values[j]
        return out


class Model(nn.Module):
    """A stem (so no node changes the step's input in place), a stack of DAG blocks, and a head to a scalar loss.

    Blocks are what the planner checkpoints (NOTE [Region granularity]): a single DAG of one-op nodes is one region
    whose replay brings back everything at once, so only a stack of them gives a plan room to save memory.
    """

    def __init__(self, blocks) -> None:
        super().__init__()
        self.stem = nn.Conv1d(C, C, 3, padding=1)
        self.blocks = nn.ModuleList(Dag(spec) for spec in blocks)
        self.head = nn.Linear(L, 1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, C, L, generator=g), torch.randn(BATCH, C, 1, generator=g)


def step(model, data):
    x, target = data
    loss = F.mse_loss(model(x), target)
    loss.backward()
    return loss.detach()
