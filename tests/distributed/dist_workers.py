"""What each rank of the distributed tests runs, in a process of its own (started by ``launch``).

NOTE [Distributed oracle]: every rank builds the same base model and wraps two deep copies the same way (DDP, or
``fully_shard``): an eager one and one trained under Libra. Both see the same per-rank inputs and the same per-rank
generator seeds, so every gradient, every parameter after an SGD step and every loss must be ``torch.equal``
between them; the distributed run without Libra is the oracle, rank by rank. Mismatches are collected, never
raised, so that both ranks always issue the same collectives and neither is left waiting; the parent asserts.

NOTE [Counting collectives]: ``CollectiveCounter`` is a dispatch mode entered around each step; checkpoint pushes
Libra's region modes above it within the step, so every op they run (forward, and replayed in backward) reaches it,
and only what Libra's cache returns without running does not. DDP's reducer and FSDP2's hooks issue their
collectives through the c10d dispatcher ops (``c10d.allreduce_``, ``c10d._allgather_base_``,
``c10d._reduce_scatter_base_``), which it counts. A Libra step must issue exactly the eager step's collectives, op
by op, while running more other ops than eager (its replays). ``_instrument_check`` shows that the counter sees a
replayed collective: under plain ``torch.utils.checkpoint`` a module with a collective in its forward issues it
twice. (With Libra's collective marks removed, the planner recomputes a synced block of "ddp_synced" and its Libra
steps count 4 all_reduces to eager's 3.)

NOTE [Memory under DDP and FSDP2]: every step of both copies runs inside ``libra.testing.AllocatorMeter``, which
counts what the CPU allocator hands out (kernels' temporaries included) above the tensors live when the step starts.
The profile and the meters must start from the same live set (DESIGN.md, pitfall 15), and on the CPU both find it
by a scan of the tensors Python can reach, which misses tensors only C++ holds until Python has had them: the
gradients autograd and DDP's reducer make, DDP's buckets. So every step runs under a dispatch mode (the counter below,
which hands Python every tensor an op touches), gradients are read before the profile and by each meter (``extra``),
and the profiled step is one that runs as the later ones do (DDP builds its buckets anew in the second iteration's
forward: two warm-up steps). Then each Libra step starts within bytes of the profile's static bytes (its loss), its
peak must stay within its rank's budget, and each eager step, counted from the same start, must exceed it, so the
check can fail. The allowance above the budget, 1% and ``PEAK_SLACK_BYTES``, is for FSDP2 on gloo: there eager steps
also vary by whole all-gathered buffers (16,896 B, one ``fc``'s) from step to step. (A meter entered around the whole
run would see C++-held tensors without these steps, NOTE [What the allocator holds] in libra/_allocator.py, its
count drifted upwards here by whole collective buffers per step: the CPU meter sees no allocation or free made on
another thread than the one that started its profiler session, measured with plain Python threads, so frees made on
gloo's worker threads go unreported.)

NOTE [One plan per rank]: each rank profiles the wrapped model (the DDP module, the ``fully_shard``-ed root) running
the distributed step, as the user will run it: the plan's module names are then those ``libra.apply`` sees, the
profile sees the real step's tensors (DDP's buckets, FSDP2's all-gathered parameters), and the collectives are in
the profile for the planner to keep out of every region. Each rank plans for
itself from its own profile, which is what running the same script on every rank gives. Nothing needs the plans to
agree: a plan changes only what runs inside module forwards, the planner never recomputes a module whose forward
runs a collective, and the collectives DDP's reducer and FSDP2's hooks issue come in the same order whatever is
recomputed (bucket order, module order). To show it, the ranks plan at different budgets (rank 0 at 75% of eager's
activation memory, rank 1 at the planner's minimum), so they run different plans. Broadcasting rank 0's plan would
be as correct and give every rank the same memory; it is not needed.
"""

from __future__ import annotations

import collections
import copy
import gc
import json
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
WORLD_SIZES = {"fsdp_gpt_fc_world1": 1}  # scenarios that run on another number of ranks than WORLD
SHARES = (0.75, 0.0)  # budget per rank, as a share of eager's activation memory; rank 1's is raised to the minimum
WARM_UP = 2  # steps before the profiled one
PEAK_SLACK_BYTES = 64 * 1024  # see NOTE [Memory under DDP and FSDP2]
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collective ops dispatched while it is active, by op, and all other ops together."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.other_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.counts[str(func)] += 1
        else:
            self.other_ops += 1
        return func(*args, **(kwargs or {}))


