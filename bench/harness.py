"""Measurement primitives shared by the workers: weight snapshots, the memory-and-gradient check, timed rounds.

NOTE [Fair memory numbers]: the meter counts every live tensor on the CPU, so what is live when a step starts must be
the same for every method: the one model's parameters and buffers, the inputs and targets, no gradients. Weight
snapshots and reference gradients are therefore kept as NumPy arrays, which the meter (and Libra's profiler) do not
see, and no loss or output of an earlier step is kept.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from libra.testing import AllocatorMeter

from bench.methods import Method
from bench.models import Workload

__all__ = ["Snapshot", "CheckResult", "check", "timed_rounds", "summarize_times", "STEP_SEED"]

STEP_SEED = 1234  # torch.manual_seed before every step: dropout draws the same masks for every method


def _arrays(named) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in named if t is not None}


class Snapshot:
    """Parameters and buffers as NumPy copies, written back in place (the tensors keep their storages)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = _arrays(model.named_parameters())
        self.buffers = _arrays(model.named_buffers())

    def restore(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(torch.from_numpy(self.params[name]))
            for name, b in self.model.named_buffers():
                b.copy_(torch.from_numpy(self.buffers[name]))
        self.model.zero_grad(set_to_none=True)


@dataclass
class CheckResult:
    peak_bytes: int
    start_bytes: int
    seconds: float  # the metered step's wall time (meter overhead included; not used as the step time)
    loss: float
    grads: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]

    @property
    def above_start_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes


def run_step(work: Workload, method: Method) -> float:
    """One forward and backward under ``method``; returns the loss as a float and keeps nothing."""
    with method.context():
        loss = work.loss_fn(method.forward(work.inputs), work.targets)
        loss.backward()
    value = loss.item()
    del loss
    return value


def check(work: Workload, snap: Snapshot, method: Method) -> CheckResult:
    """One step from the snapshot's weights with the step seed, under the meter: peak bytes, gradients, buffers."""
    snap.restore()
    gc.collect()
    torch.manual_seed(STEP_SEED)
    # the allocator's count (kernels' temporaries included): what a budget promises. It is no dispatch mode, so
    # compiled code runs compiled under it, and it sees the buffers Inductor allocates outside the dispatcher too.
    with AllocatorMeter(extra=list(work.model.parameters())) as meter:
        t0 = time.perf_counter()
        loss = run_step(work, method)
        seconds = time.perf_counter() - t0
    grads = {name: p.grad.detach().numpy().copy() for name, p in work.model.named_parameters() if p.grad is not None}
    buffers = _arrays(work.model.named_buffers())
    snap.restore()
    return CheckResult(meter.peak_bytes, meter.start_bytes, seconds, loss, grads, buffers)


def compare(reference: CheckResult, result: CheckResult) -> dict:
    """Bit-equality of gradients, buffers and loss against the reference (eager), with the largest difference."""

    def diff(a: dict, b: dict) -> tuple[bool, float, str]:
        if a.keys() != b.keys():
            return False, float("inf"), f"different tensors: {sorted(set(a) ^ set(b))[:3]}"
        worst, where, equal = 0.0, "", True
        for name in a:
            x, y = a[name], b[name]
            if x.shape != y.shape:
                return False, float("inf"), f"{name}: shape {x.shape} vs {y.shape}"
            if not np.array_equal(x, y):
                equal = False
                d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                if d >= worst:
                    worst, where = d, name
        return equal, worst, where

    g_eq, g_diff, g_where = diff(reference.grads, result.grads)
    b_eq, b_diff, b_where = diff(reference.buffers, result.buffers)
    return {
        "grads_equal": g_eq,
        "max_abs_grad_diff": g_diff,
        "worst_grad": g_where,
        "buffers_equal": b_eq,
        "max_abs_buffer_diff": b_diff,
        "worst_buffer": b_where,
        "loss_equal": reference.loss == result.loss,
        "loss": result.loss,
    }


def timed_step(work: Workload, method: Method) -> float:
    """Wall seconds of one forward and backward under ``method`` (installation inside, Python gc paused)."""
    work.model.zero_grad(set_to_none=True)
    gc.collect()
    torch.manual_seed(STEP_SEED)
    gc.disable()
    try:
        with method.context():
            t0 = time.perf_counter()
            loss = work.loss_fn(method.forward(work.inputs), work.targets)
            loss.backward()
            seconds = time.perf_counter() - t0
        del loss
    finally:
        gc.enable()
    work.model.zero_grad(set_to_none=True)
    return seconds


def timed_rounds(work: Workload, methods: list[Method], warmup: int, steps: int, log=print) -> dict[str, list[float]]:
    """Round-robin timing: each round runs every method once, the order rotated by one per round, so that slow
    drift of the machine (other load, thermal) hits every method alike. Warm-up rounds are dropped."""
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for r in range(warmup + steps):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            seconds = timed_step(work, m)
            if r >= warmup:
                times[m.name].append(seconds)
        log(f"  round {r + 1}/{warmup + steps}{' (warm-up)' if r < warmup else ''} done")
    return times


def summarize_times(times: dict[str, list[float]], eager: str = "eager") -> dict[str, dict]:
    """Median step time per method, ratio of medians to eager, and the median of per-round ratios (robust to drift)."""
    base = times[eager]
    med_e = statistics.median(base)
    min_e = min(base)
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = [t / e for t, e in zip(ts, base)]
        out[name] = {
            "step_seconds": ts,
            "median_step_seconds": med,
            "min_step_seconds": min(ts),
            "ratio_to_eager": med / med_e,
            "paired_ratio_to_eager": statistics.median(paired),
            "min_ratio_to_eager": min(ts) / min_e,
            "spread": (max(ts) - min(ts)) / med if med else 0.0,
            # steps more than twice the method's fastest: another process took the CPUs (NOTE [Threads under
            # contention] in bench/__main__.py)
            "disturbed_steps": sum(t > 2 * min(ts) for t in ts),
        }
    half = len(base) // 2
    if half:
        first, last = statistics.median(base[:half]), statistics.median(base[-half:])
        out[eager]["drift_last_over_first_half"] = last / first
    return out
