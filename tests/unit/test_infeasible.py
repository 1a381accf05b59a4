"""What BudgetInfeasibleError tells a user whose peak Libra cannot lower (issue 14: a vit_b_16 at 64x64, whose peak
is parameter gradients, got five unnamed "static" lines and "lower the batch size")."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import libra
from libra.units import parse_bytes


class _Wide(nn.Module):
    """Big weights, a tiny batch: the step's peak is the weights and their gradients at the end of backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


def _sizes(lines: list[str]) -> list[int]:
    return [parse_bytes(line.split("  ")[0].strip().replace(" ", "")) for line in lines]


def test_a_gradient_made_peak_is_named_and_split():
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(2, 512)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    assert {name for _, name in prof.static_names} >= {"blocks.0.0.weight", "head.bias"}
    with pytest.raises(libra.BudgetInfeasibleError) as info:
        libra.plan(prof, prof.static_bytes + 1)
    text = str(info.value)
    split = dict(re.findall(r"(parameters|gradients|activations|kernel temporaries) ([\d.]+ [KMG]?i?B)", text))
    assert "parameters" in split and "gradients" in split, text
    assert parse_bytes(split["gradients"].replace(" ", "")) > 3 * 2**20  # four 1 MiB weight gradients, and more
    assert "Libra cannot lower this step's peak" in text or "most of that peak is parameters, gradients" in text
    assert "lower the batch size" not in text
    listed = [line.strip() for line in text.split("live then:\n")[1].split("\nFix:")[0].splitlines()]
    # the top lines are 1 MiB each (weights, their gradients, and whatever else a test run left alive): named
    assert any(re.search(r"blocks\.\d\.0\.weight|gradient", line) for line in listed), listed
    assert all("static (parameters" not in line for line in listed)
    sizes = _sizes([line for line in listed if line and line[0].isdigit()])
    assert sizes == sorted(sizes, reverse=True), listed
