"""What the machine was doing: platform, CPU, torch, date and load, recorded with every result."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess

import numpy
import torch

__all__ = ["machine_info", "write_result"]


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
        "libra": libra_version(),
    }


def write_result(path, fields: dict) -> None:
    """Writes a bench's result as JSON: this machine, the time, then ``fields``; and says where."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps({"machine": machine_info(), "date": datetime.datetime.now().isoformat(
        timespec="seconds"), **fields}, indent=1) + "\n")
    print(f"wrote {path}")
