"""A live-bytes meter that reads nothing from Libra's plan: it watches storages come and go.

Enter it *outside* ``libra.apply``: it then sees every op that really runs (forward, replay and backward) and nothing
that Libra's cache returns without running.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesMeter"]


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytesMeter(TorchDispatchMode):
    """Peak of all live tensor bytes on one device while the block runs, static bytes included.

    On CUDA, prefer ``torch.cuda.max_memory_allocated``; this meter is for devices without allocator statistics.

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
        key = _key(t)
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
        gc.collect()  # garbage in reference cycles would otherwise count as live, then vanish mid-step
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        for t in self.extra:
            tensors.append(t)
            if isinstance(t, torch.Tensor) and t.grad is not None:
                tensors.append(t.grad)
        for t in tensors:
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
