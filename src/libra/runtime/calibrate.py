"""What the region executor itself costs per op on this machine, measured once per process and device.

NOTE [Region overhead]: every op of a checkpointed call goes through Libra's forward mode, and again through its
replay mode when backward recomputes the call; checkpoint's saved-tensor hooks run in Python for each saved tensor
of both passes. That costs several times a do-nothing dispatch mode on a tiny ``add`` (the profile's
``dispatch_overhead_seconds``): a planner that costs regions by the latter checkpoints blocks that save little and
predicts far less than is measured. So the profiler measures it on a block of layers run forward and backward
eagerly and under a region that recomputes nothing (``calibration_plan``: it keeps the outputs autograd saves and
skips the other ops in its replay, so what remains is the executor's own cost; a region that kept every output
would hold what eager frees, which on a CPU costs fresh pages per op), at depths 1 and 4 so that the per-op cost
and checkpoint's fixed cost per call separate. Rules, and why:
- The block has the step's kind of ops. What an op costs through a dispatch mode grows with its argument list: a
  convolution or a batch norm (which also dispatches an ``empty``) costs about twice a layer norm or a GELU. So
  there are two families of layers, ``dense`` (layer norm, linear, GELU, scaling, residual add) and ``conv`` (3x3
  convolution, batch norm, ReLU, residual add), and a step gets their figures mixed by its forward's share of
  convolutions and batch norms against the conv block's (``conv_weight``). Costed by the dense block alone, CNNs'
  plans predicted their step time low.
- No in-place ops in either block: a region that keeps their input copies it first, which is the copy cost's
  (NOTE [Copy cost] in planner/simulate.py), not the modes'.
- The block is sized like the profiled step: its activations have the median size of the step's forward outputs,
  rounded to a power of two, since on a CPU the cost depends on it (the allocator's page faults).
- Timing on a CPU is noisy: all twelve variants (three ways, two depths, forward alone and the step) run
  interleaved, each the fastest of a few runs, the figures fitted per round and their median over the rounds kept.
Measured once per process, device, thread count, size and family; the planner reads the figures from the profile
(``Profile.region_costs``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

from libra._ops import op_info, storage_key
from libra.errors import LibraError
from libra.planner.types import RegionPlan
from libra.runtime.region import RegionRun, _leaves

__all__ = ["RegionCosts", "region_costs", "cached_region_costs", "copy_seconds_per_byte", "step_calibrations"]

log = logging.getLogger("libra")

_REPEATS = 3
_ROUNDS = 5
_DEPTHS = (1, 4)
_WIDTH = 256
_CHANNELS = 16  # the conv family's channels: its activations are (n, 16, h, w) of the dense family's bytes
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


class _ConvLayer(nn.Module):
    """A convolutional network's layer: 3x3 convolution, batch norm, ReLU, residual add (NOTE [Region overhead]; not
    in place, which a region that keeps its input would copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(_CHANNELS, _CHANNELS, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(_CHANNELS)

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(x)))


FAMILIES = ("dense", "conv")


class _Block(nn.Module):
    def __init__(self, depth: int, family: str = "dense") -> None:
        super().__init__()
        layer = _ConvLayer if family == "conv" else _Layer
        self.layers = nn.Sequential(*[layer() for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)


def _quiet(*_args) -> None:
    pass


def _op_names(block: nn.Module, x: torch.Tensor) -> list[str]:
    """The ops ``block`` dispatches under a region, recorded by a region that planned none (and so keeps all)."""
    run = RegionRun(RegionPlan("calibration", 0, [], save=[]), block, note=_quiet)
    torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)
    return [op_info(f).name for f in run.funcs]


def _never(_packed):
    raise AssertionError("calibration_plan's forward is never differentiated")


def calibration_plan(block: nn.Module, x: torch.Tensor) -> RegionPlan:
    """The region the costs are measured on: it keeps the outputs autograd saves and skips every other op in its
    replay, as a plan that recomputes nothing of a call does (NOTE [Region overhead])."""
    names = _op_names(block, x)
    run = RegionRun(RegionPlan("calibration", 0, names, save=list(range(len(names)))), block, note=_quiet)
    saved = set()

    def pack(t):
        saved.add(storage_key(t))
        # nothing held: a saved output held by its own grad_fn's saved variable is a cycle through C++ that gc
        # cannot break (a ReLU's or a batch norm's), and the block's tensors would outlive the calibration
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, _never), run.contexts()[0]:
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


