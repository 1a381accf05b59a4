"""What the CPU allocator hands out, seen from Python: one process-wide tap on torch.profiler's memory events.

NOTE [Allocator truth]: a dispatch mode sees the storages ops return, not the memory kernels take inside themselves
and give back before they return (oneDNN weight reorders, im2col columns, cuDNN and cuBLAS workspaces): a
``convolution_backward`` of DeepLabV3 allocated 68.6 MiB of temporaries no storage ever showed. On CUDA the caching
allocator's statistics (``memory_allocated``, ``max_memory_allocated``) see every byte. The CPU allocator keeps no
statistics; torch.profiler with ``profile_memory=True`` reports each allocation and free it makes (``[memory]``
events: bytes, signed, and a time). Only one profiler session can run in a process, and a second one started inside
it silently takes the first one's events, so every Libra user of the events (the profiler's per-op transient bytes,
``libra.testing.AllocatorMeter``) shares the one session this module owns. A user attaches, the tap *flushes* (ends
the session, keeps its events, starts a new one) whenever a user attaches or detaches, and each user reads the
events that arrived while it was attached. The CPU allocator remembers the size of every block allocated while any
session ran, so a free in a later session is still reported; blocks allocated before the first session are freed
without an event (the tap then counts too much, never too little).

Kineto prints two lines to stderr for every session it starts and stops; the tap silences them through
``KINETO_LOG_LEVEL``, which kineto reads once, when its first session starts (the variable is restored right after).
If another profiler is running when a user attaches (the user's own ``torch.profiler.profile``), the tap stays off
and says so: ``attach`` returns None.

NOTE [What the allocator holds]: the CPU allocator keeps no count of what it holds, and the tensors gc can reach are
not all of it: a gradient autograd made has no Python object until it is first read, DDP's reducer holds its buckets
in C++ only. A user that attaches with the bytes held at that moment (``AllocatorMeter`` does) anchors the tap: from
then on, what is held is that figure plus every event since (``held_bytes``), every byte the allocator hands out
included. The profiler and the meter start from it where one is anchored (the oldest anchor, which has seen the
most), so a profile and a measurement made under one meter count the same live set (DESIGN.md, pitfall 15).
"""

from __future__ import annotations

import bisect
import gc
import logging
import os
import threading

import torch

__all__ = ["AllocatorTap", "TAP", "MARKER", "END_MARKER", "WARM_MARKER", "peak_above_start", "per_marker_highs",
           "per_marker_extra"]

log = logging.getLogger("libra")

MARKER = "libra::op"  # the record-function name the recorder brackets each op with
END_MARKER = "libra::end"  # the recorder marks where its step ended (what comes after is not the step's)
WARM_MARKER = "libra::warm"  # an untimed first call the recorder makes (NOTE [First calls] in profiler/_warm.py)


def _other_profiler_running() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


class _Attachment:
    """One user's window on the tap: the memory events and markers since it attached."""

    def __init__(self, tap: "AllocatorTap", mem_start: int, marker_start: int, start_bytes: int | None = None,
                 base_sum: int = 0) -> None:
        self.tap = tap
        self.mem_start = mem_start
        self.marker_start = marker_start
        self.start_bytes = start_bytes  # held when it attached, if known (NOTE [What the allocator holds])
        self.base_sum = base_sum  # the tap's running sum of events when it attached
        self.memory: list[tuple[int, int]] = []  # (time ns, signed bytes), filled by detach
        self.markers: list[tuple[int, int]] = []  # (start ns, end ns) of MARKER ranges, sorted by start
        self.ends: list[int] = []  # start ns of END_MARKER ranges


