"""What the region executor itself costs per op on this machine, measured once per process and device.

NOTE [Region overhead]: every op of a checkpointed call goes through Libra's forward mode, and again through its
replay mode when backward recomputes the call; checkpoint's saved-tensor hooks run in Python for each saved tensor
of both passes. That costs several times a do-nothing dispatch mode on a tiny ``add`` (the profile's
``dispatch_overhead_seconds``): a planner that costs regions by the latter checkpoints blocks that save little and
predicts far less than is measured. So the profiler measures it: a small block of the usual ops (layer norm,
linear, GELU, scaling, residual add; no in-place ops, which a region that keeps their inputs would copy) run
forward and backward eagerly and under a region that recomputes nothing (``calibration_plan``: it keeps the
outputs autograd saves and skips the other ops in its replay, so what remains is the executor's own cost), at
depths 1 and 3 so that the per-op cost and checkpoint's fixed cost per call separate. A region that kept every
output instead (as this calibration did before) holds what eager frees, which on a CPU costs fresh pages per op:
it charged 1.2-2x the forward cost of a realistic region at 512 KiB-2 MiB activations
(``bench/executor_cost.py``). The cost still depends on the tensors' size on a CPU (the allocator's page faults),
so the block is sized like the profiled step: its activations have the median size of the step's forward
outputs, rounded to a power of two (each size measured once per process). The planner reads the figures from the
profile (``Profile.region_costs``).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from libra._ops import op_info, storage_key
from libra.planner.types import RegionPlan
from libra.runtime.region import RegionRun, _leaves

__all__ = ["RegionCosts", "region_costs", "cached_region_costs", "copy_seconds_per_byte", "step_calibrations"]

log = logging.getLogger("libra")

_REPEATS = 4
_WIDTH = 256
_MAX_ROWS = 2048  # 2 MiB activations at most: larger ones cost the calibration more than they tell


# A measurement: ``(forward_op, replay_op, call, plain_forward_op, plain_replay_op, plain_call)`` seconds added per
# op in the forward, per op in the replay and per call, by Libra's region modes and by plain checkpoint (NOTE [Plain
# regions]); a replay's recomputed ops' own time is not included. The order of ``Profile.region_costs``.
RegionCosts = tuple[float, float, float, float, float, float]


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


def _same(t):
    return t


def calibration_plan(block: nn.Module, x: torch.Tensor) -> RegionPlan:
    """The region the costs are measured on: it keeps the outputs autograd saves and skips every other op in its
    replay, as a plan that recomputes nothing of a call does (NOTE [Region overhead])."""
    names = _op_names(block, x)
    run = RegionRun(RegionPlan("calibration", 0, names, save=list(range(len(names)))), block, note=_quiet)
    saved = set()

    def pack(t):
        saved.add(storage_key(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _same), run.contexts()[0]:
        run.run(x)  # every output held by the cache while saved storages are noted: keys stay unique
    kept = [i for i, out in sorted(run.cache.items()) if any(storage_key(t) in saved for t in _leaves(out))]
    return RegionPlan("calibration", 0, names, save=kept, skip=[i for i in range(len(names)) if i not in kept])


def _best(fn, sync) -> float:
    best = float("inf")
    for _ in range(_REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(depth: int, rows: int, device: torch.device, sync) -> tuple[int, float, float, float, float]:
    """(ops, added forward seconds, added forward + backward seconds) of one region call of a block under Libra's
    modes recomputing nothing (``calibration_plan``), then the same two for plain checkpoint, less the replay's own
    ops (one forward)."""
    torch.manual_seed(0)
    block = _Block(depth).to(device)
    x = torch.randn(rows, _WIDTH, device=device, requires_grad=True)
    plan = calibration_plan(block, x)
    names = plan.ops

    def region():
        run = RegionRun(plan, block, note=_quiet)
        return torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)

    def eager_fwd():
        block(x)

    def region_fwd():
        region()

    def eager_step():
        block(x).sum().backward()

    def region_step():
        region().sum().backward()

    def plain_fwd():
        torch_checkpoint.checkpoint(block, x, use_reentrant=False)

    def plain_step():
        torch_checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()

    eager_step()
    region_step()  # first calls pay one-time costs
    plain_step()
    times = {f: float("inf") for f in (eager_fwd, region_fwd, eager_step, region_step, plain_fwd, plain_step)}
    for _ in range(2):  # interleaved, so that a disturbance hits both sides
        for f in times:
            times[f] = min(times[f], _best(f, sync))
    eager = times[eager_step]
    return (len(names), times[region_fwd] - times[eager_fwd], times[region_step] - eager,
            times[plain_fwd] - times[eager_fwd], times[plain_step] - eager - times[eager_fwd])


_CACHE: dict[tuple[str, int, int], RegionCosts] = {}


def _rows(nbytes: int) -> int:
    """Rows of float32 activations of width 256 nearest ``nbytes``, a power of two between 1 and _MAX_ROWS."""
    rows = max(nbytes // (4 * _WIDTH), 1)
    return min(1 << round(math.log2(rows)), _MAX_ROWS)


def cached_region_costs(device: torch.device | str, nbytes: int) -> RegionCosts | None:
    """The costs :func:`region_costs` measured in this process for ``device`` at the size nearest ``nbytes``, or None
    (measures nothing)."""
    device, threads, rows = str(torch.device(device)), torch.get_num_threads(), _rows(nbytes)
    sizes = [k[2] for k in _CACHE if k[:2] == (device, threads)]
    if not sizes:
        return None
    return _CACHE[(device, threads, min(sizes, key=lambda r: abs(math.log2(r) - math.log2(rows))))]


def region_costs(device: torch.device | str, nbytes: int = 512 * 1024) -> RegionCosts:
    """Measured added seconds of Libra's region executor on ``device`` for activations of about ``nbytes`` each
    (NOTE [Region overhead]), cached per device, intra-op thread count and size. Takes 0.2-0.6 s on a 2-core CPU."""
    device = torch.device(device)
    rows = _rows(nbytes)
    key = (str(device), torch.get_num_threads(), rows)
    if key not in _CACHE:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                n1, f1, t1, pf1, pt1 = _measure(1, rows, device, sync)
                n3, f3, t3, pf3, pt3 = _measure(3, rows, device, sync)
        finally:
            torch.set_grad_enabled(grad)

        def fit(f1, t1, f3, t3):
            # added = call + per_op * ops on the two depths; noise can make a difference negative: clamp at zero
            forward_op = max((f3 - f1) / (n3 - n1), 0.0)
            replay_op = max(((t3 - f3) - (t1 - f1)) / (n3 - n1), 0.0)
            return forward_op, replay_op, max(t1 - (forward_op + replay_op) * n1, 0.0)

        _CACHE[key] = fit(f1, t1, f3, t3) + fit(pf1, pt1, pf3, pt3)
        log.debug("libra: region executor costs on %s at %d-byte activations: %.1f us per forward op, %.1f us per "
                  "replayed op, %.0f us per call (plain checkpoint: %.1f, %.1f, %.0f)", device, rows * _WIDTH * 4,
                  *(c * 1e6 for c in _CACHE[key]))
    return _CACHE[key]


_COPY_CACHE: dict[tuple[str, int, int], float] = {}
_COPY_MIN_BYTES = 1 << 20
_COPY_MAX_BYTES = 64 << 20
_COPY_REPEATS = 5


def _copy_size(nbytes: int) -> int:
    """``nbytes`` rounded to a power of two between 1 MiB and 64 MiB."""
    size = 1 << round(math.log2(max(nbytes, 1)))
    return min(max(size, _COPY_MIN_BYTES), _COPY_MAX_BYTES)


def cached_copy_seconds_per_byte(device: torch.device | str, nbytes: int) -> float:
    """What :func:`copy_seconds_per_byte` measured in this process for ``device`` at the size nearest ``nbytes``,
    or 0.0 (measures nothing)."""
    device, threads, size = str(torch.device(device)), torch.get_num_threads(), _copy_size(nbytes)
    sizes = [k[2] for k in _COPY_CACHE if k[:2] == (device, threads)]
    if not sizes:
        return 0.0
    return _COPY_CACHE[(device, threads, min(sizes, key=lambda b: abs(math.log2(b) - math.log2(size))))]


def copy_seconds_per_byte(device: torch.device | str, nbytes: int) -> float:
    """Measured seconds per byte of ``clone()`` of a tensor of about ``nbytes`` on ``device`` into a fresh buffer,
    as a region's copy-on-write clones are (NOTE [Copy cost] in planner/simulate.py): the median of a few copies,
    each into a buffer allocated for it, so that what the allocator costs (page faults on a CPU, where a freed large
    buffer goes back to the system) is counted. Cached per device, thread count and size; a few milliseconds."""
    device = torch.device(device)
    size = _copy_size(nbytes)
    key = (str(device), torch.get_num_threads(), size)
    if key not in _COPY_CACHE:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        src = torch.ones(size // 4, device=device)
        times = []
        for _ in range(_COPY_REPEATS + 1):
            sync()
            t0 = time.perf_counter()
            out = src.clone()
            sync()
            times.append(time.perf_counter() - t0)
            del out
        times = sorted(times[1:])  # the first copy pays one-time costs
        _COPY_CACHE[key] = times[len(times) // 2] / size
        log.debug("libra: a clone of %d bytes on %s takes %.2f ms (%.1f GB/s)", size, device,
                  times[len(times) // 2] * 1e3, size / times[len(times) // 2] / 1e9)
    return _COPY_CACHE[key]


def step_calibrations(ops, storages, device: torch.device, live: bool) -> tuple[tuple, float]:
    """What a recorded step's plans will cost to run on ``device`` (``StepRecording``'s ``calibrate``): the region
    executor's costs at the step's typical (median) forward activation size (NOTE [Region overhead]), and the
    seconds per byte of a clone at the size of the largest activation the forward writes in place (what a region's
    copy-on-write clones; NOTE [Copy cost] in planner/simulate.py), else at the typical size. ``live``: a recording
    finished inside a live step (from a backward callback) only reads what was measured before; empty costs and 0.0
    (the planner's fallbacks) if nothing was."""
    sizes = sorted(storages[s].nbytes for o in ops if not o.backward for s in o.outputs)
    typical = sizes[len(sizes) // 2] if sizes else 0
    written = [storages[s].nbytes for o in ops if not o.backward for s in o.writes if not storages[s].static]
    copy_size = max(written) if written else typical
    if live:
        return cached_region_costs(device, typical) or (), cached_copy_seconds_per_byte(device, copy_size)
    return region_costs(device, typical), copy_seconds_per_byte(device, copy_size)
