"""Records one eager step: every aten op, every storage's lifetime, every tensor autograd saves, every module call.

Three instruments run together (see DESIGN.md, Profiler):
- a ``TorchDispatchMode`` that sees each aten op with its inputs, fresh outputs, declared and undeclared writes, time;
- ``saved_tensors_hooks`` that see what autograd saves and when backward unpacks it;
- a live-bytes meter: ``weakref.finalize`` on every fresh output storage gives each storage's free time;
- the allocator (NOTE [Allocator truth] in libra/_allocator.py): what each op's kernels take and give back inside it,
  from the caching allocator's statistics on CUDA and from torch.profiler's memory events on CPU (each op bracketed
  by a ``libra::op`` record-function range, matched to the events afterwards by :meth:`StepRecording.finish`).
Module forwards are wrapped (instance attribute, restored afterwards) so that op ranges match exactly what the region
executor will later wrap in a checkpoint.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from libra._allocator import MARKER
from libra._forward import ForwardSwaps
from libra._ops import (STATEFUL_OPS, UNCOUNTED, arg_values, call_tensors, input_signature, kv_cache_args, op_info,
                        plain_tensors, storage_key, tensors_in)
from libra.errors import LibraError
from libra.profiler._warm import warm_first_call
from libra.profiler.fake import OpCall
from libra.profiler.types import ModuleCall, OpRecord, PackRecord, StorageRecord

__all__ = ["Recorder", "ModuleProbes", "static_tensors", "dispatch_overhead_seconds", "allocated_bytes",
           "watch_resizes", "unwatch_resizes"]


def allocated_bytes(nbytes: int, cuda: bool) -> int:
    """What the allocator hands out for a storage of ``nbytes``: on CUDA the caching allocator rounds every block
    up to a multiple of 512 bytes (what ``memory_allocated`` counts); the CPU allocator takes exactly ``nbytes``."""
    if not cuda or nbytes == 0:
        return nbytes
    return -(-nbytes // 512) * 512


class Recorder(TorchDispatchMode):
    """Dispatch mode + saved-tensor hooks + live-bytes meter over one step."""

    def __init__(self, device: torch.device, buffer_keys: set[int]) -> None:
        super().__init__()
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffer_keys = buffer_keys
        self.ops: list[OpRecord] = []
        self.storages: list[StorageRecord] = []
        self.packs: list[PackRecord] = []
        self.module_stack: list[str] = []
        self.call_stack: list[int] = []  # indices into ModuleProbes.calls of the active grad-enabled calls
        self.live_bytes = 0
        self.peak_bytes = 0
        self.closed = False
        self.mark_ops = False  # bracket each op with a MARKER range (set while the CPU allocator tap is attached)
        self.fake = False  # the step runs on fake tensors (NOTE [Fake profiles] in profiler/fake.py)
        self.estimate = False  # op times will be estimated from each op's flops and bytes (NOTE [Estimated op times])
        self.fake_mode = None  # and this is its FakeTensorMode
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a real tensor -> (it, its fake)
        self.calls: list = []  # under fake tensors: each op's OpCall, to be benchmarked on real ones
        self._sid: dict[int, int] = {}
        self._finalizers: list[weakref.finalize] = []
        self._drops: list[weakref.finalize] = []  # one per tensor object a forward op returned (NOTE [Python's hold])
        self._releases: list[weakref.finalize] = []  # one per save (PackRecord.released_op)
        self._resized_from: dict[int, int] = {}  # NOTE [Resized storages]: first record of a storage -> its current
        self._resized_away: set[int] = set()  # records already freed by a resize
        self.hook_depth = 0  # > 0 while FSDP2's forward hooks run (NOTE [FSDP2's hooks are never replayed])

    # ---- storages -------------------------------------------------------------------------------------------
    def _as_fake(self, t: torch.Tensor) -> torch.Tensor:
        """Under a fake step, the fake tensor the mode makes of a real one (the step's inputs, optimizer state):
        ops see the real tensor here, above the mode, but alias its fake (NOTE [Fake profiles])."""
        if self.fake_mode is None or isinstance(t, FakeTensor) or t.device != self.device:
            return t
        # held for the whole step: the mode remembers a conversion only while its fake lives, and a fake made
        # afresh for each op that reads the tensor would be a new storage each time
        got = self._fakes.get(id(t))
        if got is None or got[0] is not t:
            got = self._fakes[id(t)] = (t, self.fake_mode.from_tensor(t))
        return got[1]

    def _register(self, t: torch.Tensor, alloc_op: int, producer: int, static: bool) -> int:
        t = self._as_fake(t)
        key = storage_key(t)
        if key is None or t.device != self.device:
            return -1
        sid = self._sid.get(key)
        if sid is not None:
            return sid
        storage = t.untyped_storage()
        sid = len(self.storages)
        nbytes = allocated_bytes(storage.nbytes(), self.cuda)
        self.storages.append(
            StorageRecord(nbytes=nbytes, alloc_op=alloc_op, free_op=-1, producer=producer, static=static)
        )
        self._sid[key] = sid
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(storage, self._on_free, key, sid))
        return sid

    def _on_free(self, key: int, sid: int) -> None:
        sid = self._resized_from.pop(sid, sid)
        if self._sid.get(key) == sid:
            del self._sid[key]
        if sid in self._resized_away:
            return
        record = self.storages[sid]
        record.free_op = max(len(self.ops) - 1, record.alloc_op)
        self.live_bytes -= record.nbytes

    def _watch_drop(self, t: torch.Tensor, sid: int) -> None:
        """NOTE [Python's hold]: autograd's saves keep a storage alive in eager, so its free time does not show when
        Python let go of it; under a plan that saves nothing there, that moment is when it dies. A finalizer on each
        tensor object a forward op returns fires when Python drops the object: the pack hook holds a detached alias,
        not the object itself (an object autograd holds outlives Python's references to it)."""
        self._drops.append(weakref.finalize(t, self._on_drop, sid))

    def _on_drop(self, sid: int) -> None:
        sid = self._resized_from.get(sid, sid)
        record = self.storages[sid]
        record.held_op = max(record.held_op, len(self.ops) - 1, record.alloc_op)

    def on_resize(self, storage, before_bytes: int) -> None:
        """NOTE [Resized storages]: FSDP2 frees an all-gathered parameter by resizing its storage to 0 bytes and
        gathers it again into the same storage object, resized back up (DESIGN.md, pitfall 18); the storage object
        lives on, so no finalizer says so. A resize is a free of the storage's record where it happens (the bytes go
        back to the allocator) and, to a size above 0, a new record allocated there, with no producing op (what
        fills it is recorded as a write); the storage's finalizer then frees that one."""
        if self.closed:
            return
        key = storage._cdata
        sid = self._sid.get(key)
        after = storage.nbytes()
        if sid is None or after == before_bytes:
            return  # never seen: an op that meets it registers it with its size then
        first = next((f for f, cur in self._resized_from.items() if cur == sid), sid)
        if sid not in self._resized_away:
            record = self.storages[sid]
            record.free_op = max(len(self.ops) - 1, record.alloc_op)
            self.live_bytes -= record.nbytes
            self._resized_away.add(sid)
        if after > 0:
            new = len(self.storages)
            self.storages.append(StorageRecord(nbytes=allocated_bytes(after, self.cuda), alloc_op=len(self.ops),
                                               free_op=-1))
            self._sid[key] = new
            self._resized_from[first] = new
            self.live_bytes += self.storages[new].nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def register_static(self, tensors) -> None:
        for t in tensors:
            self._register(t, -1, -1, True)

    def lookup(self, t: torch.Tensor) -> int:
        """Storage id of a tensor; a storage never seen before is registered as opaque from now on."""
        t = self._as_fake(t)
        key = storage_key(t)
        if key is None or t.device != self.device:
            return -1
        sid = self._sid.get(key)
        if sid is None:
            sid = self._register(t, max(len(self.ops) - 1, 0), -1, False)
        return sid

    def known_storages(self, tensors) -> list[int]:
        """Storage ids of those of ``tensors`` whose storage an op already made or read (none is registered)."""
        out: list[int] = []
        for t in tensors:
            t = self._as_fake(t)
            key = storage_key(t)
            sid = self._sid.get(key) if key is not None and t.device == self.device else None
            if sid is not None and sid not in out:
                out.append(sid)
        return out

    def close(self) -> None:
        """Stops recording; storages still alive are marked as outliving the step."""
        self.closed = True
        n = len(self.ops)
        for key, sid in _outlived(self._finalizers):
            sid = self._resized_from.get(sid, sid)
            if sid not in self._resized_away:
                self.storages[sid].free_op = n
        for (sid,) in _outlived(self._drops):
            self.storages[self._resized_from.get(sid, sid)].held_op = n
        for (index,) in _outlived(self._releases):
            self.packs[index].released_op = n
        self._sid.clear()
        self._fakes.clear()
        self._resized_from.clear()
        self._resized_away.clear()

    # ---- ops ------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.closed or func in UNCOUNTED:
            return func(*args, **kwargs)
        info = op_info(func)
        index = len(self.ops)
        inputs: list[int] = []
        writes: list[int] = []
        watched: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        for name, value in arg_values(func, args, kwargs):
            for t in tensors_in(value):
                sid = self.lookup(t)
                if sid < 0:
                    continue
                inputs.append(sid)
                if name in info.write_args:
                    writes.append(sid)
                elif storage_key(t) in self.buffer_keys:
                    # NOTE [Undeclared writes]: native_batch_norm updates running stats without its schema saying so.
                    watched.append((name, t, None if self.fake else t.detach().clone(), sid))
        if not self.fake and not watched:
            warm_first_call(func, info, args, kwargs, self.mark_ops)  # NOTE [First calls]
        if self.cuda:  # kernels are asynchronous: time each op to its completion
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        transient = 0
        if self.mark_ops:
            with torch._C._profiler._RecordFunctionFast(MARKER):
                t0 = time.perf_counter_ns()
                out = func(*args, **kwargs)
                t1 = time.perf_counter_ns()
        elif self.fake:
            t0 = time.perf_counter_ns()
            out = self._run_fake(func, info, args, kwargs)
            t1 = time.perf_counter_ns()
            self.calls.append(OpCall(func, args, kwargs, out if self.estimate else None))
        else:
            t0 = time.perf_counter_ns()
            out = func(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize(self.device)
                # NOTE [Allocator truth]: the most the op held above what it holds now
                transient = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            t1 = time.perf_counter_ns()
        undeclared = []
        for name, t, before, sid in watched:
            if self.fake:  # NOTE [Undeclared writes] under fake tensors: no values to compare, so the ops known to
                # update module state their schema does not declare (STATEFUL_OPS: BatchNorm's running statistics)
                changed = name in STATEFUL_OPS.get(info.name, ())
            else:
                changed = not torch.equal(t, before)
            if changed:
                undeclared.append(name)
                writes.append(sid)
        outputs: list[int] = []
        returned: list[int] = []
        n_known = len(self.storages)
        backward = torch._C._current_autograd_node() is not None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                sid = self._register(t, index, index, False)
                if sid >= n_known and sid not in outputs:
                    outputs.append(sid)
                if sid >= 0 and sid not in returned:
                    returned.append(sid)
                if sid >= 0 and not backward:
                    self._watch_drop(t, sid)
        self.ops.append(
            OpRecord(
                name=info.name,
                seconds=(t1 - t0) / 1e9,
                backward=backward,
                module=self.module_stack[-1] if self.module_stack else "",
                inputs=sorted(set(inputs)),
                outputs=outputs,
                writes=sorted(set(writes)),
                undeclared_writes=undeclared,
                random=info.random,
                collective=info.collective or self.hook_depth > 0,
                returned=returned,
                python_value=info.python_value,
                generator=info.random and any(
                    isinstance(v, torch.Generator) for v in list(args) + list(kwargs.values())
                ),
                transient_bytes=max(int(transient), 0),
            )
        )
        return out

    def _run_fake(self, func, info, args, kwargs):
        from torch._subclasses.fake_tensor import DataDependentOutputException, UnsupportedOperatorException

        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, UnsupportedOperatorException, NotImplementedError) as e:
            where = self.module_stack[-1] if self.module_stack else "the step itself"
            raise LibraError(
                f"libra.profile(fake=True): {info.name} in {where!r} cannot run on fake tensors "
                f"({type(e).__name__}: its output depends on values, or it has no fake kernel). Fix: register a "
                "fake kernel for a custom op (torch.library.register_fake), or profile the real step "
                "(fake=False) at a smaller batch."
            ) from None

    # ---- saved tensors --------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if self.closed:
            return (-1, t)
        sid = self.lookup(t)
        if sid < 0:
            return (-1, t)
        call = self.call_stack[-1] if self.call_stack else -1
        self.packs.append(PackRecord(storage=sid, pack_op=len(self.ops), module_call=call,
                                     activation=t.grad_fn is not None))
        alias = t.detach()  # never the object Python holds (NOTE [Python's hold])
        # only autograd's saved variable holds the alias (and a backward formula while it runs): it dies when the node
        # that saved it is released (NOTE [Release after unpack] in planner/regions.py)
        self._releases.append(weakref.finalize(alias, self._on_release, len(self.packs) - 1))
        return (len(self.packs) - 1, alias)

    def _on_release(self, index: int) -> None:
        record = self.packs[index]
        record.released_op = max(len(self.ops) - 1, record.last_unpack, record.pack_op)

    def unpack(self, packed):
        index, t = packed
        if index >= 0 and not self.closed:
            record = self.packs[index]
            at = len(self.ops)
            if record.first_unpack < 0:
                record.first_unpack = at
            record.last_unpack = at
        return t


def _outlived(finalizers: list) -> list[tuple]:
    """The arguments of each finalizer in ``finalizers`` that has not fired (what it watches outlived the step),
    each detached; empties the list."""
    pending = [info[2] for info in (fin.detach() for fin in finalizers) if info is not None]
    finalizers.clear()
    return pending


_RESIZE_WATCHERS: list[Recorder] = []


def _resize_watched(storage, size):
    """``UntypedStorage.resize_`` while a recording runs: resizes, then tells each recorder (NOTE [Resized
    storages]). A storage resize dispatches no op, so a dispatch mode cannot see it."""
    before = storage.nbytes()
    out = torch._C.StorageBase.resize_(storage, size)
    for recorder in list(_RESIZE_WATCHERS):
        recorder.on_resize(storage, before)
    return out


def watch_resizes(recorder: Recorder) -> None:
    """Reports every storage resize to ``recorder`` until :func:`unwatch_resizes`."""
    if not _RESIZE_WATCHERS:
        torch.UntypedStorage.resize_ = _resize_watched
    _RESIZE_WATCHERS.append(recorder)


def unwatch_resizes(recorder: Recorder) -> None:
    if recorder in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(recorder)
        if not _RESIZE_WATCHERS and torch.UntypedStorage.__dict__.get("resize_") is _resize_watched:
            del torch.UntypedStorage.resize_


class _FsdpHookSpan:
    """NOTE [FSDP2's hooks are never replayed]: FSDP2's forward hooks on a module (all-gather, copy out, reshard)
    act on FSDP's state, not on the module's inputs: a replay of a module that contains them would run them in
    another state and dispatch other ops (at world size 1, where no collective is issued, a copy fewer), or issue
    an all-gather again. The ops they dispatch are recorded as collectives (the planner never replays a module
    call with one in its forward) from before FSDP's pre-hooks (registered first) to the module's forward, and
    from the forward's end to after FSDP's post-hooks (registered last)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def pre_hooks_start(self, module, args) -> None:
        self.recorder.hook_depth += 1

    def post_hooks_end(self, module, args, output) -> None:
        self.recorder.hook_depth = max(self.recorder.hook_depth - 1, 0)


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


class _ForwardProbe:
    """Stands in for one module's ``forward`` while profiling and reports its start and end."""

    def __init__(self, probes: "ModuleProbes", fqn: str, forward: Callable) -> None:
        self.probes = probes
        self.fqn = fqn
        self.forward = forward

    def __call__(self, *args, **kwargs):
        hooked = self.fqn in self.probes.fsdp_modules  # NOTE [FSDP2's hooks are never replayed]
        rec = self.probes.recorder
        if hooked:
            rec.hook_depth = max(rec.hook_depth - 1, 0)
        call = self.probes.enter(self.fqn, args, kwargs)
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.probes.exit(self.fqn, call)
            if hooked:
                rec.hook_depth += 1


class ModuleProbes:
    """Wraps every submodule's ``forward`` to record module calls and attribute ops to FQNs."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder) -> None:
        self.model = model
        self.recorder = recorder
        self.calls: list[ModuleCall] = []
        self.root_calls = 0
        self.input_signature: list[str] = []
        self._counts: dict[str, int] = {}
        self._swaps = ForwardSwaps()
        self.fsdp_modules: set[str] = set()
        self._hook_handles: list = []

    def install(self, root: bool = True) -> None:
        """Wraps every module's forward; with ``root=False`` all but the root's, whose current call the caller
        reports through :meth:`enter` and :meth:`exit` itself."""
        fsdp = _fsdp_module_class()
        span = _FsdpHookSpan(self.recorder)
        for fqn, module in self.model.named_modules():
            if fqn or root:
                self._swaps.replace(module, lambda forward, fqn=fqn: _ForwardProbe(self, fqn, forward))
                if fsdp is not None and isinstance(module, fsdp):
                    self.fsdp_modules.add(fqn)
                    self._hook_handles.append(module.register_forward_pre_hook(span.pre_hooks_start, prepend=True))
                    self._hook_handles.append(module.register_forward_hook(span.post_hooks_end, always_call=True))

    def remove(self) -> None:
        self._swaps.restore()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self.fsdp_modules.clear()

    def enter(self, fqn: str, args, kwargs=None) -> ModuleCall | None:
        rec = self.recorder
        rec.module_stack.append(fqn)
        if not torch.is_grad_enabled() or rec.closed:
            return None
        if fqn == "":
            self._counts = {}
            self.root_calls += 1
            if self.root_calls == 1:
                self.input_signature = input_signature(args, kwargs or {})
        call = self._counts.get(fqn, 0)
        self._counts[fqn] = call + 1
        record = ModuleCall(
            module=fqn,
            parent=rec.call_stack[-1] if rec.call_stack else -1,
            call=call,
            root_call=max(self.root_calls - 1, 0),
            start_op=len(rec.ops),
            end_op=-1,
            depth=len(rec.module_stack) - 1,
            input_shapes=[list(a.shape) for a in args if isinstance(a, torch.Tensor)],
            kv_cache_args=kv_cache_args(args, kwargs or {}),
            arg_storages=rec.known_storages(call_tensors(args, kwargs or {})),
        )
        rec.call_stack.append(len(self.calls))
        self.calls.append(record)
        return record

    def exit(self, fqn: str, record: ModuleCall | None) -> None:
        self.recorder.module_stack.pop()
        if record is not None:
            record.end_op = len(self.recorder.ops)
            self.recorder.call_stack.pop()


def static_tensors(model: torch.nn.Module, device: torch.device, exclude=()) -> list[torch.Tensor]:
    """Every tensor live on ``device`` now: what gc can reach, plus parameters, buffers and their gradients (a
    gradient made by autograd has no Python object until it is first read, so gc alone misses it), but the tensors
    of ``exclude`` (a fake step's real parameters, put aside while it runs)."""
    gc.collect()  # garbage in reference cycles would otherwise count as live, then vanish mid-step
    skip = {storage_key(t) for t in plain_tensors(exclude)}
    # the model's own first, in its order, so that they are numbered alike in every profile of it: gc lists
    # objects in an order that follows the process's history
    found: list = []
    for p in model.parameters():
        found.append(p)
        if p.grad is not None:
            found.append(p.grad)
    found.extend(model.buffers())
    found.extend(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    # NOTE [Wrapper subclasses have no storage] in _ops.py: a DTensor's memory is its local tensor's
    found = plain_tensors(found)
    return [t for t in found if t.device == device and storage_key(t) is not None and storage_key(t) not in skip]


class _NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_OVERHEAD: dict[str, float] = {}


def dispatch_overhead_seconds() -> float:
    """Measured cost of routing one small op through a do-nothing Python dispatch mode (cached per process)."""
    if "noop" not in _OVERHEAD:
        x = torch.zeros(8)
        n = 400
        best_plain = best_mode = float("inf")
        for _ in range(3):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                torch.add(x, x)
            t1 = time.perf_counter_ns()
            with _NoopMode():
                for _ in range(n):
                    torch.add(x, x)
            t2 = time.perf_counter_ns()
            best_plain = min(best_plain, t1 - t0)
            best_mode = min(best_mode, t2 - t1)
        _OVERHEAD["noop"] = max(best_mode - best_plain, 0) / n / 1e9
    return _OVERHEAD["noop"]
