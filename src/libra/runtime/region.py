"""The region executor: one module call under non-reentrant ``torch.utils.checkpoint``, with Libra's pair of dispatch
modes as ``context_fn`` deciding per op occurrence what is kept and what is replayed.

NOTE [Region executor contract]
- Forward (``_ForwardMode``): every op runs; outputs of ops the plan saves are kept in the region's cache (detached
  aliases, no autograd history). Before an in-place op writes to a cached storage, the cache takes a private copy
  (copy-on-write), so the cache always holds values as they were produced. NOTE [Leaving the profiled ops]: if the
  op sequence leaves the profiled one (a data-dependent branch), the plan's op indices mean nothing from there on,
  so the rest of the call keeps nothing and is recomputed whole in backward. An op there that gets a module buffer
  may write it without saying so (BatchNorm's running statistics), which the plan's ``protect`` lists only for the
  profiled ops: its replay gets private copies of every buffer it is handed. Keeping every output instead ran over
  the budget by everything the rest of the call makes.
- Replay (``_ReplayMode``): ops run in the recorded order; cached ops return their kept outputs without running (so
  BatchNorm never updates running stats twice when saved), as clones where the forward went on to write them in
  place (the replay writes them again, and a second replay, after ``retain_graph=True``, must find them as they
  were produced); replayed ops that write module state (running stats,
  ``num_batches_tracked``) write to private copies. Replayed random ops see the generator exactly as in forward:
  checkpoint restores the state at region start, and after a cached random op the state it left is restored.
  NOTE [Own generators]: checkpoint saves and restores only the default generators. A random op handed its own
  ``torch.Generator`` gets that generator's state from before its forward run for its replay, and the generator is
  put back as it was right after, so the replay draws the forward's numbers and the user's generator does not move.
- A replay that dispatches another op than the forward did raises instead of returning a wrong value.

NOTE [Dead ops in a replay]
A replay reruns the module's Python forward, so every op is dispatched again, but backward needs only the saved
tensors the plan recomputes and what they are computed from. The planner lists the other ops in
``RegionPlan.skip``. A skipped op does not run: it returns uninitialized tensors with the shapes, strides and dtypes
the forward saw (in-place and ``out=`` ops return the tensor they would have written), so the Python code around it
goes on as before, and only ops that nothing needed reads are left out. Autograd still records and saves around
them as it always does in a replay (autograd sits above this mode), so checkpoint matches saved tensors in the same
order. A skipped random op leaves the generator as the forward left it. Ops whose results Python can read
(``.item()``, non-tensor returns) are never skipped (``planner/replay.py``).

NOTE [Executor bookkeeping]
Every op of a checkpointed call passes through these modes, so what they do per op is the executor's cost (NOTE
[Region overhead] in runtime/calibrate.py), paid again for every op of every step. Work that only some calls need is
done only by those: the storage index copy-on-write reads is built at the forward's first in-place op (from the cache
as it is then, and kept up to date after it), the replay notes the storages it made only when the forward wrote in
place, and a single-tensor output, what most ops return, is kept and checked without walking a tree.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from libra._ops import UNCOUNTED, arg_values, call_tensors, op_info, storage_key, tensors_in
from libra.errors import LibraError
from libra.planner.types import RegionPlan
from libra.runtime.offload import HostCopy, HostPool

__all__ = ["RegionRun", "PlainRun", "HookRun", "OffloadContext"]

log = logging.getLogger("libra")


def _own_generator(kwargs) -> "torch.Generator | None":
    """The torch.Generator a random op was handed (``generator=`` is keyword-only in aten schemas), if any."""
    gen = kwargs.get("generator")
    return gen if isinstance(gen, torch.Generator) else None


def _generator_state(args, kwargs):
    """(generator, state) pairs of the default generators a random op draws from (not called for an op handed its
    own generator: NOTE [Own generators])."""
    devices = {t.device for t in tensors_in(list(args)) + tensors_in(list(kwargs.values()))}
    out = [(None, torch.get_rng_state())]
    for d in devices:
        if d.type == "cuda":
            out.append((d, torch.cuda.get_rng_state(d)))
    return out


def _restore_generators(states) -> None:
    for gen, state in states:
        if isinstance(gen, torch.Generator):
            gen.set_state(state)
        elif gen is None:
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, gen)


def _containers(x):
    """``x`` with every list, tuple and dict in it copied (a tuple subclass, a named tuple, rebuilt as itself), the
    tensors and other values the same objects.

    NOTE [Arguments as they were]: checkpoint's replay calls the function again with the objects the forward was
    handed. A list is one object: a caller that appends to it after the call (DenseNet's dense block hands each layer
    the list of features so far, then appends the layer's output) changes what the replay reads, and the replay
    concatenates one more feature map than the forward did (torchvision's densenet121 under a plan: "running_mean
    should contain 256 elements not 224"; with same-shaped items, a wrong gradient). And checkpoint holds the list
    to the call's backward, with every feature appended since: each layer's frame held all of them where the
    planner counts what the call was handed (ModuleCall.arg_storages), 21% over the budget on a small dense stack.
    So checkpoint is handed a copy of the containers as they are when the call begins (:func:`hand_arguments`),
    the forward runs with the caller's own (it may change them for the caller) and lets go of them, and each
    replay gets a fresh copy of that copy. The tensors in them are the same ones, whose in-place changes the runs
    check."""
    if type(x) is list:
        return [_containers(v) for v in x]
    if type(x) is dict:
        return {k: _containers(v) for k, v in x.items()}
    if isinstance(x, tuple):
        items = [_containers(v) for v in x]
        return tuple(items) if type(x) is tuple else (type(x)(*items) if hasattr(x, "_fields") else type(x)(items))
    return x


class _Arguments:
    """A checkpointed call's arguments as they were when it began, and the caller's own for its forward (NOTE
    [Arguments as they were]), for the runs checkpoint calls once for the forward and once per replay."""

    arguments: tuple = ((), {})
    caller: tuple | None = None

    def arguments_for(self, first: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments the forward (``first``) or a replay runs with, from those checkpoint passes."""
        if not first:
            return _containers(self.arguments)
        if self.caller is None:  # handed to checkpoint as they are: the replays still get them as they were
            self.arguments = _containers((args, kwargs))
            return args, kwargs
        (args, kwargs), self.caller = self.caller, None
        return args, kwargs


def hand_arguments(run: _Arguments, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What checkpoint is handed for ``run``'s call (NOTE [Arguments as they were]): a copy of the call's containers;
    ``run``'s forward gets the caller's own, once."""
    run.caller = (args, kwargs)
    run.arguments = _containers((args, kwargs))
    return run.arguments


def _leaves(out) -> list:
    """The tensors in an op's output. NOTE [Op outputs]: at the dispatch level an aten op returns a tensor, a plain
    tuple or list of tensors (``None`` for undefined ones), or a Python value; pytree's general walk costs several
    microseconds per op, which these few lines avoid (tuple subclasses still take pytree's way)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) is tuple or type(out) is list:
        found = []
        for x in out:
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (tuple, list)):
                found.extend(_leaves(x))
        return found
    if isinstance(out, (tuple, list, dict)):
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return []


def _map_only(cls, fn, out):
    """``tree_map_only(cls, fn, out)`` for op outputs (NOTE [Op outputs])."""
    if isinstance(out, cls):
        return fn(out)
    if type(out) is tuple:
        return tuple(_map_only(cls, fn, x) for x in out)
    if type(out) is list:
        return [_map_only(cls, fn, x) for x in out]
    if isinstance(out, (tuple, list, dict)):
        return tree_map_only(cls, fn, out)
    return out


def _detach(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _versions(out):
    """The version counters of an op's (cached) outputs: an int for a single tensor, else a tuple."""
    if isinstance(out, torch.Tensor):
        return out._version
    return tuple(t._version for t in _leaves(out))


_NO_NAMES: frozenset = frozenset()


class _Internal(threading.local):
    active = 0  # nesting depth of _internal() in this thread


_INTERNAL = _Internal()


@contextlib.contextmanager
def _internal():
    """Ops Libra itself runs inside a region's replay (another region's prefetch): not part of the op sequence."""
    _INTERNAL.active += 1
    try:
        yield
    finally:
        _INTERNAL.active -= 1


class OffloadContext:
    """What the calls of one ``apply`` share for offloading: the host pool, the copy stream, and which call's
    backward start brings which calls' copies back (NOTE [Prefetch] in planner/simulate.py)."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.pool = HostPool(pin=cuda)
        self.stream = torch.cuda.Stream(device) if cuda else None
        # (module, call) -> weak references to this root call's runs by (module, call)
        self.runs: dict[tuple[str, int], weakref.ref] = {}
        # (module, call) whose backward start triggers -> the planned calls whose copies it brings back
        self.after: dict[tuple[str, int], list[tuple[str, int]]] = {}
        # (storage, dtype) -> its host copy while the storage lives: hooked calls share one copy of a storage they
        # all save (NOTE [Shared hooked storages] in planner/simulate.py)
        self.copies: "weakref.WeakValueDictionary[tuple, HostCopy]" = weakref.WeakValueDictionary()

    def follow(self, regions: list[RegionPlan]) -> None:
        """Takes the prefetch triggers of a plan's regions (``RegionPlan.prefetch_after``)."""
        self.after = {}
        for r in regions:
            if r.prefetch_after:
                self.after.setdefault((r.prefetch_after[0], r.prefetch_after[1]), []).append((r.module, r.call))

    def new_step(self) -> None:
        self.runs = {}
        self.copies = weakref.WeakValueDictionary()

    def register(self, run, key: "tuple[str, int] | None"):
        """Records ``run`` as this root call's call ``key`` (None: a call the plan does not name) and returns what
        it calls when its backward starts (its first unpack or its replay): the prefetch of the calls it triggers,
        among the runs of the same root call."""
        runs = self.runs
        if key is not None:
            runs[key] = weakref.ref(run)
        targets = self.after.get(key, ())

        def backward_started() -> None:
            for target in targets:
                ref = runs.get(target)
                later = ref() if ref is not None else None
                if later is not None:
                    with _internal():
                        later.prefetch()

        return backward_started


class TriggerRun:
    """An unplanned call whose backward start brings a planned call's copies back (NOTE [Prefetch] in
    planner/simulate.py): the module's forward under saved-tensor hooks that save every tensor as it is and only
    notice the first unpack. They change no value and no lifetime; since autograd does not check versions under
    hooks, an unpack checks them as eager would (NOTE [Version checks])."""

    def __init__(self, module: str, forward) -> None:
        self.module = module
        self.forward = forward
        self.on_backward = None
        self.started = False

    def run(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(_Held, self.unpack):
            return self.forward(*args, **kwargs)

    def unpack(self, held: "_Held") -> torch.Tensor:
        if not self.started:
            self.started = True
            if self.on_backward is not None:
                self.on_backward()
        if held.t._version != held.version:
            raise _changed_after_saving(self.module)
        return held.t

    def prefetch(self) -> None:
        """Nothing to bring back: it offloads nothing."""


class PlainRun(_Arguments):
    """One call of a plain region (NOTE [Plain regions] in planner/simulate.py): the function plain checkpoint runs,
    once for the forward and once per replay. Its replay starts its backward, which may bring a later call's
    offloaded outputs back (NOTE [Prefetch]), as the simulator assumes.

    NOTE [Guarded replay]: a call that writes module state (BatchNorm's running statistics) would write it a second
    time in a plain replay. Such a call's replay runs under one light dispatch mode (``contexts``; the forward runs
    under none, so it costs what plain checkpoint costs) that hands those ops private copies of what they write: the
    ops the plan's ``protect`` names while the replay follows the profiled ops (``region``), and every module buffer
    an op gets from the first op that does not (the call left the profiled sequence: NOTE [Leaving the profiled
    ops]) or where there is no plan for the call (``region`` None). ``guarded`` says whether it needs one."""

    def __init__(self, forward, region: "RegionPlan | None" = None, buffer_keys: "set[int] | None" = None) -> None:
        self.forward = forward
        self.on_backward = None
        self.calls = 0
        self.buffer_keys = buffer_keys or set()
        self.protect = region.protect if region is not None else {}
        self.ops = region.ops if region is not None else []
        self.guarded = bool(self.protect) if region is not None else bool(self.buffer_keys)
        # the replay's op count, and whether it still follows the profiled ops: set as each replay starts (run)
        self.index = 0
        self.following = False

    def contexts(self):
        return contextlib.nullcontext(), _GuardMode(self)

    def run(self, *args, **kwargs):
        self.calls += 1
        args, kwargs = self.arguments_for(self.calls == 1, args, kwargs)
        if self.calls > 1:
            self.index = 0
            self.following = bool(self.ops)
            if self.on_backward is not None:
                self.on_backward()
        return self.forward(*args, **kwargs)

    def prefetch(self) -> None:
        """Nothing to bring back: a plain call keeps nothing."""


class _Packed:
    """What a hooked call's pack hook returns for an offloaded tensor: the host copy of its storage (shared by the
    tensors saved from that storage) and how to view it again."""

    __slots__ = ("copy", "size", "stride", "offset", "source", "version")

    def __init__(self, copy: HostCopy, t: torch.Tensor) -> None:
        self.copy = copy
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.source = weakref.ref(t)  # NOTE [Version checks]: held weakly, so the device copy can go
        self.version = t._version


class _Held:
    """What a hooked call's pack hook returns for a tensor it leaves on the device (an input, a parameter, what the
    call returns): the tensor and its version when saved (NOTE [Version checks]). It holds a detached alias (same
    storage, same version counter): the tensor itself, saved by the node that made it, would make a cycle through
    that node that Python's collector cannot see, and a graph dropped without a backward would never be freed."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t.detach(), t._version


def _changed_after_saving(module: str) -> LibraError:
    return LibraError(
        f"libra.apply: a tensor {module!r} saved for backward was changed in place after it was saved, so the "
        "saved value is out of date (eager PyTorch raises here too). Fix: use an out-of-place op, or plan without "
        "offloading (decisions={'keep', 'recompute'})."
    )


class HookRun:
    """One call of a hooked region (NOTE [Hooked regions] in planner/simulate.py): the module's forward under
    saved-tensor hooks that copy every tensor autograd saves, except ``keep`` (parameters and buffers, by storage),
    what the call returns (the plan's ``stay``) and its inputs (unless the plan's ``offload_inputs``), to a host
    buffer of the offload context's pool, one copy per storage (shared with other hooked calls that save it), and
    bring it back at its first unpack, or earlier: when the plan's trigger call starts its backward (NOTE
    [Prefetch]). Nothing is recomputed, so neither random numbers nor BatchNorm statistics are touched again.

    NOTE [Version checks]: under saved-tensor hooks autograd does not check versions, so an unpack compares the
    saved tensor's version counter with the one it had when packed, while it is still alive, and raises instead of
    returning the value from before an in-place change (eager would raise too). A tensor changed in place and then
    let go cannot be checked (holding it would keep the memory offloading frees): its copy holds the value it had
    when saved, the value the backward formula was written for, where eager would raise. A step that runs the
    profiled ops never does this: eager ran the profiled step to its end, so it wrote no saved tensor after saving.
    """

    def __init__(self, region: RegionPlan, forward, offload: "OffloadContext", keep: set[int],
                 device: torch.device) -> None:
        self.region = region
        self.forward = forward
        self.offload_ctx = offload
        self.keep = keep
        self.device = device
        self.copies: list[weakref.ref] = []  # every copy this call's saves use, for the prefetch
        self.inputs: set[int] = set()
        self.started = False
        self.stay = set(region.stay)
        self.ordinal = 0  # saves of the call's own tensors so far (RegionPlan.stay)
        self.on_backward = None  # OffloadContext.register's: called at the first unpack (NOTE [Prefetch])

    def run(self, *args, **kwargs):
        self.inputs = {storage_key(t) for t in call_tensors(args, kwargs)}
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return self.forward(*args, **kwargs)

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        # a leaf that requires grad is a parameter, whether the module registers it or not (FSDP2's all-gathered
        # ones are not its parameters when the step began): kept, as the simulator assumes (no autograd history,
        # PackRecord.activation)
        if key is None or key in self.keep or t.device != self.device or (t.requires_grad and t.grad_fn is None):
            return _Held(t)
        if key in self.inputs:
            # only activations (made by this step's graph): a batch of data, live before the step, stays put
            if not self.region.offload_inputs or t.grad_fn is None:
                return _Held(t)
        else:
            self.ordinal += 1
            if self.ordinal - 1 in self.stay:  # what the call returns: saved as it is, never copied
                return _Held(t)
        ctx = self.offload_ctx
        with _internal():
            whole = (key, t.dtype)
            copy = ctx.copies.get(whole)
            # a storage changed in place since its copy was made needs a new copy: the old one keeps the value
            # the earlier saves were made with (NOTE [Version checks])
            if copy is None or copy.version != t._version:
                flat = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
                copy = HostCopy(flat, ctx.pool, ctx.stream)
                # the host buffer goes back to the pool once autograd has let go of every tensor saved from it
                # (copies on the side stream stay ordered after any copy back still reading it)
                weakref.finalize(copy, ctx.pool.release, copy.buffer)
                ctx.copies[whole] = copy
                # a storage's key is its address, which a storage made after this one dies can take: forget the
                # copy when the storage goes (the point of offloading it), so a newcomer is never matched to it
                weakref.finalize(t.untyped_storage(), ctx.copies.pop, whole, None)
            if not any(ref() is copy for ref in self.copies):
                self.copies.append(weakref.ref(copy))  # one made by an earlier call too: it comes back for this one
            return _Packed(copy, t)

    def unpack(self, packed):
        if not self.started:
            self.started = True
            if self.on_backward is not None:
                self.on_backward()
        held = isinstance(packed, _Held)
        t = packed.t if held else packed.source()  # a copy's source: alive while the caller holds it
        if t is not None and t._version != packed.version:
            raise _changed_after_saving(self.region.module)
        if held:
            return t
        with _internal():
            flat = packed.copy.get(self.offload_ctx.stream)
            return torch.as_strided(flat, packed.size, packed.stride, packed.offset)

    def prefetch(self) -> None:
        """Starts bringing the copies this call's saves use back to the device."""
        for ref in self.copies:
            copy = ref()
            if copy is not None:
                copy.prefetch(self.offload_ctx.stream)


class RegionRun(_Arguments):
    """State of one checkpointed call of one module: the cache shared by its forward and its replays."""

    def __init__(self, region: RegionPlan, forward, offload: "OffloadContext | None" = None, note=None,
                 buffer_keys: "set[int] | None" = None) -> None:
        self.region = region
        self.buffer_keys = buffer_keys or set()  # storages of the model's buffers (NOTE [Leaving the profiled ops])
        self.note = note  # note(key, message, *args): logs once per key (the apply session's), else every time
        self.debug = debug_enabled()
        self.forward = forward
        self.save = set(region.save)
        self.skip = set(region.skip)
        self.skipped_meta: dict[int, object] = {}  # local op index -> output (shape, stride, dtype, device) tree
        self.offload = set(region.offload) if offload is not None else set()
        self.offload_ctx = offload
        self.funcs: list[object] = []  # ops the forward dispatched, in order
        self.cache: dict[int, object] = {}  # local op index -> outputs (detached)
        self.versions: dict[int, object] = {}  # local op index -> version counters of the cached outputs (_versions)
        # NOTE [Executor bookkeeping]: storage -> cached op indices, for copy-on-write; built at the forward's first
        # in-place op and kept up to date from there (a call that writes nothing in place never computes a key)
        self.cached_by_storage: dict[int, list[int]] = {}
        self.indexing = False
        self.writes = False  # the forward ran an op that writes in place: the replay notes which storages it made
        self.written: set[int] = set()  # cached ops whose outputs the forward then wrote in place (copy-on-write)
        self.rng_after: dict[int, list] = {}
        self.gen_before: dict[int, tuple] = {}  # NOTE [Own generators]: op -> (its generator, state before it)
        self.following = True  # the forward still matches the profiled op sequence
        self.diverged_at = len(region.ops)
        self.replay_storages: set[int] = set()  # storages the current replay made or got from the cache
        self.replay_index = 0
        self.calls = 0
        self.input_versions: list[tuple[torch.Tensor, int]] = []
        self.on_backward = None  # OffloadContext.register's: called when the replay starts (NOTE [Prefetch])

    def contexts(self):
        return _ForwardMode(self), _ReplayMode(self)

    def run(self, *args, **kwargs):
        """The function checkpoint calls: once for the forward, once per replay."""
        self.calls += 1
        args, kwargs = self.arguments_for(self.calls == 1, args, kwargs)
        if self.calls == 1:
            self.input_versions = [(t, t._version) for t in call_tensors(args, kwargs)]
        else:
            self.replay_index = 0
            self.replay_storages = set()
            if self.on_backward is not None:
                self.on_backward()
            for i, (t, version) in enumerate(self.input_versions):
                if t._version != version:
                    raise LibraError(
                        f"libra.apply: input {i} of {self.region.module!r} was changed in place after its forward "
                        "ran, so recomputing it would give wrong gradients. Fix: avoid the in-place change (use an "
                        "out-of-place op), or plan without this module."
                    )
        out = self.forward(*args, **kwargs)
        if self.calls == 1 and self.following and len(self.funcs) != len(self.region.ops):
            self.diverged(len(self.funcs), "no further op")
        return out

    def prefetch(self) -> None:
        """Starts bringing this call's offloaded outputs back to the device."""
        stream = self.offload_ctx.stream if self.offload_ctx is not None else None
        for out in self.cache.values():
            _map_only(HostCopy, lambda h: h.prefetch(stream), out)

    # ---- forward ------------------------------------------------------------------------------------------
    def keep(self, index: int, out) -> None:
        if index in self.offload and self.following:
            ctx = self.offload_ctx
            self.cache[index] = _map_only(torch.Tensor, lambda t: HostCopy(t, ctx.pool, ctx.stream), out)
            return

        self.cache[index] = out.detach() if isinstance(out, torch.Tensor) else _map_only(torch.Tensor, _detach, out)
        self.versions[index] = _versions(self.cache[index])
        if self.indexing:
            self._index(index)

    def _index(self, index: int) -> None:
        for t in _leaves(self.cache[index]):
            key = storage_key(t)
            if key is not None:
                self.cached_by_storage.setdefault(key, []).append(index)

    def check_versions(self, index: int) -> None:
        """A cached alias changed in place outside the region (where copy-on-write cannot see it) would replay
        the changed value: refuse loudly rather than return a wrong gradient."""
        now = _versions(self.cache[index])
        if now != self.versions.get(index, now):
            raise LibraError(
                f"libra.apply: an output of op {index} ({self.region.ops[index] if index < len(self.region.ops) else '?'}) "
                f"of {self.region.module!r} was changed in place after the module returned, so replaying the module "
                "would give wrong gradients. Fix: re-profile and re-plan (the planner then recomputes that output), "
                "or use an out-of-place op."
            )

    def copy_on_write(self, func, args, kwargs) -> None:
        if not self.indexing:  # NOTE [Executor bookkeeping]
            self.indexing = True
            for index in self.cache:
                if index not in self.offload:  # a host copy is not written by a write to its source
                    self._index(index)
        info = op_info(func)
        for name, value in arg_values(func, args, kwargs):
            if name not in info.write_args:
                continue
            for t in tensors_in(value):
                key = storage_key(t)
                for index in self.cached_by_storage.pop(key, ()):
                    self.written.add(index)
                    self.cache[index] = _map_only(
                        torch.Tensor, lambda c: c.clone() if storage_key(c) == key else c, self.cache[index]
                    )
                    self.versions[index] = _versions(self.cache[index])

    def diverged(self, index: int, name: str) -> None:
        self.following = False
        self.diverged_at = index
        expected = self.region.ops[index] if index < len(self.region.ops) else "the end of the module"
        message = ("libra: %r ran %s as op %d where the profile had %s; this call recomputes the rest of its ops "
                   "in backward (correct, more time). Re-profile if the model changed; control flow that depends on "
                   "the data makes this happen on every step that takes another path.")
        args = (self.region.module, name, index, expected)
        if self.note is not None:
            self.note(("diverged", self.region.module, self.region.call, index, name), message, *args)
        else:
            log.warning(message, *args)


def debug_enabled() -> bool:
    """``LIBRA_DEBUG=1``: the region modes log every op they see, at DEBUG level."""
    return os.environ.get("LIBRA_DEBUG") == "1"


class _RegionMode(TorchDispatchMode):
    """One of the pair of modes of a region call; ops Libra does not count pass straight through (each mode's
    ``__torch_dispatch__`` checks that first, in its own body: a call more per op is measurable, NOTE [Executor
    bookkeeping])."""

    def __init__(self, run: RegionRun) -> None:
        super().__init__()
        self.r = run

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """NOTE [Region modes and Dynamo]: torch (2.13 here) wraps a dispatch mode's ``__torch_dispatch__`` in
        ``torch._disable_dynamo`` unless this returns False. The wrapper is Python that runs around every op the mode
        sees (each region op, and the ``detach`` checkpoint's replay dispatches for each saved tensor): measured
        1.5 us per dispatch on a 2-core CPU, about a seventh of what the executor adds to a step
        (``bench/executor_cost.py``). It only matters while a ``torch.compile`` frame is being evaluated around the
        region, which Libra does not support (eager only); without it a region's modes run as every mode did before
        torch added the wrapper."""
        return False


class _ForwardMode(_RegionMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UNCOUNTED or _INTERNAL.active:
            return func(*args, **kwargs)
        r = self.r
        index = len(r.funcs)
        r.funcs.append(func)
        info = op_info(func)
        if info.write_args:
            r.writes = True
            if r.cache:
                r.copy_on_write(func, args, kwargs)
        own = _own_generator(kwargs) if info.random else None
        if own is not None:
            r.gen_before[index] = (own, own.get_state())
        out = func(*args, **kwargs)
        if r.following and (index >= len(r.region.ops) or r.region.ops[index] != info.name):
            r.diverged(index, info.name)
        kept = r.following and index in r.save
        if kept:
            r.keep(index, out)
            if info.random and own is None:
                r.rng_after[index] = _generator_state(args, kwargs)
        elif r.following and index in r.skip:
            r.skipped_meta[index] = (_Shape(out) if isinstance(out, torch.Tensor)
                                     else _map_only(torch.Tensor, _Shape, out))
            if info.random and own is None:
                r.rng_after[index] = _generator_state(args, kwargs)
        if r.debug:
            log.debug("libra: %s[%d] forward op %d %s: %s", r.region.module, r.region.call, index, info.name,
                      ("offloaded" if index in r.offload and r.following else "saved") if kept else "recomputed later")
        return out


class _ReplayMode(_RegionMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UNCOUNTED or _INTERNAL.active:
            return func(*args, **kwargs)
        r = self.r
        index = r.replay_index
        r.replay_index += 1
        if index >= len(r.funcs) or r.funcs[index] is not func:
            seen = r.funcs[index] if index < len(r.funcs) else "nothing"
            raise LibraError(
                f"libra.apply: recomputing {r.region.module!r} dispatched {func} as op {index} where its forward ran "
                f"{seen}; the module's forward is not deterministic given its inputs. Fix: plan without this module "
                "or make its control flow depend only on its inputs."
            )
        cached = r.cache.get(index)
        skipped = r.following and index in r.skipped_meta  # after a divergence everything not kept reruns
        if cached is not None:
            r.check_versions(index)
            if index in r.rng_after:
                _restore_generators(r.rng_after[index])
            if r.offload:
                cached = _on_device(r, cached)
            out = cached.detach() if isinstance(cached, torch.Tensor) else _map_only(torch.Tensor, _detach, cached)
            if index in r.written:  # the replay writes it again: never into the cache (a later replay reads it)
                out = _map_only(torch.Tensor, torch.Tensor.clone, out)
        elif skipped:  # NOTE [Dead ops in a replay]
            if index in r.rng_after:
                _restore_generators(r.rng_after[index])
            out = _placeholder(func, args, kwargs, r.skipped_meta[index])
        else:
            if index < r.diverged_at:
                protect = r.region.protect.get(index)
                names = set(protect) if protect else _NO_NAMES
            else:  # NOTE [Leaving the profiled ops]
                names = _buffer_args(r.buffer_keys, func, args, kwargs)
            info = op_info(func)
            if info.write_args:
                names = set(names)
                for name, value in arg_values(func, args, kwargs):
                    if name in info.write_args and any(
                        storage_key(t) not in r.replay_storages for t in tensors_in(value)
                    ):
                        names.add(name)
            if names:
                args, kwargs = _private_copies(func, args, kwargs, names)
            own = r.gen_before.get(index)
            if own is None:
                out = func(*args, **kwargs)
            else:  # NOTE [Own generators]
                gen, before = own
                now = gen.get_state()
                gen.set_state(before)
                try:
                    out = func(*args, **kwargs)
                finally:
                    gen.set_state(now)
        if r.debug:
            log.debug("libra: %s[%d] replay op %d %s: %s", r.region.module, r.region.call, index, func,
                      "from the cache" if cached is not None else "skipped" if skipped else "recomputed")
        if r.writes:  # NOTE [Executor bookkeeping]
            for t in _leaves(out):
                r.replay_storages.add(storage_key(t))
        return out


class _GuardMode(_RegionMode):
    """A guarded plain call's replay (NOTE [Guarded replay])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UNCOUNTED or _INTERNAL.active:
            return func(*args, **kwargs)
        r = self.r
        index = r.index
        r.index += 1
        if r.following and (index >= len(r.ops) or r.ops[index] != op_info(func).name):
            r.following = False
        names = r.protect.get(index) if r.following else _buffer_args(r.buffer_keys, func, args, kwargs)
        if names:
            args, kwargs = _private_copies(func, args, kwargs, names)
        return func(*args, **kwargs)


def _buffer_args(buffer_keys: set[int], func, args, kwargs) -> set[str]:
    """The arguments of an op that are module buffers (NOTE [Leaving the profiled ops])."""
    if not buffer_keys:
        return _NO_NAMES
    return {name for name, value in arg_values(func, args, kwargs)
            if any(storage_key(t) in buffer_keys for t in tensors_in(value))}


def _on_device(r: RegionRun, cached):
    """The cached outputs with offloaded ones brought back (their host buffers go back to the pool)."""

    def back(h: HostCopy) -> torch.Tensor:
        with _internal():
            t = h.get(r.offload_ctx.stream)
            h.close()
        return t

    return _map_only(HostCopy, back, cached)


class _Shape:
    """Shape, strides, dtype and device of one output of a skipped op (a leaf for pytree, unlike a tuple)."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.dtype, self.device = tuple(t.shape), tuple(t.stride()), t.dtype, t.device

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


def _placeholder(func, args, kwargs, meta):
    """What a skipped op returns: the tensor an in-place or ``out=`` op writes, else uninitialized tensors shaped
    like the forward's outputs."""
    info = op_info(func)
    if info.write_args:
        for name, value in arg_values(func, args, kwargs):
            if name == info.write_args[0]:
                return value
    return meta.empty() if isinstance(meta, _Shape) else _map_only(_Shape, _Shape.empty, meta)


def _private_copies(func, args, kwargs, names):
    """Replaces the named arguments by clones, so a replayed op's write to module state goes nowhere."""
    args = list(args)
    kwargs = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if arg.name not in names:
            continue
        if i < len(args) and isinstance(args[i], torch.Tensor):
            args[i] = args[i].clone()
        elif isinstance(kwargs.get(arg.name), torch.Tensor):
            kwargs[arg.name] = kwargs[arg.name].clone()
    return tuple(args), kwargs
