"""Profiler: runs one training step under recording and returns a :class:`Profile`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from libra._ops import storage_key
from libra.errors import LibraError
from libra.profiler._stacks import insert_hooks_under, insert_mode_under, remove_hooks, remove_mode
from libra.profiler.recorder import ModuleProbes, Recorder, dispatch_overhead_seconds, static_tensors
from libra.profiler.types import ModuleCall, OpRecord, PackRecord, Profile, StorageRecord
from libra.units import format_bytes

__all__ = ["profile", "StepRecording", "Profile", "OpRecord", "StorageRecord", "PackRecord", "ModuleCall", "model_signature"]

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
    recording = StepRecording(model)
    recording.start()
    try:
        step()
        recording.stop()
    except BaseException:
        recording.abort()
        raise
    return recording.finish()


class StepRecording:
    """One step under recording, started and finished by the caller.

    :func:`profile` wraps a ``step()`` call in one. ``libra.apply`` starts one in the root module's forward pre-hook
    when a step's inputs have a signature no plan was made for (``root_entered=True``: the root's forward is already
    being called, so its call is reported by :meth:`enter_root` / :meth:`exit_root`), stops it when backward ends
    (:meth:`stop` may run on autograd's device thread: it only closes the recorder) and finishes it from the main
    thread, where the mode and the hooks were entered.
    """

    def __init__(self, model: torch.nn.Module, root_entered: bool = False) -> None:
        self.model = model
        self.root_entered = root_entered
        self.device = _model_device(model)
        self.recorder: Recorder | None = None
        self.probes: ModuleProbes | None = None
        self._hooks = None
        self._root_call = None
        self.hooks: list = []  # handles the caller registered for this recording (removed with it)
        self._mode_entered = False
        self._thread = threading.get_ident()
        self._t0 = 0
        self._wall_ns: int | None = None

    def start(self) -> None:
        self.overhead = dispatch_overhead_seconds()
        buffer_keys = {storage_key(b) for b in self.model.buffers()}
        self.recorder = Recorder(self.device, buffer_keys)
        self.recorder.register_static(static_tensors(self.model, self.device))
        self.static_bytes = self.recorder.live_bytes
        self.probes = ModuleProbes(self.model, self.recorder)
        self.probes.install(root=not self.root_entered)
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
            self._wall_ns = time.perf_counter_ns() - self._t0
            self.recorder.close()

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
        if self.recorder is not None and not self.recorder.closed:
            self.recorder.close()
        if not self.release():
            log.debug("libra: a finished recording is taken off the stacks from the thread that started it")

    def abort(self) -> None:
        """Stops recording and removes what can be removed now (see :meth:`release`); discards what was recorded."""
        self._exit()

    def _region_costs(self, ops, storages):
        """What the region executor costs on this device at the step's typical activation size (NOTE [Region
        overhead] in runtime/calibrate.py), measured now that the step is over. A recording inside a live step
        (finished from a backward callback) only reads what was measured before; empty (the planner's fallback)
        if nothing was."""
        from libra.runtime.calibrate import cached_region_costs, region_costs  # runtime imports us

        sizes = sorted(storages[s].nbytes for o in ops if not o.backward for s in o.outputs)
        typical = sizes[len(sizes) // 2] if sizes else 0
        if self.root_entered:
            return cached_region_costs(self.device, typical) or ()
        return region_costs(self.device, typical)

    def _copy_cost(self, ops, storages) -> float:
        """Seconds per byte of a clone on this device (NOTE [Copy cost] in planner/simulate.py), measured at the
        size of the largest activation the forward writes in place (what a region's copy-on-write clones), else
        at the median activation size; 0.0 (the planner's fallback) inside a live step if nothing was measured."""
        from libra.runtime.calibrate import cached_copy_seconds_per_byte, copy_seconds_per_byte

        written = [storages[s].nbytes for o in ops if not o.backward for s in o.writes if not storages[s].static]
        sizes = sorted(storages[s].nbytes for o in ops if not o.backward for s in o.outputs)
        size = max(written) if written else sizes[len(sizes) // 2] if sizes else 0
        if self.root_entered:
            return cached_copy_seconds_per_byte(self.device, size)
        return copy_seconds_per_byte(self.device, size)

    def finish(self) -> Profile:
        """Removes every hook and returns the profile of the recorded step."""
        self.stop()
        self._exit()
        recorder, probes = self.recorder, self.probes
        ops = recorder.ops
        op_seconds = sum(o.seconds for o in ops)
        costs = self._region_costs(ops, recorder.storages)
        copy_cost = self._copy_cost(ops, recorder.storages)
        eager_seconds = max(
            self._wall_ns / 1e9 - recorder.bookkeeping_ns / 1e9 - self.overhead * len(ops), op_seconds
        )
        prof = Profile(
            device=str(self.device),
            eager_peak_bytes=recorder.peak_bytes,
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