class AllocatorTap:
    """Owns the one profiler session that reports CPU allocations (NOTE [Allocator truth])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: list[_Attachment] = []
        self._session = None
        self._memory: list[tuple[int, int]] = []
        self._markers: list[tuple[int, int]] = []
        self._ends: list[int] = []
        self._sum = 0  # running sum of the signed bytes of every event in the current run of sessions

    @property
    def active(self) -> bool:
        return self._session is not None

    def attach(self, start_bytes: int | None = None) -> _Attachment | None:
        """Starts seeing allocations; None when another profiler is running (then nothing is seen). ``start_bytes``:
        what the allocator holds now, if the caller knows (it anchors :meth:`held_bytes`)."""
        with self._lock:
            if self._session is None and _other_profiler_running():
                log.warning(
                    "libra: another torch.profiler session is running, so the CPU allocator's events cannot be "
                    "read; kernels' temporary memory is not measured this time"
                )
                return None
            self._flush(restart=True)
            att = _Attachment(self, len(self._memory), len(self._markers), start_bytes, self._sum)
            self._users.append(att)
            return att

    def held_bytes(self) -> int | None:
        """What the CPU allocator holds now, counted from the oldest attached user that knew what it held when it
        attached (NOTE [What the allocator holds]); None where no such user is attached."""
        with self._lock:
            anchor = next((u for u in self._users if u.start_bytes is not None), None)
            if anchor is None:
                return None
            self._flush(restart=True)
            return anchor.start_bytes + self._sum - anchor.base_sum

    def read(self, att: _Attachment) -> list[tuple[int, int]]:
        """The memory events since ``att`` attached, up to now (ends the session and starts another)."""
        with self._lock:
            self._flush(restart=True)
            return self._memory[att.mem_start :]

    def detach(self, att: _Attachment) -> _Attachment:
        """Stops ``att`` and fills its ``memory`` and ``markers``; the session ends with its last user."""
        with self._lock:
            self._users.remove(att)
            self._flush(restart=bool(self._users))
            att.memory = self._memory[att.mem_start :]
            att.markers = self._markers[att.marker_start :]
            att.ends = [t for t in self._ends if not att.markers or t >= att.markers[0][0]]
            if not self._users:
                self._memory, self._markers, self._ends = [], [], []
                self._sum = 0
            else:  # drop what no remaining user can still read
                keep_mem = min(u.mem_start for u in self._users)
                keep_mark = min(u.marker_start for u in self._users)
                if keep_mem or keep_mark:
                    self._memory = self._memory[keep_mem:]
                    self._markers = self._markers[keep_mark:]
                    for u in self._users:
                        u.mem_start -= keep_mem
                        u.marker_start -= keep_mark
            return att

    def _flush(self, restart: bool) -> None:
        if self._session is None:
            if restart:
                self._start()
            return
        session, self._session = self._session, None
        # a block freed between two sessions is never reported (the allocator only forgets sizes while one runs),
        # and the tap then counts it held for good: the next session starts before the events are read, and no
        # garbage collection (tensors in reference cycles) runs in between
        enabled = gc.isenabled()
        gc.disable()
        try:
            session.__exit__(None, None, None)
            if restart:
                self._start()
        finally:
            if enabled:
                gc.enable()
        memory, markers, warm = [], [], []
        for e in session.profiler.kineto_results.events():
            name = e.name()
            if name == "[memory]":
                if e.device_type() == torch._C._autograd.DeviceType.CPU:
                    memory.append((e.start_ns(), e.nbytes()))
            elif name == MARKER:
                markers.append((e.start_ns(), e.start_ns() + e.duration_ns()))
            elif name == END_MARKER:
                self._ends.append(e.start_ns())
            elif name == WARM_MARKER:
                warm.append((e.start_ns(), e.start_ns() + e.duration_ns()))
        memory.sort(key=lambda m: m[0])
        markers.sort()
        if warm:
            memory = _folded(memory, sorted(warm))
        self._sum += sum(nbytes for _, nbytes in memory)
        self._memory.extend(memory)
        self._markers.extend(markers)

    def _start(self) -> None:
        quiet = "KINETO_LOG_LEVEL" not in os.environ
        if quiet:  # NOTE [Allocator truth]: kineto reads it once, at its first session
            os.environ["KINETO_LOG_LEVEL"] = "6"
        try:
            session = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False
            )
            session.__enter__()
        finally:
            if quiet:
                del os.environ["KINETO_LOG_LEVEL"]
        self._session = session


TAP = AllocatorTap()


def _folded(memory: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``memory`` with the events inside each of ``ranges`` (sorted, disjoint) replaced by one event of their sum
    at the range's end: what an untimed call took and gave back there is nobody's (NOTE [First calls] in
    profiler/_warm.py); what it kept still counts."""
    out: list[tuple[int, int]] = []
    starts = [a for a, _ in ranges]
    net: dict[int, int] = {}
    for t, nbytes in memory:
        k = bisect.bisect_right(starts, t) - 1
        if k >= 0 and t <= ranges[k][1]:
            net[k] = net.get(k, 0) + nbytes
        else:
            out.append((t, nbytes))
    out.extend((ranges[k][1], nbytes) for k, nbytes in net.items() if nbytes)
    out.sort(key=lambda m: m[0])
    return out


def peak_above_start(memory: list[tuple[int, int]]) -> int:
    """Highest running sum of signed allocation events (0 if it never rises above where it started)."""
    level = peak = 0
    for _, nbytes in memory:
        level += nbytes
        if level > peak:
            peak = level
    return peak


def per_marker_extra(memory: list[tuple[int, int]], markers: list[tuple[int, int]]) -> list[int]:
    """For each marker range, the most the allocator held inside it above what it held when the range ended:
    what an op took and gave back before returning (0 where nothing was)."""
    times = [t for t, _ in memory]
    out = []
    for start, end in markers:
        level = peak = 0
        for k in range(bisect.bisect_left(times, start), bisect.bisect_right(times, end)):
            level += memory[k][1]
            peak = max(peak, level)
        out.append(max(peak - max(level, 0), 0))
    return out


def per_marker_highs(memory: list[tuple[int, int]], markers: list[tuple[int, int]],
                     end: int | None = None) -> list[tuple[int, int]]:
    """For each marker range, ``(high, left)``: the most the allocator held (above where the events start) from the
    range's start to the next range's start, inside the op and between it and the next op, and what it held when
    the next range started (the first range also covers what came before it, the last what came after it, up to
    ``end`` ns if given)."""
    if end is not None:
        memory = memory[: bisect.bisect_left([t for t, _ in memory], end)]
    times = [t for t, _ in memory]
    out = []
    level = 0
    k = 0
    for i, (start, _end) in enumerate(markers):
        stop = markers[i + 1][0] if i + 1 < len(markers) else None
        hi = bisect.bisect_left(times, stop) if stop is not None else len(memory)
        high = level
        while k < hi:
            level += memory[k][1]
            if level > high:
                high = level
            k += 1
        out.append((high, level))
    return out
