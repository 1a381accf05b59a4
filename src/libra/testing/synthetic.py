"""Synthetic profiles: a chain of blocks with plausible storage timelines, for testing the planner with no model."""

from __future__ import annotations

import random

from libra.profiler.types import ModuleCall, OpRecord, PackRecord, Profile, StorageRecord

__all__ = ["chain_profile"]


def chain_profile(n_blocks: int, ops_per_block: int, *, seed: int = 0, min_bytes: int = 1 << 10,
                  max_bytes: int = 1 << 20, static_bytes: int = 1 << 20) -> Profile:
    """A profile of a chain ``x -> block_0 -> ... -> block_{n-1} -> loss`` and its backward.

    Each op makes one storage of a random size that the next op saves for backward; the backward runs one op per
    forward op in reverse, unpacking what that op saved and making one gradient storage freed by the next.
    """
    rng = random.Random(seed)
    ops: list[OpRecord] = []
    storages = [StorageRecord(nbytes=static_bytes, alloc_op=-1, free_op=-1, static=True)]  # parameters
    packs: list[PackRecord] = []
    calls = [ModuleCall(module="", call=0, root_call=0, start_op=0, end_op=-1, depth=0, parent=-1)]
    x = len(storages)
    storages.append(StorageRecord(nbytes=rng.randint(min_bytes, max_bytes), alloc_op=-1, free_op=-1, static=True))
    current = x
    saved_by: list[tuple[int, int]] = []  # (forward op, pack index)
    for b in range(n_blocks):
        calls.append(ModuleCall(module=f"blocks.{b}", call=0, root_call=0, start_op=len(ops), end_op=-1, depth=1,
                                parent=0, input_shapes=[[1]]))
        for _ in range(ops_per_block):
            i = len(ops)
            out = len(storages)
            storages.append(StorageRecord(nbytes=rng.randint(min_bytes, max_bytes), alloc_op=i, free_op=-1,
                                          producer=i))
            ops.append(OpRecord(name=rng.choice(["aten.mm.default", "aten.gelu.default", "aten.add.Tensor"]),
                                seconds=rng.uniform(1e-5, 1e-3), backward=False, module=f"blocks.{b}",
                                inputs=[current, 0], outputs=[out], writes=[], undeclared_writes=[]))
            packs.append(PackRecord(storage=current, pack_op=i, module_call=len(calls) - 1))
            saved_by.append((i, len(packs) - 1))
            current = out
        calls[-1].end_op = len(ops)
    loss = len(storages)
    storages.append(StorageRecord(nbytes=4, alloc_op=len(ops), free_op=-1, producer=len(ops)))
    ops.append(OpRecord(name="aten.sum.default", seconds=1e-5, backward=False, module="", inputs=[current],
                        outputs=[loss], writes=[], undeclared_writes=[]))
    storages[current].free_op = len(ops) - 1
    calls[0].end_op = len(ops)
    grad = None
    for i, pack_index in reversed(saved_by):
        j = len(ops)
        g = len(storages)
        storages.append(StorageRecord(nbytes=storages[ops[i].outputs[0]].nbytes, alloc_op=j, free_op=-1, producer=j))
        p = packs[pack_index]
        p.first_unpack = p.last_unpack = j
        ops.append(OpRecord(name="aten.mm.default", seconds=ops[i].seconds * 2, backward=True, module="",
                            inputs=[p.storage] + ([grad] if grad is not None else []), outputs=[g], writes=[],
                            undeclared_writes=[]))
        if storages[p.storage].producer >= 0:
            storages[p.storage].free_op = j
        if grad is not None:
            storages[grad].free_op = j
        grad = g
    n = len(ops)
    for s in storages:
        if s.free_op < 0:
            s.free_op = n
    live = [0] * (n + 2)
    for s in storages:
        live[max(s.alloc_op, 0)] += s.nbytes
        live[min(s.free_op, n) + 1] -= s.nbytes
    peak = run = 0
    for v in live[: n + 1]:
        run += v
        peak = max(peak, run)
    static = sum(s.nbytes for s in storages if s.static)
    return Profile(device="cpu", eager_peak_bytes=peak, static_bytes=static,
                   eager_step_seconds=sum(o.seconds for o in ops), dispatch_overhead_seconds=5e-6, ops=ops,
                   storages=storages, packs=packs, module_calls=calls, parameters=[])
