"""The host link: how fast a device copies to and from pinned host memory. Measured by the profiler and carried in
the Profile (``Profile.host_bandwidth``), so the planner never touches a device (DESIGN.md: the planner is a pure
function over a profile)."""

from __future__ import annotations

import time

import torch

__all__ = ["host_link_bandwidth"]

_MEASURED: dict[str, float] = {}


def host_link_bandwidth(device: torch.device) -> float:
    """Bytes per second of a pinned copy over ``device``'s host link in its slower direction, measured once per
    device (64 MiB each way, best of three), or 0.0 where the device has no memory of its own to offload from (the
    CPU).

    Each direction is timed on its own: links are often asymmetric (a GH200's C2C copies about 415 GB/s to the device
    and 170 GB/s back), and offloading pays for both, the copy out while the forward runs and the copy back while the
    backward does.
    """
    if device.type != "cuda":
        return 0.0
    key = str(device)
    if key not in _MEASURED:
        n = 64 * 2**20
        on_device = torch.empty(n, dtype=torch.uint8, device=device)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        slowest = 0.0
        for dst, src in ((host, on_device), (on_device, host)):
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(device)
                best = min(best, time.perf_counter() - t0)
            slowest = max(slowest, best)
        _MEASURED[key] = n / slowest
    return _MEASURED[key]
