"""Meters that read nothing from Libra's plan.

:class:`AllocatorMeter` counts what the allocator hands out, kernels' workspaces and temporaries included: the meter
every budget check uses. :class:`LiveBytesMeter` watches tensor storages come and go, a second opinion that sees only
what ops return (it agrees with the planner's bookkeeping by construction, so it cannot catch what the planner
misses; enter it *outside* ``libra.apply``, so that it sees every op that really runs). :class:`MemoryCap` makes a
device with less memory for tests: past its cap an op raises ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from libra._allocator import TAP, peak_above_start
from libra._ops import plain_tensors, storage_key
from libra.errors import LibraError

__all__ = ["AllocatorMeter", "LiveBytesMeter", "MemoryCap"]


def _live_tensor_bytes(device: torch.device, extra) -> int:
    """Bytes of every distinct storage on ``device`` that gc or ``extra`` (tensors, with their ``.grad``) reach."""
    gc.collect()  # garbage in reference cycles would otherwise count as live, then vanish mid-step
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for t in extra:
        tensors.append(t)
        if isinstance(t, torch.Tensor) and t.grad is not None:
            tensors.append(t.grad)
    tensors = plain_tensors(tensors)
    seen: dict[int, int] = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in seen and t.device == device:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


class AllocatorMeter:
    """Peak of what the allocator held on one device while the block ran, static bytes and kernels' temporaries
    included: the figure a budget promises (NOTE [Allocator truth] in libra/_allocator.py).

    On CUDA it is ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``. On CPU, where the
    allocator keeps no statistics, it is the tensor storages live when the block starts (what gc and ``extra`` reach)
    plus the highest running sum of torch.profiler's memory events during the block. Those events come from the
    thread that started the profiler session only: what another thread allocates or frees (gloo's workers, a thread
    of your own) goes unseen (torch 2.13; ``profile_all_threads=True`` reports no memory events there at all).
    Meters nest, and work with ``libra.profile`` inside them; not inside a ``torch.profiler.profile`` of your own.
    Inside another meter, a meter and ``libra.profile`` start from what the outer one counts the allocator holding,
    if that is more than gc reaches: tensors only C++ holds (gradients not yet read, DDP's buckets) are then counted
    too. Enter one meter before the model is built to measure and profile steps from everything the process holds.

    Attributes:
        start_bytes: held when the block began. ``peak_bytes``: the most held at once. ``end_bytes``: held at the end.
        ``current_bytes``: held now.

    Example:
        >>> with AllocatorMeter(extra=model.parameters()) as meter:
        ...     step()
        >>> meter.peak_bytes <= plan.budget_bytes
    """

    def __init__(self, device: str | torch.device = "cpu", extra=()) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise LibraError(
                f"libra.testing.AllocatorMeter: expected a cpu or cuda device, got {self.device}. Fix: use "
                "LiveBytesMeter there (it counts tensor storages only)."
            )
        self.extra = list(extra)
        self.start_bytes = self.peak_bytes = self.end_bytes = 0
        self._att = None
        self._inside = False

    def __enter__(self) -> "AllocatorMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            # NOTE [What the allocator holds] in libra/_allocator.py: inside an outer meter, its count is the truth
            self.start_bytes = max(_live_tensor_bytes(self.device, self.extra), TAP.held_bytes() or 0)
            self._att = TAP.attach(start_bytes=self.start_bytes)
            if self._att is None:
                raise LibraError(
                    "libra.testing.AllocatorMeter: expected to read the CPU allocator's events, but another "
                    "torch.profiler session is running. Fix: end it before entering the meter."
                )
        self.extra = []  # hold no references past the scan: they would outlive the block and distort the next one
        self.peak_bytes = self.end_bytes = self.start_bytes
        self._inside = True
        return self

    @property
    def current_bytes(self) -> int:
        """What the allocator holds now (inside the block; after it, what it held at the end)."""
        if self.device.type == "cuda" and self._inside:
            return torch.cuda.memory_allocated(self.device)
        if self._att is None:
            return self.end_bytes
        return self.start_bytes + sum(nbytes for _, nbytes in TAP.read(self._att))

    def __exit__(self, *exc) -> bool:
        self._inside = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.end_bytes = torch.cuda.memory_allocated(self.device)
        else:
            att, self._att = self._att, None
            TAP.detach(att)
            self.peak_bytes = self.start_bytes + peak_above_start(att.memory)
            self.end_bytes = self.start_bytes + sum(nbytes for _, nbytes in att.memory)
        return False


class LiveBytesMeter(TorchDispatchMode):
    """Peak of all live tensor bytes on one device while the block runs, static bytes included.

    It sees only what ops return, never what kernels take inside them: budgets are checked with
    :class:`AllocatorMeter`; this one is a second opinion that attributes bytes to storages.

    Example:
        >>> with LiveBytesMeter(extra=model.parameters()) as meter:
        ...     step()
        >>> meter.peak_bytes
    """

    def __init__(self, device: str | torch.device = "cpu", extra=()) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.extra = list(extra)
        self.live: dict[int, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.start_bytes = 0
        self._finalizers: list[weakref.finalize] = []

    def _track(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key is None or key in self.live or t.device != self.device:
            return
        storage = t.untyped_storage()
        self.live[key] = storage.nbytes()
        self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def _free(self, key: int) -> None:
        self.current_bytes -= self.live.pop(key, 0)

    def __enter__(self):
        self.live, self.current_bytes = {}, 0  # a meter entered again starts afresh
        gc.collect()  # garbage in reference cycles would otherwise count as live, then vanish mid-step
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        for t in self.extra:
            tensors.append(t)
            if isinstance(t, torch.Tensor) and t.grad is not None:
                tensors.append(t.grad)
        for t in plain_tensors(tensors):
            self._track(t)
        self.extra = []  # hold no references past the scan: they would outlive the block and distort the next one
        self.start_bytes = self.current_bytes
        self.peak_bytes = self.current_bytes
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for fin in self._finalizers:
            fin.detach()
        self._finalizers.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class MemoryCap(LiveBytesMeter):
    """A device with less memory, for tests: an op whose outputs take the live tensor bytes on ``device`` past
    ``limit_bytes`` raises ``torch.OutOfMemoryError``, as a CUDA allocator out of memory would, so a test can show an
    eager step failing where a plan made from a fake profile trains.

    On CUDA the allocator itself is capped (``torch.cuda.set_per_process_memory_fraction``, restored on exit), so
    every byte counts, kernels' workspaces included. On CPU the cap counts what :class:`LiveBytesMeter` counts: the
    storages live when the block starts and those ops return (fake tensors excluded), not the temporaries kernels
    take inside an op, and it raises once the op has returned. Enter it outside ``libra.apply``, like the meter.

    Attributes:
        limit_bytes: the cap. ``peak_bytes``: the most live at once inside the block (as :class:`LiveBytesMeter`).

    Example:
        >>> with MemoryCap(200 * 2**20, extra=model.parameters()):
        ...     step()  # raises torch.OutOfMemoryError if the step needs more than 200 MiB
    """

    def __init__(self, limit_bytes: int, device: str | torch.device = "cpu", extra=()) -> None:
        super().__init__(device, extra)
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise LibraError(f"libra.testing.MemoryCap: expected a positive int of bytes, got {limit_bytes!r}.")
        self.limit_bytes = limit_bytes
        self._capped = False  # the CUDA allocator's fraction is set (torch has no getter: exit sets it back to 1.0)

    def __enter__(self):
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / total), index)
            self._capped = True
        return super().__enter__()

    def __exit__(self, *exc):
        if self._capped:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self._capped = False
        return super().__exit__(*exc)

    def _track(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor):
            return
        super()._track(t)
        if self.current_bytes > self.limit_bytes and self.device.type != "cuda":
            raise torch.OutOfMemoryError(
                f"libra.testing.MemoryCap: {self.current_bytes} bytes live on {self.device}, past the cap of "
                f"{self.limit_bytes} bytes (a tensor of {t.untyped_storage().nbytes()} bytes was the last)."
            )
