"""Which module calls can be checkpointed, and what recomputing each op inside them would free and cost.

Pure Python over a :class:`~libra.profiler.types.Profile`; no torch.

NOTE [Region model]: the region executor runs one module call under non-reentrant ``torch.utils.checkpoint``. In the
forward, autograd then holds nothing from inside the region: a storage made there lives only while the region's own
ops use it, unless its op is *saved* (kept in Libra's cache). At the first backward unpack of anything saved inside
the region (``t_r``), the region's forward is replayed up to its last save; replayed storages that autograd saves
live from ``t_r`` to their eager free; cached ones and the region's inputs live until the checkpoint frame dies
(``l_r``), with the last save made under it (NOTE [Release after unpack]). A storage that escapes the region and is
still held when backward begins (saved outside it, or alive into backward) is always cached, so that the replay
never makes a second copy of it, unless the region later changes it in place: then caching it would need a private
copy alive from forward to backward, and replaying it costs a second copy only during the region's backward. One
that escapes only into the rest of the forward (a block's output that the next op reads and nothing saves) is not
cached: caching it would hold it to the region's backward, where eager frees it as soon as the forward is done with
it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from libra.profiler.types import Profile

__all__ = ["GRANULARITIES", "RegionInstance", "Unit", "analyse", "unprofiled_siblings", "unprofiled_reserve"]


@dataclass
class RegionInstance:
    call_index: int  # index into profile.module_calls
    start: int
    end: int
    t_r: int  # first unpack of a tensor saved inside (op index), -1 if never
    l_r: int  # when the checkpoint frame dies: the release of the last save made inside (NOTE [Release after unpack])
    stop: int  # replay runs ops [start, stop)
    # storages produced inside, as parallel lists
    sids: list[int] = field(default_factory=list)
    producer: list[int] = field(default_factory=list)  # local op index
    packed: list[bool] = field(default_factory=list)
    fwd_end: list[int] = field(default_factory=list)  # last forward use inside the region
    mutated_at: list[int] = field(default_factory=list)  # first later write inside the region, -1 if none
    escapes: list[bool] = field(default_factory=list)  # used or saved outside the region
    bwd_end: list[int] = field(default_factory=list)  # last unpack of what the region saved of it, -1 if none
    external_inputs: list[int] = field(default_factory=list)  # non-static storages from before the region
    packs: list[int] = field(default_factory=list)  # indices into profile.packs of what autograd saved inside


@dataclass
class Unit:
    """All calls of one (module, call index) across root calls: they share one decision."""

    module: str
    call: int
    instances: list[RegionInstance]
    op_names: list[str]
    op_seconds: list[float]  # per local op, summed over instances
    fresh: list[bool]  # local op allocates a storage
    forced_save: set[int]  # local ops whose outputs escape: always cached
    candidates: list[int]  # local ops whose outputs autograd saves only inside: may be recomputed
    candidate_bytes: dict[int, int]
    offloadable: set[int]  # candidates all of whose outputs may leave the device (none escapes or changes later)
    protect: dict[int, list[str]]
    input_shapes: list[list[int]]
    plain_ok: bool = True  # may run under plain checkpoint (NOTE [Plain regions] in simulate.py)


# NOTE [Held outside until the replay]: an output of a region that something after it holds into backward (the next
# module's save of it, a U-Net's skip) is cached by the region, so that its replay does not make a second copy while
# the first is held. Where every holder outside the region lets go before the region replays (the head's
# convolution saves a U-Net decoder's output, and its backward runs first), there is no second copy to avoid: the
# output is a candidate like any other, and recomputing it frees it when the head is done with it instead of when
# the region's frame dies. The holders: saves made outside the region (until autograd releases them, else the
# storage's eager free) and Python's own hold (``StorageRecord.held_op``, else the eager free).
def _held_outside_until(profile: Profile, s: int, packs: list[int], inside: set[int]) -> int:
    """The last op at which something outside a region holds storage ``s`` (NOTE [Held outside until the replay])."""
    rec = profile.storages[s]
    ends = [rec.held_op if rec.held_op >= 0 else rec.free_op]
    for pi in packs:
        if pi not in inside:
            p = profile.packs[pi]
            ends.append(p.released_op if p.released_op >= 0 else max(p.last_unpack, rec.free_op))
    return max(ends)


def innermost_calls(profile: Profile) -> list[int]:
    """For each op, the index of the innermost module call it ran in (-1: none)."""
    calls = profile.module_calls
    n = len(profile.ops)
    owner = [-1] * n
    for ci in sorted(range(len(calls)), key=lambda i: calls[i].depth):
        a, b = calls[ci].start_op, min(calls[ci].end_op, n)
        owner[a:b] = [ci] * max(b - a, 0)
    return owner


def _children(profile: Profile) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, c in enumerate(profile.module_calls):
        kids.setdefault(c.parent, []).append(i)
    return kids


GRANULARITIES = ("fine", "blocks")

# NOTE [Many candidates]: a call that runs a Python loop over time steps (an RNN cell, RWKV's or a state-space
# model's reference scan) saves a few small tensors per step: RWKV's attention call, 3753 ops, has 1421 candidates.
# The planner measures each candidate's eviction and each option of a unit alone, each in time linear in the unit's
# size, so such a unit took 40 s for the moves and 300 s for the options of a 2-layer model. A unit keeps as
# candidates only its MAX_CANDIDATES largest; the others are recomputed whenever the unit is checkpointed, which is
# what matters for such a unit (recompute the loop or keep it whole), at a plan cost like any other unit's.
MAX_CANDIDATES = 64


def _select_calls(profile: Profile, fwd_ops: int, granularity: str = "fine") -> list[int]:
    """Disjoint module calls to use as regions: the root's children, each split into its children while it is a
    container of blocks.

    NOTE [Region granularity]: a region's replay brings all of its saved activations back at once, so finer regions
    make a lower replay peak; but every region boundary holds the region's inputs and the outputs that escape it
    from forward to backward, and ops between regions are not recomputed at all. Which wins depends on the model
    and the budget: an MLP-Mixer block split into its LayerNorms and MLPs holds six activations per block instead
    of one; a ResNet stage kept whole replays six bottlenecks at once. So two selections are planned and, per
    budget, the faster plan wins (``Planning``):

    - ``"fine"``: a call is split when its children are blocks (at least two children of 8 ops or more covering 80%
      of its ops, like a Sequential stage of bottlenecks, or four or more covering 90%, like SSDlite's run of a
      dozen small inverted residuals: whole, its replay brought them all back at once), or when one child wraps
      nearly all of it; a transformer block (one big attention child, small layers around it, residual adds of its
      own) stays whole;
    - ``"blocks"``: a call is split only when it is larger than a quarter of the forward (a stage, a ModuleList
      run, a wrapper of the whole model), so blocks stay whole, as per-block checkpointing wraps them.

    In both, a call larger than a quarter of the forward stays whole where its own ops, not its children's, make
    most of the saved bytes made inside it: a state-space model's scan, a Python loop over time steps around a few
    linear layers (split, what its loop saves would be in no region, and the planner could lower nothing of it). A
    call whose forward runs a collective is split whenever it has children.
    """
    calls = profile.module_calls
    kids = _children(profile)
    chosen: list[int] = []
    # call -> bytes of the saved activations its own ops make (not its children's): what it alone could recompute
    innermost = innermost_calls(profile)
    own_bytes: dict[int, int] = {}
    for sid in {p.storage for p in profile.packs}:
        rec = profile.storages[sid]
        if not rec.static and 0 <= rec.producer < fwd_ops and innermost[rec.producer] >= 0:
            owner = innermost[rec.producer]
            own_bytes[owner] = own_bytes.get(owner, 0) + rec.nbytes

    def saved_bytes(i: int) -> int:
        return own_bytes.get(i, 0) + sum(saved_bytes(k) for k in kids.get(i, []))

    def size(i: int) -> int:
        return calls[i].end_op - calls[i].start_op

    def container(i: int) -> bool:
        children = kids.get(i, [])
        if not children:
            return False
        total = size(i)
        if total > max(fwd_ops / 4.0, 48.0):
            return 2 * own_bytes.get(i, 0) <= saved_bytes(i)
        if granularity == "blocks":
            return False
        if len(children) == 1:
            return size(children[0]) >= 0.9 * total
        covered = sum(size(k) for k in children)
        big = [k for k in children if size(k) >= max(8, total / 8)]
        if len(big) >= 2 and covered >= 0.8 * total:
            return True
        # a run of many small blocks (a Sequential of a dozen inverted residuals) covering nearly all of it
        return sum(1 for k in children if size(k) >= 8) >= 4 and covered >= 0.9 * total

    def collective(i: int) -> bool:
        # NOTE [Collectives split a call]: a call whose forward runs a collective (an FSDP2-sharded submodule's
        # all-gather, a synced statistic) is never replayed; its children may still be, so it is split.
        return any(o.collective for o in profile.ops[calls[i].start_op:min(calls[i].end_op, fwd_ops)])

    def visit(i: int) -> None:
        if container(i) or (kids.get(i) and collective(i)):
            for k in kids[i]:
                visit(k)
        elif size(i) > 0:
            chosen.append(i)

    for i, c in enumerate(calls):
        if c.parent == -1:
            for k in kids.get(i, []):
                visit(k)
    return chosen


def _apply_end(ops: list, sid: int, free_op: int) -> int:
    """The last op of the backward node whose release freed a storage at ``free_op`` in eager, less the engine's
    reductions of broadcast gradients after the node's formula.

    NOTE [Release after unpack] continued: eager's saved variable holds the tensor until the engine releases the
    node's variables, after it has checked the node's outputs and summed each broadcast gradient to its input's
    shape (``sum.dim_IntList``, then a ``view`` of it when dimensions go). A tensor returned by a saved-tensor hook
    is held only by the formula's local variable, which dies when the formula returns, before those sums: a
    Linear's replayed input is gone when its bias gradient is reduced (the GPT minimum was over-counted by that
    1 KiB gradient). A formula that ends with its own reduction would be cut short by the same rule, by at most
    the bytes those reductions allocate.
    """
    end = free_op
    if end >= len(ops):  # outlived the step
        return end
    while end > 0 and sid not in ops[end].inputs and sid not in ops[end - 1].inputs:
        op = ops[end]
        if (op.name == "aten.view.default" and ops[end - 1].name == "aten.sum.dim_IntList"
                and op.inputs == ops[end - 1].outputs and ops[end - 1].backward):
            end -= 2
        elif op.name == "aten.sum.dim_IntList" and op.backward:
            end -= 1
        else:
            return end
    return end


def _forward_writes(profile: Profile) -> tuple[int, dict[int, list[int]]]:
    """The first backward op, and storage -> the ops outside backward that write it in place."""
    writes_at: dict[int, list[int]] = {}
    for i, o in enumerate(profile.ops):
        if not o.backward:
            for s in o.writes:
                writes_at.setdefault(s, []).append(i)
    return profile.first_backward_op, writes_at


def _refusals(profile: Profile, c, first_bwd: int, writes_at: dict[int, list[int]]):
    """Why module call ``c`` cannot be replayed exactly (none: it can), its ops that write module state (local op ->
    what they write: BatchNorm's running statistics, which a replay under plain checkpoint would write twice), the
    storages its ops make, and the non-static ones they read that were made before it."""
    ops, storages = profile.ops, profile.storages
    a, b = c.start_op, c.end_op
    reasons: list[str] = []
    if c.kv_cache_args:  # NOTE [Key/value caches are not replayable] in _ops.py
        reasons.append(f"it is passed a key/value cache ({', '.join(c.kv_cache_args)}) that its forward "
                       "appends to, and a replay would append again; pass use_cache=False when training")
    produced = [s for i in range(a, b) for s in ops[i].outputs]
    produced_set = set(produced)
    external = sorted({s for i in range(a, b) for s in ops[i].inputs} - produced_set)
    protect: dict[int, list[str]] = {}
    for i in range(a, b):
        o = ops[i]
        if o.collective:
            reasons.append(f"{o.name} is a collective and is never replayed")
        elif o.backward:
            reasons.append("a backward pass runs inside its forward")
        for s in o.writes:
            if s in produced_set:
                continue
            if storages[s].static:
                names = list(o.undeclared_writes) or ["self"]
                protect[i - a] = sorted(set(protect.get(i - a, [])) | set(names))
            else:
                reasons.append(f"{o.name} writes in place to a tensor made before the module ran")
    for s in external:
        if not storages[s].static and any(b <= w < first_bwd for w in writes_at.get(s, [])):
            reasons.append("one of its inputs is changed in place later in the forward")
    return reasons, protect, produced, external


def analyse(profile: Profile, granularity: str = "fine") -> tuple[list[Unit], dict[int, str]]:
    """Finds the checkpointable regions of a profile.

    Args:
        profile: the profile.
        granularity: which module calls become regions, one of :data:`GRANULARITIES` (NOTE [Region granularity]).

    Returns:
        The decision units, and for module calls that were rejected, why (index into module_calls -> reason).
    """
    ops = profile.ops
    first_bwd, writes_at = _forward_writes(profile)
    storages = profile.storages
    fwd_uses: dict[int, list[int]] = {}
    for i, o in enumerate(ops):
        if not o.backward:
            for s in o.inputs:
                fwd_uses.setdefault(s, []).append(i)
    calls = profile.module_calls
    kids = _children(profile)
    packs_by_call: dict[int, list[int]] = {}
    for pi, p in enumerate(profile.packs):
        packs_by_call.setdefault(p.module_call, []).append(pi)

    def packs_within(call: int) -> list[int]:
        found, todo = [], [call]
        while todo:
            c = todo.pop()
            found.extend(packs_by_call.get(c, []))
            todo.extend(kids.get(c, []))
        return sorted(found)

    packs_by_storage: dict[int, list[int]] = {}
    for pi, p in enumerate(profile.packs):
        packs_by_storage.setdefault(p.storage, []).append(pi)

    rejected: dict[int, str] = {}
    units: dict[tuple[str, int], Unit] = {}
    inconsistent: set[tuple[str, int]] = set()
    # NOTE [Refused calls split]: a call refused for something one of its parts does (a MoE block whose router
    # scales the block's input in place, an attention module handed a key/value cache) is split into its children,
    # each tried on its own: the experts and the projections hold the activations
    todo = list(reversed(_select_calls(profile, first_bwd, granularity)))
    while todo:
        ci = todo.pop()
        c = calls[ci]
        a, b = c.start_op, c.end_op
        reasons, protect, produced, external = _refusals(profile, c, first_bwd, writes_at)
        produced_set = set(produced)
        region_packs = packs_within(ci)
        if not region_packs and not reasons:
            reasons.append("autograd saves nothing inside it")
        if reasons:
            reason = "; ".join(dict.fromkeys(reasons))
            children = [k for k in kids.get(ci, []) if calls[k].end_op > calls[k].start_op]
            if region_packs and children:
                reason += "; its submodules are tried on their own"
                todo.extend(reversed(children))
            rejected[ci] = reason
            continue
        unpacks = [profile.packs[pi] for pi in region_packs if profile.packs[pi].first_unpack >= 0]
        region_pack_set = set(region_packs)
        # NOTE [Release after unpack]: autograd lets go of a saved tensor when the node that holds it is released,
        # after that node's backward has run (or with the graph, if it never runs), not at the unpack. The
        # checkpoint frame (its inputs, Libra's cache, the RNG state it stashed) dies with the last of the saves
        # made under it, whose release the profiler records (PackRecord.released_op). Profiles made by hand have
        # none: there the eager free time of a storage that only this region saved stands in for it. A replayed
        # copy goes a little earlier (see _apply_end).
        released = [profile.packs[pi].released_op for pi in region_packs]
        if all(r >= 0 for r in released):
            frame_end = max(released)
        else:
            frame_end = max([p.last_unpack for p in unpacks] + [
                storages[p.storage].free_op
                for p in unpacks
                if not storages[p.storage].static
                and all(q in region_pack_set for q in packs_by_storage.get(p.storage, ()))
                and storages[p.storage].free_op >= first_bwd
            ], default=-1)
        inst = RegionInstance(
            call_index=ci,
            start=a,
            end=b,
            t_r=min((p.first_unpack for p in unpacks), default=-1),
            l_r=frame_end,
            stop=min(max(profile.packs[pi].pack_op for pi in region_packs), b),
            # what it reads from before it, and what it was handed without reading (checkpoint holds every argument)
            external_inputs=[s for s in dict.fromkeys(external + c.arg_storages)
                             if s not in produced_set and not storages[s].static],
            packs=region_packs,
        )
        forced: set[int] = set()
        candidate_bytes: dict[int, int] = {}
        not_offloadable: set[int] = set()
        for s in dict.fromkeys(produced):
            rec = storages[s]
            local = rec.producer - a
            pks = packs_by_storage.get(s, [])
            packed_here = any(pi in region_pack_set for pi in pks)
            packed_elsewhere = any(pi not in region_pack_set for pi in pks)
            uses = fwd_uses.get(s, [])
            escapes = packed_elsewhere or any(u >= b for u in uses) or (not pks and rec.free_op >= b)
            later_writes = [w for w in writes_at.get(s, []) if rec.producer < w < b]
            # changed in place after the region returned: a cached alias would replay the changed value
            written_after = any(w >= b for w in writes_at.get(s, []))
            inst.sids.append(s)
            inst.producer.append(local)
            inst.packed.append(packed_here)
            inst.fwd_end.append(max([rec.producer] + [u for u in uses if u < b]))
            inst.mutated_at.append(later_writes[0] if later_writes else -1)
            inst.escapes.append(escapes)
            bwd_end = max((profile.packs[pi].last_unpack for pi in pks if pi in region_pack_set), default=-1)
            if not packed_elsewhere and rec.free_op >= first_bwd:
                bwd_end = max(bwd_end, _apply_end(ops, s, rec.free_op))  # NOTE [Release after unpack]
            inst.bwd_end.append(bwd_end)
            if escapes or later_writes or written_after or not packed_here:
                not_offloadable.add(local)
            # held past the forward's end (saved outside, or alive into backward): a replay would make a second copy,
            # unless what holds it outside lets go before the replay runs (NOTE [Held outside until the replay])
            lives_on = packed_elsewhere or rec.free_op >= first_bwd
            gone = lives_on and inst.t_r >= 0 and _held_outside_until(profile, s, pks, region_pack_set) < inst.t_r
            if escapes and lives_on and not gone and not later_writes and not written_after:
                forced.add(local)
            elif packed_here and (not escapes or (gone and not later_writes and not written_after)):
                # kept, one changed later in the region costs a copy-on-write clone: the simulator counts it
                candidate_bytes[local] = candidate_bytes.get(local, 0) + rec.nbytes
        names = [ops[i].name for i in range(a, b)]
        key = (c.module, c.call)
        if key in inconsistent:
            rejected[ci] = "its calls in different root calls ran different ops"
            continue
        unit = units.get(key)
        if unit is None:
            unit = Unit(
                module=c.module,
                call=c.call,
                instances=[],
                op_names=names,
                op_seconds=[0.0] * (b - a),
                fresh=[bool(ops[i].outputs) for i in range(a, b)],
                forced_save=set(),
                candidates=[],
                candidate_bytes={},
                offloadable=set(),
                protect=protect,
                input_shapes=c.input_shapes,
            )
            units[key] = unit
        elif unit.op_names != names:
            rejected[ci] = "its calls in different root calls ran different ops"
            inconsistent.add(key)
            del units[key]
            continue
        unit.instances.append(inst)
        # ... and it restores only the default generators, not one a random op was handed (NOTE [Plain regions])
        unit.plain_ok = unit.plain_ok and not any(ops[i].generator for i in range(a, b))
        for i in range(a, b):
            unit.op_seconds[i - a] += ops[i].seconds
        unit.forced_save |= forced
        for local, nbytes in candidate_bytes.items():
            unit.candidate_bytes[local] = unit.candidate_bytes.get(local, 0) + nbytes
        unit.candidate_bytes = {k: v for k, v in unit.candidate_bytes.items() if k not in unit.forced_save}
        unit.offloadable = (unit.offloadable | set(candidate_bytes)) - not_offloadable
    result = list(units.values())
    for u in result:
        if len(u.candidate_bytes) > MAX_CANDIDATES:  # NOTE [Many candidates]
            top = set(sorted(u.candidate_bytes, key=lambda j: (-u.candidate_bytes[j], j))[:MAX_CANDIDATES])
            u.candidate_bytes = {j: x for j, x in u.candidate_bytes.items() if j in top}
            u.offloadable &= top
        u.candidates = sorted(u.candidate_bytes)
    return result, rejected


def unprofiled_siblings(profile: Profile) -> dict[str, int]:
    """NOTE [Unprofiled siblings] (runtime/apply.py), seen from the profile: modules the profiled step never called
    whose container holds a sibling with the same parameters (relative names, shapes, dtypes) that it did call,
    as layer drop leaves them, and whose sibling's call plain checkpoint replays exactly (it writes no tensor made
    before it but module state, which the guarded replay protects, NOTE [Guarded replay] in runtime/region.py, and
    hands no generator to a random op). Returns fqn -> index of the called sibling's first module call.

    Later steps that run such a module under a plan run it recomputed whole (plain checkpoint), holding its input
    until its backward: memory the profiled step never needed (:func:`unprofiled_reserve`). One whose sibling
    cannot be replayed exactly (a generator of its own) runs as it is, keeping its activations."""
    params: dict[str, dict[str, tuple]] = {}  # module fqn (a container's child) -> its parameters, relative
    for name, shape, dtype in profile.parameters:
        parts = name.split(".")
        for k in range(1, len(parts) - 1):
            child = ".".join(parts[: k + 1])
            params.setdefault(child, {})[".".join(parts[k + 1:])] = (tuple(shape), dtype)
    first_call: dict[str, int] = {}
    for ci, c in enumerate(profile.module_calls):
        first_call.setdefault(c.module, ci)
    # a module counts as called when it or anything inside it was
    called = set(first_call) | {m.rsplit(".", k)[0] for m in first_call for k in range(1, m.count(".") + 1)}
    by_parent: dict[str, list[str]] = {}
    for fqn in params:
        by_parent.setdefault(fqn.rsplit(".", 1)[0], []).append(fqn)
    out: dict[str, int] = {}
    for parent, children in by_parent.items():
        done = [c for c in children if c in first_call]
        for fqn in children:
            if fqn in called:
                continue
            twin = next((d for d in done if params[d] == params[fqn]), None)
            if twin is not None:
                out[fqn] = first_call[twin]
    first_bwd, writes_at = _forward_writes(profile)

    def exact(ci: int) -> bool:
        c = profile.module_calls[ci]
        reasons, _, _, _ = _refusals(profile, c, first_bwd, writes_at)
        return not reasons and not any(profile.ops[i].generator for i in range(c.start_op, c.end_op))

    return {fqn: ci for fqn, ci in out.items() if exact(ci)}


def unprofiled_reserve(profile: Profile, siblings: dict[str, int]) -> list[tuple[int, int, int]]:
    """What a later step may hold beyond the profiled one for the modules ``siblings`` (from
    :func:`unprofiled_siblings`) names, as ``(first op, last op, bytes)`` spans of the step's timeline (NOTE [Layers
    the profiled step skipped] in planner/__init__.py). Such a module runs between its called siblings, inside
    their nearest called ancestor (the encoder of a Whisper layer), so for each:

    - its input, as its called sibling's (the non-static storages its ops read that were made before it began), and
      the generator state its checkpoint stashes (NOTE [RNG state] in simulate.py): held from the first sibling's
      forward to the end of the ancestor's backward;
    - the gradients of its parameters, which the profiled step never made (counted as the bytes of its parameters and
      buffers: the profile does not tell them apart): from the start of the ancestor's backward to the step's end;
    - its replay: what its sibling's call saved, recomputed at once in its backward, where the plan may have replayed
      its sibling in parts or not at all. Its backward runs between its called neighbours': right before the
      backward of the sibling before it (the one after it is done by then), or, for one before every called sibling,
      right after the backward of the sibling after it. Dropped layers whose backward falls at one point replay one
      after the other: the largest of them counts there.

    The ancestor's backward runs from the first unpack of what it saved to the last release; without a called
    ancestor, or one that saved nothing, the spans run to the step's end (from its first backward op)."""
    n = len(profile.ops)
    calls = profile.module_calls
    first_call: dict[str, int] = {}
    for ci, c in enumerate(calls):
        first_call.setdefault(c.module, ci)
    order: dict[str, int] = {}  # module -> its place among its container's children (registration order)
    for name, _, _ in profile.parameters:
        parts = name.split(".")
        for k in range(1, len(parts)):
            order.setdefault(".".join(parts[:k]), len(order))

    def backward_of(lo: int, hi: int) -> tuple[int, int] | None:
        """(first unpack, last release) of what ops ``(lo, hi]`` saved; None if nothing they saved was unpacked."""
        packs = [p for p in profile.packs if lo < p.pack_op <= hi and p.first_unpack >= 0]
        if not packs:
            return None
        return min(p.first_unpack for p in packs), min(max(max(p.released_op, p.last_unpack) for p in packs), n)

    spans: list[tuple[int, int, int]] = []
    replays: dict[tuple[int, int], int] = {}  # span of a replay -> the largest replay there
    for fqn, ci in siblings.items():
        call = calls[ci]
        container = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        anc = call.parent
        while anc >= 0 and not container.startswith(calls[anc].module + ".") and container != calls[anc].module:
            anc = calls[anc].parent
        lo, hi = (calls[anc].start_op, calls[anc].end_op) if anc >= 0 else (0, n)
        called = sorted((m for m in first_call if m.rsplit(".", 1)[0] == container and lo <= calls[first_call[m]]
                         .start_op < hi and m in order), key=order.__getitem__)
        first = min((calls[first_call[m]].start_op for m in called), default=call.start_op)
        window = backward_of(lo, hi) if anc >= 0 else None
        bwd_start, bwd_end = window if window is not None else (profile.first_backward_op, n)
        held = profile.rng_state_bytes
        seen: set[int] = set()
        for i in range(call.start_op, call.end_op):
            for s in profile.ops[i].inputs:
                rec = profile.storages[s]
                if s not in seen and not rec.static and rec.alloc_op < call.start_op:
                    seen.add(s)
                    held += rec.nbytes
        spans.append((first, max(bwd_end, first), held))
        grads = sum(math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize
                    for name, shape, dtype in profile.parameters if name.startswith(fqn + "."))
        spans.append((bwd_start, n, grads))
        saved = {p.storage for p in profile.packs if call.start_op < p.pack_op <= call.end_op}
        replay = sum(profile.storages[s].nbytes for s in saved
                     if not profile.storages[s].static and profile.storages[s].alloc_op >= call.start_op)
        before = [m for m in called if order[m] < order.get(fqn, -1)]
        after = [m for m in called if order[m] > order.get(fqn, -1)]
        point = None
        if before and fqn in order:
            c = calls[first_call[before[-1]]]
            got = backward_of(c.start_op, c.end_op)
            point = None if got is None else max(got[0] - 1, 0)
        elif after and fqn in order:
            c = calls[first_call[after[0]]]
            got = backward_of(c.start_op, c.end_op)
            point = None if got is None else got[1]
        where = (point, point) if point is not None else (bwd_start, bwd_end)
        replays[where] = max(replays.get(where, 0), replay)
    spans.extend((a, b, r) for (a, b), r in replays.items())
    return [(a, b, x) for a, b, x in spans if x > 0]
