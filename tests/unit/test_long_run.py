"""500 training steps under one plan that both recomputes and offloads, next to an eager copy, with Adam.

Whatever a long run could accumulate must not: a drift of the loss curve (RNG state, BatchNorm running stats, Adam's
moments fed by a gradient a bit off), memory held across steps (Libra's caches, replay memos, host copies, autograd
graphs kept alive), or a host pool that allocates a little more every step. The memory is measured by meters that do
not read the plan: ``AllocatorMeter`` around a whole step and a census of every live tensor storage the garbage
collector can see.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import libra
from libra.planner import Planning
from libra.runtime.apply import _ACTIVE_ATTR
from libra.testing import AllocatorMeter, assert_grads_equal, fixed_times

STEPS = 500
MEASURED = (5, STEPS)  # steps whose memory is compared
D_IN, D, HIDDEN, CLASSES, BATCH = 16, 32, 128, 10, 64
FAST = 1e13  # bytes per second: offloading is nearly free, so the plan offloads what hides behind compute


pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.ln(x)))))


class Net(nn.Module):
    """Input layer with BatchNorm (running stats) and an in-place ReLU, four residual blocks with dropout, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.bn = nn.BatchNorm1d(D)
        self.relu = nn.ReLU(inplace=True)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        h = self.relu(self.bn(self.inp(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h)



def storage_census() -> tuple[int, int]:
    """(number, bytes) of the distinct CPU storages behind every tensor the garbage collector can see."""
    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
            s = o.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return len(seen), sum(seen.values())


def test_500_steps_with_recompute_and_offload_match_eager_and_do_not_grow():
    torch.manual_seed(0)
    eager = Net()
    ours = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (eager, ours)]

    def step(model):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.item()  # a Python float holds a float32 exactly; a kept tensor would grow the live bytes

    def finish(opt):
        opt.step()
        opt.zero_grad(set_to_none=True)

    # a warm-up step creates Adam's state, so the profile's static bytes are what every later step starts with
    for model, opt in zip((eager, ours), opts):
        torch.manual_seed(7)
        step(model)
        finish(opt)
    torch.manual_seed(8)
    prof = fixed_times(libra.profile(ours, lambda: step(ours)))
    torch.manual_seed(8)
    step(eager)
    assert_grads_equal(eager, ours)
    for opt in opts:
        finish(opt)

    planning = Planning(prof, FAST, {"keep", "recompute", "offload"})
    # 60%: where the plan both recomputes and offloads (at 75% offloading alone fits, NOTE [Prefetch])
    plan = libra.plan(planning, prof.budget_for_share(0.6))
    counts = plan.counts
    assert counts[libra.Decision.RECOMPUTE] > 0 and counts[libra.Decision.OFFLOAD] > 0, counts

    losses_e, losses_o = [], []
    measured = {}
    with libra.apply(ours, plan):
        pool = ours.__dict__[_ACTIVE_ATTR].offload.pool
        acquired = []  # host buffers taken from the pool in the current step
        plain_acquire = pool.acquire
        pool.acquire = lambda nbytes: (acquired.append(nbytes), plain_acquire(nbytes))[1]
        for i in range(1, STEPS + 1):
            torch.manual_seed(100 + i)
            acquired.clear()
            if i in MEASURED:
                with AllocatorMeter(extra=list(ours.parameters())) as meter:
                    losses_o.append(step(ours))
                    gc.collect()
                    after_bytes = meter.current_bytes
            else:
                losses_o.append(step(ours))
            torch.manual_seed(100 + i)
            losses_e.append(step(eager))
            assert losses_e[-1] == losses_o[-1], f"step {i}: loss {losses_o[-1]!r} != eager {losses_e[-1]!r}"
            assert_grads_equal(eager, ours)
            if i in MEASURED:
                grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in ours.parameters())
            for opt in opts:
                finish(opt)
            if i in MEASURED:
                free = sorted((n, len(bufs)) for n, bufs in pool._free.items())
                measured[i] = dict(
                    start=meter.start_bytes, peak=meter.peak_bytes, net=after_bytes - meter.start_bytes - grad_bytes,
                    census=storage_census(), pool=pool.allocated_bytes, free=free,
                    free_bytes=sum(n * k for n, k in free), acquired=sorted(acquired),
                )
                del meter
    assert_grads_equal(eager, ours)  # parameters, buffers (BatchNorm running stats) and None grads after 500 steps
    assert len(losses_e) == len(losses_o) == STEPS
    assert losses_e == losses_o
    for opt_e, opt_o in zip(*(opt.state_dict()["state"].values() for opt in opts)):
        assert all(torch.equal(opt_e[k], opt_o[k]) for k in opt_e), "Adam's state differs from eager's"

    first, last = (measured[i] for i in MEASURED)
    assert first["pool"] > 0 and first["acquired"], "the plan offloads, so every step takes host buffers"
    # every host buffer is back in the pool between steps, and the pool allocated nothing after step 5
    assert first["free_bytes"] == first["pool"] and last["free_bytes"] == last["pool"]
    assert last["pool"] == first["pool"] and last["free"] == first["free"]
    # between steps the only bytes live beyond the profile's static ones are the pool's host buffers
    assert first["start"] == prof.static_bytes + first["pool"], (first["start"], prof.static_bytes, first["pool"])
    assert last == first, f"memory after step {STEPS} differs from after step {MEASURED[0]}: {last} vs {first}"
    assert first["net"] == 0, "a step left more than its gradients allocated behind it"
    # on CPU the host pool is device memory too: without it, the step fits the budget
    assert first["peak"] - first["pool"] <= plan.budget_bytes, (first["peak"], first["pool"], plan.budget_bytes)