class SyncedBlock(nn.Module):
    """An MLP block whose forward syncs a statistic across ranks (as SyncBatchNorm does): a collective in forward."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        stat = h.detach().pow(2).mean().reshape(1)
        dist.all_reduce(stat)
        return x + self.fc2(h) / (1 + stat)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _compare(tag: str, eager: nn.Module, ours: nn.Module, grads: bool = True) -> list[str]:
    """Every parameter (and its gradient) of two models, bit for bit; the differences as messages."""
    bad = []
    for (name, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
        pairs = [(name, p, q)] + ([(f"{name}.grad", p.grad, q.grad)] if grads else [])
        for what, a, b in pairs:
            if a is None or b is None:
                if a is not b:
                    bad.append(f"{tag}: {what}: one model has it and the other does not")
                continue
            a, b = _local(a), _local(b)
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape differs"
                bad.append(f"{tag}: {what} differs from eager (max abs difference {diff})")
    return bad


def _gpt(layers: int = 3):
    from libra.testing import models

    return models.make_gpt(batch=4, layers=layers, d=32, heads=2, seq=32, vocab=64, dropout=0.1)


def _synced_mlp():
    """Residual MLP whose odd blocks run a collective in their forward; even blocks are plain."""
    from libra.testing import models

    model, x, y, loss_fn = models.make_mlp(batch=64, d=32, hidden=256, depth=4)
    torch.manual_seed(1)
    for i in (1, 3):
        model.blocks[i] = SyncedBlock(32, 256)
    return model, x, y, loss_fn


def _data(x, y, rank: int, classes: int):
    """Per-rank inputs and targets shaped like the model's (each rank trains on other data, as under DDP)."""
    g = torch.Generator().manual_seed(7 + rank)
    if x.is_floating_point():
        x = torch.randn(x.shape, generator=g)
    else:  # tokens
        x = torch.randint(0, classes, x.shape, generator=g)
    return x, torch.randint(0, classes, y.shape, generator=g)


def _wrap_ddp(model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _wrap_fsdp(submodules):
    def wrap(model):
        from torch.distributed.fsdp import fully_shard

        for fqn in submodules(model):
            fully_shard(model.get_submodule(fqn))
        fully_shard(model)
        return model

    return wrap


def _train(rank: int, build, wrap, steps: int = 3) -> dict:
    """Warm-up, a profiled step, then ``steps`` steps under each rank's own plan, all next to the eager copy."""
    import libra
    from libra.testing import AllocatorMeter, fixed_times

    base, x, y, loss_fn = build()
    x, y = _data(x, y, rank, base.head.out_features)
    eager, ours = wrap(copy.deepcopy(base)), wrap(copy.deepcopy(base))
    del base
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, ours)}
    bad: list[str] = []
    out: dict = {"steps": []}

    def step(model, i):
        torch.manual_seed(1000 * rank + i)  # dropout draws differ per rank and per step, equal for both copies
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    def optimizer_step(i):
        for m in (eager, ours):
            opts[id(m)].step()
            opts[id(m)].zero_grad(set_to_none=True)
        bad.extend(_compare(f"after SGD step {i}", eager, ours, grads=False))

    # steps 0 and 1: warm-up (FSDP2 initialises lazily; DDP rebuilds its buckets in the second iteration's forward,
    # so the profiled step is the first that runs as every later one does); every step runs under a dispatch mode
    # (NOTE [Memory under DDP and FSDP2])
    for i in range(WARM_UP):
        with CollectiveCounter():
            warm = step(eager, i), step(ours, i)
        if not torch.equal(*warm):
            bad.append(f"warm-up step {i}: loss differs")
        bad.extend(_compare(f"warm-up step {i}", eager, ours))
        optimizer_step(i)

    def params():  # read with their gradients by the meters' scans (NOTE [Memory under DDP and FSDP2])
        return [*eager.parameters(), *ours.parameters()]

    # then one step profiled, on the wrapped model with the distributed step the user runs
    with CollectiveCounter():
        loss_e = step(eager, WARM_UP)
    _read_grads(params())
    holder = {}
    prof = libra.profile(ours, lambda: holder.setdefault("loss", step(ours, WARM_UP)))
    if not torch.equal(loss_e, holder["loss"]):
        bad.append("profiled step: loss differs from eager")
    bad.extend(_compare("profiled step", eager, ours))
    optimizer_step(WARM_UP)
    out["profiled_collectives"] = sorted({o.name for o in prof.ops if o.collective})
    fixed_times(prof)  # the plan from what the step saved, not from this machine's timings: ranks' plans differ

    budget = prof.budget_for_share(SHARES[rank])
    try:
        plan = libra.plan(prof, budget)
    except libra.BudgetInfeasibleError as e:
        plan = libra.plan(prof, e.min_budget_bytes)
    out["budget_bytes"] = plan.budget_bytes
    out["static_bytes"] = prof.static_bytes
    out["profiled_peak_bytes"] = [prof.eager_peak_bytes, prof.allocator_peak_bytes]
    out["predicted_peak_bytes"] = plan.predicted_peak_bytes
    out["recompute"] = plan.counts[libra.Decision.RECOMPUTE]
    out["recomputed"] = sorted(k for k, d in plan.decisions.items() if d is libra.Decision.RECOMPUTE)
    out["region_modules"] = sorted({r.module for r in plan.regions})

    with libra.apply(ours, plan):  # one block around the loop, as a user writes it; the eager copy is untouched
        for i in range(WARM_UP + 1, WARM_UP + 1 + steps):
            with AllocatorMeter(extra=params()) as meter_e, CollectiveCounter() as counted_e:
                loss_e = step(eager, i)
            with AllocatorMeter(extra=params()) as meter_o, CollectiveCounter() as counted_o:
                loss_o = step(ours, i)
            if not torch.equal(loss_e, loss_o):
                bad.append(f"Libra step {i}: loss differs from eager")
            bad.extend(_compare(f"Libra step {i}", eager, ours))
            out["steps"].append({"eager": dict(counted_e.counts), "libra": dict(counted_o.counts),
                                 "eager_other_ops": counted_e.other_ops, "libra_other_ops": counted_o.other_ops,
                                 "eager_bytes": [meter_e.start_bytes, meter_e.peak_bytes],
                                 "libra_bytes": [meter_o.start_bytes, meter_o.peak_bytes]})
            optimizer_step(i)
    out["mismatches"] = bad
    return out


