"""What the machine was doing: platform, CPU, torch, date and load, recorded with every result."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import platform
import subprocess

import numpy
import torch

__all__ = ["machine_info", "write_result", "steady_malloc"]

# NOTE [Page faults on CPU]: glibc's malloc hands tensors above its mmap threshold their own mappings and returns
# them to the system when freed (and trims its heap), so every step faults the same pages in again: measured on the
# bench ResNet, 16-57k minor page faults per eager step (up to ~220 MiB, some 25 ms of a 0.25 s step) against 5k under
# a Libra plan at 50%, which holds less. That tilts every ratio towards the method that allocates least, and moves
# from step to step with the heap's state; a GPU's caching allocator keeps freed blocks instead. So each timing
# worker keeps freed memory in the process (``steady_malloc``): after a warm-up step no step faults, eager's fastest
# and median steps agree within 4%, and the profile's eager time matches the measured one (ResNet, 2026-12-07).
_malloc_applied: str | None = None  # what steady_malloc did, once it ran


def steady_malloc() -> str:
    """Makes glibc's malloc keep freed memory in this process (no mmap for large blocks, no heap trim), as a GPU's
    caching allocator keeps its blocks (NOTE [Page faults on CPU]); a no-op elsewhere. Returns what was done, which
    ``machine_info`` records."""
    global _malloc_applied
    if _malloc_applied is None:
        _malloc_applied = "system default"
        name = ctypes.util.find_library("c")
        if platform.system() == "Linux" and name:
            try:
                libc = ctypes.CDLL(name)
                m_trim_threshold, m_mmap_threshold = -1, -3
                if libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 2**31 - 1):
                    _malloc_applied = "glibc: large blocks from the heap, heap never trimmed"
            except (OSError, AttributeError):
                pass
    return _malloc_applied


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git(*args: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def libra_version() -> dict:
    """The commit of the Libra being measured, and whether ``src/`` differs from it."""
    import libra

    return {"version": libra.__version__, "path": os.path.dirname(libra.__file__), "commit": _git("rev-parse", "HEAD"),
            "src_modified": bool(_git("status", "--porcelain", "src"))}


def machine_info() -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "malloc": _malloc_applied or "system default",
        "libra": libra_version(),
    }


def write_result(path, fields: dict) -> None:
    """Writes a bench's result as JSON: this machine, the time, then ``fields``; and says where."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps({"machine": machine_info(), "date": datetime.datetime.now().isoformat(
        timespec="seconds"), **fields}, indent=1) + "\n")
    print(f"wrote {path}")
