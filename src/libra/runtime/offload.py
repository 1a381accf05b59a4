"""Offload: copies of kept outputs in host memory, from a pool of buffers reused across steps, and back.

NOTE [Offload streams]: on CUDA the copy out runs on a side stream after the producing kernel (the side stream waits
on the current one) into a pinned buffer; ``record_stream`` keeps the caching allocator from reusing the device
memory before the copy has read it, so nothing synchronizes in the hot path. The copy back runs on the side stream
when the region's prefetch trigger starts its backward, or at its first use (NOTE [Prefetch] in the simulator), and
the replay that needs it makes the current stream wait on its event. On CPU the same code runs with plain
synchronous copies.
"""

from __future__ import annotations

import torch

__all__ = ["HostPool", "HostCopy"]


class HostPool:
    """Host buffers by size, reused across steps: after the first step a plan's offloads allocate nothing."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.allocated_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.numel(), []).append(buffer)


class HostCopy:
    """One offloaded tensor: its host copy, and the device tensor once it is brought back."""

    def __init__(self, t: torch.Tensor, pool: HostPool, stream) -> None:
        self.pool = pool
        self.device = t.device
        self.shape, self.dtype, self.stride = t.shape, t.dtype, t.stride()
        self.buffer = pool.acquire(t.untyped_storage().nbytes())
        self.storage_offset = t.storage_offset()
        self.version = t._version  # the value copied: a later in-place change makes the copy stale
        self.event = None
        self._back: torch.Tensor | None = None
        host = self.buffer.view(t.dtype)
        flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(flat, non_blocking=True)
            t.record_stream(stream)
        else:
            host.copy_(flat)

    def prefetch(self, stream) -> None:
        """Starts the copy back to the device (idempotent)."""
        if self._back is not None:
            return
        host = self.buffer.view(self.dtype)
        if stream is not None:
            with torch.cuda.stream(stream):
                flat = host.to(self.device, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            flat = host.to(self.device, copy=True)
        self._back = torch.as_strided(flat, self.shape, self.stride, self.storage_offset)

    def get(self, stream) -> torch.Tensor:
        """The device tensor, waiting for its copy if one is in flight."""
        self.prefetch(stream)
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self._back.record_stream(torch.cuda.current_stream(self.device))
            self.event = None
        return self._back

    def close(self) -> None:
        """Returns the host buffer to the pool (after the copy back has read it)."""
        if self.buffer is not None:
            if self.event is not None:
                self.event.synchronize()
            self.pool.release(self.buffer)
            self.buffer = None
