"""What the region executor itself costs per op on this machine, measured once per process and device.

NOTE [Region overhead]: every op of a checkpointed call goes through Libra's forward mode, and again through its
replay mode when backward recomputes the call; checkpoint's saved-tensor hooks run in Python for each saved tensor
of both passes. On a 2-core CPU with torch 2.13 this measured 30-50 us per op in each pass for a GPT block's ops,
several times a do-nothing dispatch mode on a tiny ``add`` (the profile's ``dispatch_overhead_seconds``, ~3 us):
a planner that costs regions by the latter checkpoints blocks that save little and predicts 1.2x where 1.4x is
measured. So the profiler measures it: a small block of the usual ops (layer norm, linear, GELU, scaling, residual
add; no in-place ops, which a region that keeps everything would copy) run forward and backward eagerly and under a region whose every output is kept (nothing recomputed, so what
remains is the executor's own cost), at depths 1 and 3 so that the per-op cost and checkpoint's fixed cost per call
separate. The planner reads the figures from the profile (``Profile.region_forward_op_seconds`` and friends).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from libra._ops import op_info
from libra.planner.types import RegionPlan
from libra.runtime.region import RegionRun

__all__ = ["RegionCosts", "region_costs", "cached_region_costs"]

log = logging.getLogger("libra")

_REPEATS = 4
_WIDTH = 64


class RegionCosts(tuple):
    """``(forward_op, replay_op, call)`` seconds: added per op in the forward, per op in the replay, per call."""

    @property
    def forward_op(self) -> float:
        return self[0]

    @property
    def replay_op(self) -> float:
        return self[1]

    @property
    def call(self) -> float:
        return self[2]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_WIDTH)
        self.fc = nn.Linear(_WIDTH, _WIDTH)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x))) * 0.5


class _Block(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[_Layer() for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)


def _quiet(*_args) -> None:
    pass


def _op_names(block: nn.Module, x: torch.Tensor) -> list[str]:
    """The ops ``block`` dispatches under a region, recorded by a region that planned none (and so keeps all)."""
    run = RegionRun(RegionPlan("calibration", 0, [], save=[]), block, note=_quiet)
    torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)
    return [op_info(f).name for f in run.funcs]


def _best(fn, sync) -> float:
    best = float("inf")
    for _ in range(_REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(depth: int, device: torch.device, sync) -> tuple[int, float, float]:
    """(ops, added forward seconds, added forward + backward seconds) of one region call of a block."""
    torch.manual_seed(0)
    block = _Block(depth).to(device)
    x = torch.randn(4, 16, _WIDTH, device=device, requires_grad=True)
    names = _op_names(block, x)
    keep_all = RegionPlan("calibration", 0, names, save=list(range(len(names))))

    def region():
        run = RegionRun(keep_all, block, note=_quiet)
        return torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)

    def eager_fwd():
        block(x)

    def region_fwd():
        region()

    def eager_step():
        block(x).sum().backward()

    def region_step():
        region().sum().backward()

    eager_step()
    region_step()  # first calls pay one-time costs
    times = {f: float("inf") for f in (eager_fwd, region_fwd, eager_step, region_step)}
    for _ in range(2):  # interleaved, so that a disturbance hits both sides
        for f in times:
            times[f] = min(times[f], _best(f, sync))
    return len(names), times[region_fwd] - times[eager_fwd], times[region_step] - times[eager_step]


_CACHE: dict[tuple[str, int], RegionCosts] = {}


def cached_region_costs(device: torch.device | str) -> RegionCosts | None:
    """The costs :func:`region_costs` measured for ``device`` in this process, or None (measures nothing)."""
    return _CACHE.get((str(torch.device(device)), torch.get_num_threads()))


def region_costs(device: torch.device | str) -> RegionCosts:
    """Measured added seconds of Libra's region executor on ``device`` (NOTE [Region overhead]), cached per device
    and intra-op thread count. Takes about 0.5 s on a 2-core CPU."""
    device = torch.device(device)
    key = (str(device), torch.get_num_threads())
    if key not in _CACHE:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                n1, f1, t1 = _measure(1, device, sync)
                n4, f4, t4 = _measure(3, device, sync)
        finally:
            torch.set_grad_enabled(grad)
        # fit added = call + per_op * ops on the two depths; noise can make a difference negative: clamp at zero
        forward_op = max((f4 - f1) / (n4 - n1), 0.0)
        replay_op = max(((t4 - f4) - (t1 - f1)) / (n4 - n1), 0.0)
        call = max(t1 - (forward_op + replay_op) * n1, 0.0)
        _CACHE[key] = RegionCosts((forward_op, replay_op, call))
        log.debug("libra: region executor costs on %s: %.1f us per forward op, %.1f us per replayed op, %.0f us "
                  "per call", device, forward_op * 1e6, replay_op * 1e6, call * 1e6)
    return _CACHE[key]
