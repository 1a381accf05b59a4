"""Profiler: records one training step (:class:`StepRecording`) into a :class:`Profile`; ``libra.profile`` in
``libra/api.py`` runs it and adds the runtime's calibrations."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from libra._allocator import END_MARKER, TAP, peak_above_start, per_marker_highs
from libra._ops import model_signature, plain_tensors, storage_key
from libra.profiler._stacks import insert_hooks_under, insert_mode_under, remove_hooks, remove_mode
from libra.profiler.fake import FakeStep, benchmark_ops, estimate_ops
from libra.profiler.link import host_link_bandwidth
from libra.profiler.recorder import (ModuleProbes, Recorder, dispatch_overhead_seconds, static_tensors, unwatch_resizes,
                                     watch_resizes)
from libra.profiler.types import ModuleCall, OpRecord, PackRecord, Profile, StorageRecord
from libra.units import format_bytes

__all__ = ["StepRecording", "FakeStep", "Profile", "OpRecord", "StorageRecord", "PackRecord", "ModuleCall",
           "model_signature", "model_device", "dispatch_overhead_seconds"]

log = logging.getLogger("libra")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (else buffer; the CPU if it has neither)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class StepRecording:
    """One step under recording, started and finished by the caller.

    :func:`profile` wraps a ``step()`` call in one. ``libra.apply`` starts one in the root module's forward pre-hook
    when a step's inputs have a signature no plan was made for (``root_entered=True``: the root's forward is already
    being called, so its call is reported by :meth:`enter_root` / :meth:`exit_root`), stops it when backward ends
    (:meth:`stop` may run on autograd's device thread: it only closes the recorder) and finishes it from the main
    thread, where the mode and the hooks were entered.
    """

    def __init__(self, model: torch.nn.Module, root_entered: bool = False, fake: FakeStep | None = None,
                 calibrate: Callable | None = None) -> None:
        self.model = model
        # calibrate(ops, storages, device, live) -> (region costs, copy seconds per byte): what the runtime costs on
        # this device, measured by the caller's layer (the profiler does not import the runtime); None: not measured
        self.calibrate = calibrate
        self.root_entered = root_entered
        self.fake = fake
        self.device = fake.device if fake is not None else model_device(model)
        self.recorder: Recorder | None = None
        self.probes: ModuleProbes | None = None
        self._hooks = None
        self._root_call = None
        self.hooks: list = []  # handles the caller registered for this recording (removed with it)
        self._mode_entered = False
        self._thread = threading.get_ident()
        self._t0 = 0
        self._wall_ns: int | None = None
        self._hidden_sid = -1
        self._tap = None  # the CPU allocator tap's attachment while recording (NOTE [Allocator truth])
        self.allocator = ""
        self.calls: list = []  # a fake step's ops, kept by finish() for timing="safe" (NOTE [Safe timing])

    def start(self) -> None:
        self.overhead = dispatch_overhead_seconds()
        buffer_keys = {storage_key(b) for b in plain_tensors(self.model.buffers())}
        self.recorder = Recorder(self.device, buffer_keys)
        if self.fake is not None:  # before the static tensors: the recorder keys them by their fakes
            self.recorder.fake = True
            self.recorder.fake_mode = self.fake.mode
            self.recorder.estimate = self.fake.timing == "estimate"
            # temporaries measured op by op on real tensors, or not at all (NOTE [Estimated op times])
            self.allocator = "benchmark" if self.fake.timing == "benchmark" else ""
        self.recorder.register_static(
            static_tensors(self.model, self.device, exclude=self.fake.originals if self.fake else ()))
        if self.fake is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._add_hidden(torch.cuda.memory_allocated(self.device))
            self.allocator = "cuda"
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.fake is None and self.device.type == "cpu":
            self._tap = TAP.attach()
            if self._tap is not None:
                self.recorder.mark_ops = True
                self.allocator = "cpu-events"
                # NOTE [What the allocator holds] in libra/_allocator.py: known where a meter anchors the tap
                self._add_hidden(TAP.held_bytes())
        self.static_bytes = self.recorder.live_bytes
        self.static_names = self._static_names()
        self.probes = ModuleProbes(self.model, self.recorder)
        self.probes.install(root=not self.root_entered)
        watch_resizes(self.recorder)  # NOTE [Resized storages] in recorder.py
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.root_entered:  # NOTE [Recording a live step]
            insert_hooks_under(self.recorder.pack, self.recorder.unpack)
            insert_mode_under(self.recorder)
            self._hooks = True
        else:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self.recorder.pack, self.recorder.unpack)
            self._hooks.__enter__()
            self.recorder.__enter__()
        self._mode_entered = True
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter_ns()

    def _add_hidden(self, held_bytes: int | None) -> None:
        """What the allocator holds beyond every tensor Python can reach (cuBLAS's workspace, tensors held only by
        C++: gradients not yet read, DDP's buckets), as one static storage live through the step: the budget counts
        everything on the device (DESIGN.md, pitfall 15)."""
        hidden = (held_bytes or 0) - self.recorder.live_bytes
        if hidden > 0:
            self.recorder.storages.append(StorageRecord(nbytes=hidden, alloc_op=-1, free_op=-1, static=True))
            self.recorder.live_bytes += hidden
            self.recorder.peak_bytes = max(self.recorder.peak_bytes, self.recorder.live_bytes)
            self._hidden_sid = len(self.recorder.storages) - 1

    def _static_names(self) -> list[list]:
        names: dict[int, str] = {}
        for name, p in self.model.named_parameters():
            sid = self.recorder.lookup(p)
            if sid >= 0:
                names.setdefault(sid, name)
            grad = self.recorder.lookup(p.grad) if p.grad is not None else -1
            if grad >= 0:
                names.setdefault(grad, f"gradient of {name}")
        for name, b in self.model.named_buffers():
            sid = self.recorder.lookup(b)
            if sid >= 0:
                names.setdefault(sid, f"buffer {name}")
        return [[sid, name] for sid, name in sorted(names.items())]

    def enter_root(self, args, kwargs) -> None:
        self._root_call = self.probes.enter("", args, kwargs)

    def exit_root(self) -> None:
        if self.probes is not None and self.probes.recorder.module_stack[-1:] == [""]:
            self.probes.exit("", self._root_call)

    @property
    def stopped(self) -> bool:
        return self._wall_ns is not None

    @property
    def released(self) -> bool:
        return self._hooks is None and self._mode_entered is False

    def stop(self) -> None:
        """The step is over: later ops are not recorded. Safe to call from autograd's thread, and twice."""
        if self._wall_ns is None and self.recorder is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self._cuda_peak = torch.cuda.max_memory_allocated(self.device)
            self._wall_ns = time.perf_counter_ns() - self._t0
            self.recorder.close()
            if self.recorder.mark_ops:  # what the allocator does after this is not the step's
                with torch._C._profiler._RecordFunctionFast(END_MARKER):
                    pass
                self.recorder.mark_ops = False

    def release(self) -> bool:
        """Removes the probes, the mode and the hooks; on the thread that started the recording only (else False).

        A recording started by :func:`profile` leaves its stacks as a ``with`` block would; one started inside a
        live step is taken out from under whatever else is active (NOTE [Recording a live step]).
        """
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        if self.probes is not None:
            self.probes.remove()
        if threading.get_ident() != self._thread:
            return self.released
        if self._mode_entered:
            if self.root_entered:
                remove_mode(self.recorder)
            else:
                self.recorder.__exit__(None, None, None)
            self._mode_entered = False
        if self._hooks is not None:
            if self.root_entered:
                remove_hooks(self.recorder.pack)
            else:
                self._hooks.__exit__(None, None, None)
            self._hooks = None
        return self.released

    def _exit(self) -> None:
        if self.recorder is not None:
            unwatch_resizes(self.recorder)
        if self.recorder is not None and not self.recorder.closed:
            self.recorder.close()
        if self._tap is not None and self._tap in TAP._users:
            TAP.detach(self._tap)
        if not self.release():
            log.debug("libra: a finished recording is taken off the stacks from the thread that started it")

    def abort(self) -> None:
        """Stops recording and removes what can be removed now (see :meth:`release`); discards what was recorded."""
        self._exit()

    def _allocator_truth(self, recorder: Recorder) -> tuple[int, int]:
        """Sets each op's ``transient_bytes`` from the allocator (NOTE [Allocator truth]) and returns the step's
        peak as the simulator will see it (live storages after each op plus that op's transient bytes) and as the
        allocator saw it (-1 where it was not watched).

        On CUDA the recorder read each op's transient bytes around it. On CPU they are what the allocator held from
        the op's start to the next op's start above the storages live after the op: the kernels' temporaries, and
        what no dispatched op returns (the scalar ``x.mul_(0.5)`` wraps in a tensor that its autograd node keeps
        without a saved-tensor hook, 8 bytes until backward); of those, what is still held when the next op starts
        is also the op's ``untracked_bytes`` (NOTE [Untracked bytes] in planner/simulate.py)."""
        ops = recorder.ops
        n = len(ops)
        if self._hidden_sid >= 0:
            recorder.storages[self._hidden_sid].free_op = n  # live through the step
        live = _live_bytes(recorder.storages, n)
        allocator_peak = -1
        if self._tap is not None:
            att = self._tap
            self._tap = None
            if len(att.markers) == n:
                end = att.ends[0] if att.ends else None
                # bytes of the storages that die right after op t: live[t] less them is what op t + 1 starts with
                freed = [0] * (n + 1)
                for st in recorder.storages:
                    if 0 <= st.free_op < n and st.free_op >= st.alloc_op:
                        freed[st.free_op] += st.nbytes
                for t, (high, left) in enumerate(per_marker_highs(att.memory, att.markers, end)):
                    ops[t].transient_bytes = max(self.static_bytes + high - live[t], 0)
                    ops[t].untracked_bytes = max(self.static_bytes + left - live[t] + freed[t], 0)
                memory = att.memory if end is None else [m for m in att.memory if m[0] < end]
                allocator_peak = self.static_bytes + peak_above_start(memory)
            else:  # another user of the profiler added or took ranges: do not guess which op is which
                log.warning(
                    "libra.profile: expected %d op ranges in the allocator's events, found %d; kernels' temporary "
                    "memory is not measured this time", n, len(att.markers)
                )
                self.allocator = ""
        elif self.allocator == "cuda":
            allocator_peak = getattr(self, "_cuda_peak", -1)
        return _peak(live, ops), allocator_peak

    def finish(self) -> Profile:
        """Removes every hook and returns the profile of the recorded step."""
        self.stop()
        self._exit()
        recorder, probes = self.recorder, self.probes
        ops = recorder.ops
        if self.fake is not None:
            if self.recorder.estimate:  # NOTE [Estimated op times]
                seconds = estimate_ops(recorder.calls, self.device)
                transient = [0] * len(seconds)
                convs = sum(1 for o in ops if "convolution" in o.name)
                if convs:
                    log.warning(
                        "libra.profile: op times are estimated and kernels' temporary memory is not measured, and "
                        "this step runs %d convolution ops, whose temporaries can take MiBs each: a plan made from "
                        "this profile can run over its budget by them. Fix: timing='benchmark' where each op fits "
                        "on the device alone.", convs)
            elif self.fake.timing == "safe":  # NOTE [Safe timing]: the caller times a real step, then retime()
                seconds, transient = [0.0] * len(ops), [0] * len(ops)
                self.calls = recorder.calls  # to benchmark instead if that step's ops are not these
            else:  # NOTE [Fake profiles]: times and temporaries from each op run alone, for real
                seconds, transient = benchmark_ops(recorder.calls, self.device)
            for op, s, b in zip(ops, seconds, transient):
                op.seconds, op.transient_bytes = s, b
            recorder.calls = []
        eager_peak, allocator_peak = self._allocator_truth(recorder)
        op_seconds = sum(o.seconds for o in ops)
        costs, copy_cost = ((), 0.0) if self.calibrate is None else self.calibrate(
            ops, recorder.storages, self.device, self.root_entered)
        bandwidth = host_link_bandwidth(self.device)  # on the real device, outside any fake mode
        # NOTE [Eager step time]: the sum of the ops' times, not the recorded step's wall time less the recorder's
        # counted work: the recorder's uncounted work (module probes, finalizers, the allocator's events) made that
        # 1.5-1.9x the step's fastest plain run on the test models (ResNet, U-Net, GPT; CPU), where the ops' sum was
        # within 10% of it, and a plan's predicted step ratio 20-26% low on the small CNNs
        # (bench/predicted_vs_measured.py)
        eager_seconds = op_seconds
        prof = Profile(
            device=str(self.device),
            eager_peak_bytes=eager_peak,
            static_bytes=self.static_bytes,
            eager_step_seconds=eager_seconds,
            dispatch_overhead_seconds=self.overhead,
            ops=ops,
            storages=recorder.storages,
            packs=recorder.packs,
            module_calls=probes.calls,
            parameters=model_signature(self.model),
            input_signature=probes.input_signature,
            torch_version=torch.__version__,
            region_costs=list(costs),
            copy_seconds_per_byte=copy_cost,
            allocator=self.allocator,
            allocator_peak_bytes=allocator_peak,
            rng_state_bytes=torch.get_rng_state().nbytes if self.device.type == "cpu" else 0,
            static_names=self.static_names,
            host_bandwidth=bandwidth,
            provenance={"memory": "fake" if self.fake is not None else "step",
                        "op_seconds": self.fake.timing if self.fake is not None else "step",
                        "host_bandwidth": "measured" if bandwidth else "none"},
        )
        log.info(
            "profiled one step: %d ops, %d saved tensors, eager peak %s (static %s), %.1f ms",
            len(ops),
            len(recorder.packs),
            format_bytes(prof.eager_peak_bytes),
            format_bytes(self.static_bytes),
            eager_seconds * 1e3,
        )
        return prof


def _live_bytes(storages: list[StorageRecord], n: int) -> list[int]:
    """Bytes of the storages live after each op ``0..n`` (the last entry: after the step)."""
    delta = [0] * (n + 2)
    for st in storages:
        a = max(st.alloc_op, 0)
        f = min(max(st.free_op, st.alloc_op, 0), n)
        delta[a] += st.nbytes
        delta[f + 1] -= st.nbytes
    live = []
    level = 0
    for t in range(n + 1):
        level += delta[t]
        live.append(level)
    return live


def _peak(live: list[int], ops: list[OpRecord]) -> int:
    """The step's peak as the simulator sees it: the live bytes after each op plus that op's temporaries."""
    n = len(ops)
    return max(live[t] + (ops[t].transient_bytes if t < n else 0) for t in range(n + 1))


def retime(prof: Profile, seconds: list[float], transient: list[int] | None, source: str) -> None:
    """Gives a profile's ops the times (and temporary bytes, where given) measured by ``source`` (NOTE [Safe
    timing]), and the eager step's time and peak that follow from them."""
    for op, s in zip(prof.ops, seconds):
        op.seconds = s
    if transient is not None:
        for op, b in zip(prof.ops, transient):
            op.transient_bytes = b
    prof.eager_step_seconds = sum(seconds)
    prof.eager_peak_bytes = _peak(_live_bytes(prof.storages, len(prof.ops)), prof.ops)
    prof.provenance = {**prof.provenance, "op_seconds": source}
