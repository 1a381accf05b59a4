"""Profiler: runs one training step under recording and returns a :class:`Profile`."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from libra._ops import storage_key
from libra.errors import LibraError
from libra.profiler.recorder import ModuleProbes, Recorder, dispatch_overhead_seconds, static_tensors
from libra.profiler.types import ModuleCall, OpRecord, PackRecord, Profile, StorageRecord
from libra.units import format_bytes

__all__ = ["profile", "Profile", "OpRecord", "StorageRecord", "PackRecord", "ModuleCall", "model_signature"]

log = logging.getLogger("libra")


def model_signature(model: torch.nn.Module) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of every parameter and buffer: what a plan is checked against before it is applied."""
    entries = [(name, list(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    entries += [(name, list(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    return entries


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def profile(model: torch.nn.Module, step: Callable[[], object]) -> Profile:
    """Runs ``step()`` once under recording and returns what it did.

    ``step`` is one training step's forward and backward (``loss_fn(model(x), y).backward()``); its gradients,
    buffer updates and RNG draws happen exactly as in a plain call. Profile after a warm-up step if the optimizer
    creates state lazily, so that the static bytes include it.

    Args:
        model: the module whose submodules may later be recomputed.
        step: a callable running one forward and backward.

    Returns:
        A :class:`Profile`.

    Raises:
        LibraError: ``model`` is not a module or ``step`` not callable. Whatever ``step`` raises propagates unchanged,
            with every hook removed.

    Example:
        >>> prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
        >>> prof.eager_peak_bytes > prof.static_bytes
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise LibraError(f"libra.profile: expected a torch.nn.Module, got {type(model).__name__}.")
    if not callable(step):
        raise LibraError(f"libra.profile: expected a callable step, got {type(step).__name__}.")
    device = _model_device(model)
    overhead = dispatch_overhead_seconds()
    buffer_keys = {storage_key(b) for b in model.buffers()}
    recorder = Recorder(device, buffer_keys)
    recorder.register_static(static_tensors(model, device))
    static_bytes = recorder.live_bytes
    probes = ModuleProbes(model, recorder)
    probes.install()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter_ns()
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack), recorder:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        wall_ns = time.perf_counter_ns() - t0
        probes.remove()
        recorder.close()
    ops = recorder.ops
    op_seconds = sum(o.seconds for o in ops)
    eager_seconds = max(wall_ns / 1e9 - recorder.bookkeeping_ns / 1e9 - overhead * len(ops), op_seconds)
    prof = Profile(
        device=str(device),
        eager_peak_bytes=recorder.peak_bytes,
        static_bytes=static_bytes,
        eager_step_seconds=eager_seconds,
        dispatch_overhead_seconds=overhead,
        ops=ops,
        storages=recorder.storages,
        packs=recorder.packs,
        module_calls=probes.calls,
        parameters=model_signature(model),
        torch_version=torch.__version__,
    )
    log.info(
        "profiled one step: %d ops, %d saved tensors, eager peak %s (static %s), %.1f ms",
        len(ops),
        len(recorder.packs),
        format_bytes(prof.eager_peak_bytes),
        format_bytes(static_bytes),
        eager_seconds * 1e3,
    )
    return prof
