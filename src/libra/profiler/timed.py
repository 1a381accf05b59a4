"""Op times from one real step that recomputes every module call (``timing="safe"``; NOTE [Safe timing]).

NOTE [Safe timing]: a fake profile knows every op of the step but no op's time. Timing each op alone
(``timing="benchmark"``) misses what ops share in a step (a cache the previous op warmed: 0.61-0.77x of the in-step
time on this project's CPU). The step itself, with every module call recomputed (the lowest-peak plan of the fake
profile, recompute only), needs 0.42-0.48x of eager's memory and runs every op of eager's step in eager's order: the
forward unchanged, the backward with each call's replay before its own backward ops. :class:`StepTimer` times every
op of that step and tells replays apart the way checkpoint runs them: inside a backward node with gradients enabled
(backward ops themselves run with gradients disabled, unless a step asks for ``create_graph``). What is left must be
the profile's op sequence, name by name; :func:`align` returns None where it is not (a step whose ops differ between
the two runs), and the caller falls back to benchmarking each op. The kernels' temporaries come from the same step:
on CUDA from the caching allocator's peak around each op, on CPU from the allocator's events inside each op's range
(NOTE [Allocator truth] in libra/_allocator.py).
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from libra._allocator import MARKER, TAP, per_marker_extra
from libra._ops import UNCOUNTED, op_info
from libra.profiler._warm import warm_first_call

__all__ = ["StepTimer", "align", "first_difference"]


class StepTimer(TorchDispatchMode):
    """Times every op dispatched while it is entered: its name, seconds, temporary bytes, and whether a checkpoint
    replayed it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.cuda = device.type == "cuda"
        self.names: list[str] = []
        self.seconds: list[float] = []
        self.replayed: list[bool] = []
        self.transient: list[int] = []
        self.measured_transient = False
        self._tap = None

    def __enter__(self):
        if not self.cuda:
            self._tap = TAP.attach()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._tap is not None:
            att, self._tap = self._tap, None
            TAP.detach(att)
            if len(att.markers) == len(self.names):
                self.transient = per_marker_extra(att.memory, att.markers)
                self.measured_transient = True
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UNCOUNTED:
            return func(*args, **kwargs)
        replayed = torch._C._current_autograd_node() is not None and torch.is_grad_enabled()
        info = op_info(func)
        warm_first_call(func, info, args, kwargs, self._tap is not None)  # NOTE [First calls]
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self._tap is not None:
            with torch._C._profiler._RecordFunctionFast(MARKER):
                t0 = time.perf_counter_ns()
                out = func(*args, **kwargs)
                t1 = time.perf_counter_ns()
        else:
            t0 = time.perf_counter_ns()
            out = func(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize(self.device)
                held = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
                self.transient.append(max(int(held), 0))
                self.measured_transient = True
            t1 = time.perf_counter_ns()
        self.names.append(info.name)
        self.seconds.append((t1 - t0) / 1e9)
        self.replayed.append(replayed)
        return out


def align(names: list[str], timer: StepTimer) -> tuple[list[float], list[int] | None] | None:
    """The timed step's seconds (and temporary bytes, None where not measured) for each of ``names``, the
    profile's op sequence; None where the step's ops, replays left out, are not that sequence."""
    kept = [i for i, r in enumerate(timer.replayed) if not r]
    if len(kept) != len(names) or any(timer.names[i] != n for i, n in zip(kept, names)):
        return None
    seconds = [timer.seconds[i] for i in kept]
    transient = [timer.transient[i] for i in kept] if timer.measured_transient else None
    return seconds, transient


def first_difference(names: list[str], timer: StepTimer) -> str:
    """Where the timed step's ops, replays left out, first differ from ``names`` (for the log)."""
    kept = [timer.names[i] for i, r in enumerate(timer.replayed) if not r]
    for j, (a, b) in enumerate(zip(kept, names)):
        if a != b:
            return f"op {j}: {a} where the profile has {b}"
    return f"{len(kept)} ops where the profile has {len(names)}"