def _input(family: str, rows: int, device: torch.device) -> torch.Tensor:
    """The block's input: ``rows`` x 256 floats, for the conv family as 16-channel images of as many floats (32 x 32
    from 64 rows on, else one image as square as a power of two allows)."""
    if family == "dense":
        return torch.randn(rows, _WIDTH, device=device, requires_grad=True)
    pixels = rows * _WIDTH // _CHANNELS
    n = max(pixels // 1024, 1)
    h = 1 << ((pixels // n).bit_length() // 2)
    return torch.randn(n, _CHANNELS, h, pixels // n // h, device=device, requires_grad=True)


def _bench(depth: int, rows: int, device: torch.device, family: str) -> tuple[int, dict]:
    """(ops, functions) for one depth: the block's forward and step eagerly, under a region of Libra's modes that
    recomputes nothing (``calibration_plan``) and under plain checkpoint, each run once (first calls pay one-time
    costs)."""
    torch.manual_seed(0)
    block = _Block(depth, family).to(device)
    x = _input(family, rows, device)
    plan = calibration_plan(block, x)

    def region():
        run = RegionRun(plan, block, note=_quiet)
        return torch_checkpoint.checkpoint(run.run, x, use_reentrant=False, context_fn=run.contexts)

    fns = {
        "eager_fwd": lambda: block(x),
        "region_fwd": region,
        "plain_fwd": lambda: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
        "eager_step": lambda: block(x).sum().backward(),
        "region_step": lambda: region().sum().backward(),
        "plain_step": lambda: torch_checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward(),
    }
    for f in fns.values():
        f()
    return len(plan.ops), fns


def _added(t: dict) -> tuple[float, float, float, float]:
    """(forward, forward + backward) seconds added by Libra's modes, then by plain checkpoint less the replay's
    own ops (one forward), from one round's times."""
    return (t["region_fwd"] - t["eager_fwd"], t["region_step"] - t["eager_step"],
            t["plain_fwd"] - t["eager_fwd"], t["plain_step"] - t["eager_step"] - t["eager_fwd"])


def _fit(n1: int, a1: tuple, n4: int, a4: tuple) -> RegionCosts:
    """Per forward op, per replayed op and per call, for Libra's modes and for plain checkpoint, from the added
    seconds at the two depths (``_added``; ``n1`` and ``n4`` ops); noise can make a difference negative: clamped
    at zero."""
    out: list[float] = []
    for f1, t1, f4, t4 in ((a1[0], a1[1], a4[0], a4[1]), (a1[2], a1[3], a4[2], a4[3])):
        forward_op = max((f4 - f1) / (n4 - n1), 0.0)
        replay_op = max(((t4 - f4) - (t1 - f1)) / (n4 - n1), 0.0)
        out += [forward_op, replay_op, max(t1 - (forward_op + replay_op) * n1, 0.0)]
    return tuple(out)


_CACHE: dict[tuple[str, int, int, str], RegionCosts] = {}


def _rows(nbytes: int) -> int:
    """Rows of float32 activations of width 256 nearest ``nbytes``, a power of two between 1 and _MAX_ROWS."""
    rows = max(nbytes // (4 * _WIDTH), 1)
    return min(1 << round(math.log2(rows)), _MAX_ROWS)


def cached_region_costs(device: torch.device | str, nbytes: int, family: str = "dense") -> RegionCosts | None:
    """The costs :func:`region_costs` measured in this process for ``device`` and ``family`` at the size nearest
    ``nbytes``, or None (measures nothing)."""
    device, threads, rows = str(torch.device(device)), torch.get_num_threads(), _rows(nbytes)
    sizes = [k[2] for k in _CACHE if (k[0], k[1], k[3]) == (device, threads, family)]
    if not sizes:
        return None
    return _CACHE[(device, threads, min(sizes, key=lambda r: abs(math.log2(r) - math.log2(rows))), family)]


def region_costs(device: torch.device | str, nbytes: int = 512 * 1024, family: str = "dense") -> RegionCosts:
    """Measured added seconds of Libra's region executor on ``device`` for activations of about ``nbytes`` each,
    on a block of the ``family``'s layers (``"dense"``: layer norm, linear, GELU; ``"conv"``: convolution, batch
    norm, ReLU; NOTE [Region overhead]), cached per device, intra-op thread count, size and family. Takes 0.2-2 s
    on a 2-core CPU."""
    if family not in FAMILIES:
        raise LibraError(f"region_costs: expected a block family among {FAMILIES}, got {family!r}. Fix: pass "
                         "'dense' (transformers, MLPs) or 'conv' (convolutional networks).")
    device = torch.device(device)
    rows = _rows(nbytes)
    key = (str(device), torch.get_num_threads(), rows, family)
    if key not in _CACHE:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                (n1, short), (n4, deep) = (_bench(d, rows, device, family) for d in _DEPTHS)
                rounds = []
                for _ in range(_ROUNDS):  # all twelve interleaved, so that a disturbance hits both sides
                    t1 = {name: _best(f, sync) for name, f in short.items()}
                    t4 = {name: _best(f, sync) for name, f in deep.items()}
                    rounds.append(_fit(n1, _added(t1), n4, _added(t4)))
        finally:
            torch.set_grad_enabled(grad)
        # each round's figures, then their median: one disturbed round moves none of them
        _CACHE[key] = tuple(statistics.median(r[i] for r in rounds) for i in range(6))
        log.debug("libra: region executor costs on %s at %d-byte activations, %s block: %.1f us per forward op, "
                  "%.1f us per replayed op, %.0f us per call (plain checkpoint: %.1f, %.1f, %.0f)", device,
                  rows * _WIDTH * 4, family, *(c * 1e6 for c in _CACHE[key]))
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


def _heavy(name: str) -> bool:
    """Convolutions and batch norms: ops whose trip through a dispatch mode costs several times a light op's
    (their long argument lists; batch norm's extra ``empty``), NOTE [Region overhead]."""
    return "convolution" in name or "batch_norm" in name


# The conv block's share of heavy ops: a layer dispatches a convolution, a batch norm (with its ``empty``), the
# batch norm's ``num_batches_tracked += 1``, a ReLU and the residual add (on a CPU; tested against the block's ops)
CONV_BLOCK_HEAVY_SHARE = 2 / 6


def conv_weight(names: list[str]) -> float:
    """How much of the conv family's figures a step whose forward dispatched ``names`` gets: its share of heavy ops
    over the conv block's (NOTE [Region overhead]), at most 1. Pure: it runs nothing (a recording finished inside a
    live step asks it too)."""
    if not names:
        return 0.0
    return min(sum(map(_heavy, names)) / len(names) / CONV_BLOCK_HEAVY_SHARE, 1.0)


def _mixed(dense: RegionCosts | None, conv: RegionCosts | None, weight: float) -> RegionCosts | tuple:
    if dense is None or conv is None:
        return dense or conv or ()
    return tuple((1.0 - weight) * d + weight * c for d, c in zip(dense, conv))


def step_calibrations(ops, storages, device: torch.device, live: bool) -> tuple[tuple, float]:
    """What a recorded step's plans will cost to run on ``device`` (``StepRecording``'s ``calibrate``): the region
    executor's costs at the step's typical (median) forward activation size, on blocks of the step's mix of light
    and heavy ops (NOTE [Region overhead]), and the seconds per byte of a clone at the size of the largest
    activation the forward writes in place (what a region's copy-on-write clones; NOTE [Copy cost] in
    planner/simulate.py), else at the typical size. ``live``: a recording finished inside a live step (from a
    backward callback) only reads what was measured before; empty costs and 0.0 (the planner's fallbacks) if nothing
    was."""
    forward = [o for o in ops if not o.backward]
    sizes = sorted(storages[s].nbytes for o in forward for s in o.outputs)
    typical = sizes[len(sizes) // 2] if sizes else 0
    written = [storages[s].nbytes for o in forward for s in o.writes if not storages[s].static]
    copy_size = max(written) if written else typical
    weight = conv_weight([o.name for o in forward])
    # a family that would weigh under 5% is not measured: its share moves the mix less than the noise does
    families = [f for f, w in (("dense", 1.0 - weight), ("conv", weight)) if w >= 0.05]
    costs, copy = ((cached_region_costs, cached_copy_seconds_per_byte) if live
                   else (region_costs, copy_seconds_per_byte))
    got = {f: costs(device, typical, f) for f in families}
    return _mixed(got.get("dense"), got.get("conv"), weight), copy(device, copy_size)