def _read_grads(params) -> None:
    """Gives every gradient a Python object, which the scans of live tensors then see (NOTE [Memory under DDP and
    FSDP2])."""
    for p in params:
        _ = p.grad


def _instrument_check(rank: int) -> dict:
    """The counter sees a replayed collective: plain checkpoint of a module with one in its forward issues it twice."""
    block = SyncedBlock(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with CollectiveCounter() as plain:
        block(x).sum().backward()
    with CollectiveCounter() as replayed:
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    return {"plain": dict(plain.counts), "checkpointed": dict(replayed.counts)}


def _gpt_blocks(model):
    return [f"blocks.{i}" for i in range(len(model.blocks))]


def _gpt_attn(model):
    return [f"blocks.{i}.attn" for i in range(len(model.blocks))]


def _gpt_fc(model):
    return [f"blocks.{i}.fc" for i in range(len(model.blocks))]


SCENARIOS = {
    # DDP over a GPT with dropout and a tied head
    "ddp_gpt": lambda rank: _train(rank, _gpt, _wrap_ddp),
    # DDP over an MLP with collectives inside two of its blocks' forwards
    "ddp_synced": lambda rank: {**_train(rank, _synced_mlp, _wrap_ddp), "instrument": _instrument_check(rank)},
    # FSDP2 the usual way: each block and the root sharded (all-gathers in the blocks' hooks, outside forward)
    "fsdp_gpt": lambda rank: _train(rank, _gpt, _wrap_fsdp(_gpt_blocks)),
    # FSDP2 sharding each attention module: the planner splits the blocks and the sharded attention modules are
    # regions of their own (their all-gathers run in their hooks, outside the region)
    "fsdp_gpt_nested": lambda rank: _train(rank, _gpt, _wrap_fsdp(_gpt_attn)),
    # FSDP2 sharding each block's first MLP Linear: every block's forward runs that Linear's all-gather, so the
    # blocks (6 layers: small enough to be regions) must never be replayed
    "fsdp_gpt_fc": lambda rank: _train(rank, lambda: _gpt(6), _wrap_fsdp(_gpt_fc)),
    # the same on one rank: FSDP2 issues no all-gather there, but its hooks still run in every block's forward, and
    # would run otherwise in a replay (NOTE [FSDP2's hooks are never replayed] in libra/profiler/recorder.py)
    "fsdp_gpt_fc_world1": lambda rank: _train(rank, lambda: _gpt(6), _wrap_fsdp(_gpt_fc)),
}


def world_size(scenario: str) -> int:
    return WORLD_SIZES.get(scenario, WORLD)


def main(scenario: str, rank: int, init_method: str, out_dir: str) -> None:
    """Entry point of one rank: runs the scenario and writes ``rank<r>.json`` (result or traceback)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size(scenario),
                                timeout=timedelta(seconds=30))
        result["result"] = SCENARIOS[scenario](rank)
    except Exception:  # reported to the parent, which fails the test with it
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if dist.is_initialized():
            gc.collect()  # a DDP module still alive (in a reference cycle) at destroy aborts the process
            dist.destroy_process_group()
