"""The allocator's truth (NOTE [Allocator truth] in libra/_allocator.py): what kernels allocate inside themselves is
measured by the profiler, charged by the simulator, and seen by the test meter; the live-tensor meter misses it.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import libra
from libra.errors import LibraError, PlanFormatError
from libra.planner import Planning
from libra.planner.simulate import Simulator
from libra.testing import AllocatorMeter, LiveBytesMeter, models
from pairs import train_pair


class _Conv(nn.Module):
    """One 3x3 convolution on a CPU: oneDNN reorders its input into a buffer as large as the output, and frees it
    before the op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def test_the_allocator_meter_sees_what_kernels_take_and_the_live_meter_does_not():
    model, x = _Conv(), torch.randn(8, 3, 64, 64)
    out_bytes = 8 * 64 * 64 * 64 * 4
    with torch.no_grad():
        with AllocatorMeter(extra=list(model.parameters())) as alloc:
            with LiveBytesMeter(extra=list(model.parameters())) as live:
                y = model(x)
    assert alloc.start_bytes == live.start_bytes
    assert live.peak_bytes - live.start_bytes == out_bytes  # the output and nothing else
    assert alloc.peak_bytes - alloc.start_bytes > out_bytes, "the kernel's own buffer is missing"
    assert alloc.end_bytes - alloc.start_bytes == out_bytes  # what is left is the output
    del y


def test_meters_nest_and_see_the_same_allocations():
    with AllocatorMeter() as outer:
        a = torch.empty(1000, dtype=torch.uint8)
        with AllocatorMeter() as inner:
            b = torch.empty(3000, dtype=torch.uint8)
            del b
        c = torch.empty(500, dtype=torch.uint8)
    assert inner.peak_bytes - inner.start_bytes == 3000 and inner.end_bytes == inner.start_bytes
    assert outer.peak_bytes - outer.start_bytes == 4000  # a and b together
    assert outer.end_bytes - outer.start_bytes == 1500
    del a, c


def test_the_meter_refuses_to_run_inside_another_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        with pytest.raises(LibraError, match="another torch.profiler session"):
            with AllocatorMeter():
                pass


def test_a_profile_inside_another_profiler_says_it_did_not_measure(caplog):
    model, x = _Conv(), torch.randn(2, 3, 16, 16)
    with caplog.at_level(logging.WARNING, logger="libra"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
            prof = libra.profile(model, lambda: model(x).sum().backward())
    assert prof.allocator == "" and prof.allocator_peak_bytes == -1
    assert all(op.transient_bytes == 0 for op in prof.ops)
    assert any("cannot be read" in r.getMessage() for r in caplog.records)


def _resnet():
    return models.make_resnet(batch=16, size=64)


def test_profiled_eager_peak_is_the_allocator_measured_one():
    model, x, y, loss_fn = _resnet()
    step = lambda: loss_fn(model(x), y).backward()  # noqa: E731
    step()
    model.zero_grad(set_to_none=True)
    prof = libra.profile(model, step)
    model.zero_grad(set_to_none=True)
    with AllocatorMeter(extra=list(model.parameters())) as meter:
        step()
    model.zero_grad(set_to_none=True)
    assert prof.allocator == "cpu-events"
    assert meter.start_bytes == prof.static_bytes
    # the recorder's curve with each op's transient bytes is what the allocator saw, during profiling and after
    assert prof.eager_peak_bytes == prof.allocator_peak_bytes
    assert prof.eager_peak_bytes >= meter.peak_bytes >= 0.99 * prof.eager_peak_bytes
    convs = [op for op in prof.ops if op.name == "aten.convolution_backward.default"]
    assert max(op.transient_bytes for op in convs) > 2**20, "convolution_backward's temporaries were not measured"


@pytest.mark.parametrize("share", [0.5, 0.0], ids=["half", "minimum"])
def test_convnet_plan_holds_its_budget_on_the_allocator(share):
    """Libra's own ResNet at 50% overran by 1.8 MB when workspaces were invisible (the issue's 79.57 vs 81.35 MiB);
    at the minimum a replayed convolution runs its forward kernel, workspace and all, in backward."""
    model, x, y, loss_fn = _resnet()
    eager, ours = model, copy.deepcopy(model)
    step = lambda m: loss_fn(m(x), y).backward()  # noqa: E731
    torch.manual_seed(0)
    prof = libra.profile(ours, lambda: step(ours))
    torch.manual_seed(0)
    step(eager)  # the same BatchNorm running-stat update as the profiled step
    ours.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    planning = Planning(prof)
    budget = max(prof.budget_for_share(share), planning.min_budget_bytes())
    plan = libra.plan(planning, budget)
    assert plan.regions
    for i, meter in enumerate(train_pair(eager, ours, plan, step, seed=10)):
        assert meter.start_bytes == prof.static_bytes
        assert meter.peak_bytes <= budget, (i, meter.peak_bytes, budget)
        # the simulator is the judge: it must not be far above what happens either
        assert meter.peak_bytes >= 0.98 * plan.predicted_peak_bytes, (meter.peak_bytes, plan.predicted_peak_bytes)


def test_the_simulator_charges_transient_bytes_at_the_op_and_at_its_replay():
    """NOTE [Transient bytes]: on top of the live bytes after the op, in the forward and again when a region
    replays it in backward."""
    from libra.testing.synthetic import chain_profile

    prof = chain_profile(4, 5, seed=3)
    big = 1 << 30  # far above everything else: where it is charged decides the curve
    planning = Planning(prof)
    sel = planning.selections[0]
    ui = next(i for i, u in enumerate(sel.units) if u.module == "blocks.1")
    inst = sel.units[ui].instances[0]
    op = inst.start + 2
    state = {ui: frozenset()}  # recompute everything in blocks.1
    bare_eager, bare_plan = Simulator(prof, sel.units).live({})[0], Simulator(prof, sel.units).live(state)[0]
    prof.ops[op].transient_bytes = big
    sim = Simulator(prof, sel.units)
    eager, planned = sim.live({})[0], sim.live(state)[0]
    assert eager[op] - bare_eager[op] == big
    assert (eager - bare_eager)[[t for t in range(prof.n_ops + 1) if t != op]].max() == 0  # at that op only
    assert planned[op] - bare_plan[op] == big  # the forward under the plan
    assert inst.t_r >= 0
    # the replay runs the op again before op t_r: the point after t_r stands for that moment too
    assert planned[inst.t_r] - bare_plan[inst.t_r] >= big - 5 * (1 << 20)
    assert sim.run(state).peak_bytes >= big


def test_profiles_of_the_old_schema_are_refused(tmp_path):
    model, x = _Conv(), torch.randn(2, 3, 8, 8)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    path = tmp_path / "p.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == 7 and "transient_bytes" in data["ops"][0] and data["host_bandwidth"] == 0.0
    assert any(s["held_op"] >= 0 for s in data["storages"])
    assert all(p["released_op"] >= max(p["last_unpack"], p["pack_op"]) for p in data["packs"])
    assert libra.Profile.load(path) == prof
    packed = tmp_path / "p.json.gz"
    prof.save(packed)
    assert gzip.decompress(packed.read_bytes()) == path.read_bytes()  # the same JSON, compressed
    assert libra.Profile.load(packed) == prof
    packed.write_bytes(packed.read_bytes()[:40])  # cut short
    with pytest.raises(PlanFormatError, match="cannot read"):
        libra.Profile.load(packed)
    data["schema_version"] = 3
    for s in data["storages"]:
        del s["held_op"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError, match="schema_version 3; this Libra reads 7"):
        libra.Profile.load(path)


def test_rng_state_of_each_checkpointed_call_is_counted():
    """``checkpoint(preserve_rng_state=True)`` stashes the CPU generator's state per call: 5,056 bytes each with
    torch 2.13, which plans planned to the byte went over by (NOTE [RNG state] in planner/simulate.py)."""
    model, x, y, loss_fn = models.make_mlp()
    prof = libra.profile(model, lambda: loss_fn(model(x), y).backward())
    assert prof.rng_state_bytes == torch.get_rng_state().numel()
    planning = Planning(prof)
    sel = planning.selections[0]
    state = sel.full_state
    assert state
    with_rng = Simulator(prof, sel.units).live(state)[0]
    without = Simulator(dataclasses.replace(prof, rng_state_bytes=0), sel.units).live(state)[0]
    calls = sum(len(sel.units[ui].instances) for ui in state)
    assert int((with_rng - without).max()) >= prof.rng_state_bytes
    assert int((with_rng - without).max()) <= (calls + 1) * prof.rng_state_bytes


class _Gathered(nn.Module):
    """Fills a weight's storage before using it and frees it right after by resizing it, as FSDP2 does with
    all-gathered parameters (NOTE [Resized storages] in profiler/recorder.py), and frees a spare storage it held
    from before the step the same way."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.shard = nn.Parameter(torch.randn(n, n))
        self.full = torch.empty(n, n)  # not a buffer: FSDP2 keeps its unsharded parameters out of the module's state
        self.full.untyped_storage().resize_(0)
        self.spare = torch.zeros(4 * n, n)

    def forward(self, x):
        self.full.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
        with torch.no_grad():
            self.full.copy_(self.shard)
        y = F.relu(x @ self.shard) + x @ self.full
        self.full.untyped_storage().resize_(0)
        self.spare.untyped_storage().resize_(0)
        return y


def test_a_storage_resized_to_zero_is_freed_there_and_one_resized_up_allocated_there():
    model, x = _Gathered(), torch.randn(32, 64)
    full_bytes, spare_bytes = 64 * 64 * 4, 4 * 64 * 64 * 4
    prof = libra.profile(model, lambda: model(x).sum().backward())
    first_backward = next(i for i, o in enumerate(prof.ops) if o.backward)
    copy = next(i for i, o in enumerate(prof.ops) if o.name == "aten.copy_.default")
    gathered = [s for s in prof.storages if s.nbytes == full_bytes and s.producer == -1 and not s.static]
    assert len(gathered) == 1, prof.storages
    assert gathered[0].alloc_op <= copy <= gathered[0].free_op < first_backward  # only while the forward uses it
    # other tests' live tensors of the same size are static too; they outlive the step
    spare = [s for s in prof.storages if s.nbytes == spare_bytes and s.static and s.free_op < len(prof.ops)]
    assert len(spare) == 1 and spare[0].free_op < first_backward
    assert any(s.nbytes == 0 and s.static for s in prof.storages)  # the weight's storage when the step began
    # the timeline the planner simulates holds neither after the forward, as the allocator did not
    live_after_forward = sum(s.nbytes for s in prof.storages if max(s.alloc_op, 0) <= first_backward <= s.free_op)
    assert live_after_forward < prof.static_bytes - spare_bytes + prof.activation_peak_bytes
    assert prof.eager_peak_bytes == prof.allocator_peak_bytes


def test_a_wrapper_subclass_counts_as_its_inner_tensors():
    """NOTE [Wrapper subclasses have no storage] in libra/_ops.py: a DTensor's own storage reports bytes it does
    not hold; scans count its inner tensors once."""
    from torch.testing._internal.two_tensor import TwoTensor

    from libra._ops import plain_tensors, storage_key

    a, b = torch.zeros(1000), torch.zeros(1000)
    with AllocatorMeter() as before:
        pass
    t = TwoTensor(a[900:], b[900:])  # views: no new memory, though its own storage says 4,000 bytes
    with AllocatorMeter() as after:
        pass
    assert storage_key(t) is None
    assert {storage_key(u) for u in plain_tensors([t])} == {storage_key(a), storage_key(b)}
    assert after.start_bytes == before.start_bytes
    del t


def test_an_outer_meter_counts_what_only_cpp_holds_for_inner_meters_and_the_profile():
    """NOTE [What the allocator holds] in libra/_allocator.py: a gradient autograd made has no Python object until it
    is read, so no scan sees it; inside a meter the allocator's count does."""
    from libra.testing.meter import _live_tensor_bytes

    model, x = _Conv(), torch.randn(2, 3, 16, 16)
    other = nn.Linear(256, 256)
    grad_bytes = (256 * 256 + 256) * 4
    cpu = torch.device("cpu")
    with AllocatorMeter():
        other(torch.randn(4, 256)).sum().backward()  # other's gradients: held by C++ alone until read
        seen = _live_tensor_bytes(cpu, ())
        with AllocatorMeter() as inner:
            pass
        prof = libra.profile(model, lambda: model(x).sum().backward())
    assert inner.start_bytes >= seen + grad_bytes
    assert prof.static_bytes >= seen + grad_bytes
    with AllocatorMeter() as alone:  # no outer meter: the scan alone
        pass
    assert alone.start_bytes < seen + grad_bytes
    assert other.weight.grad is not None


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).mul_(0.5)


def test_a_scalar_wrapped_outside_every_op_is_untracked_until_backward():
    # NOTE [Untracked bytes]: Python's binding wraps 0.5 in an 8-byte float64 tensor before dispatch; mul_'s
    # autograd node keeps it, without a saved-tensor hook, until its backward
    model, x = _Scaled(), torch.randn(4, 16)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    names = [op.name for op in prof.ops]
    scale = names.index("aten.mul_.Tensor")
    (grad,) = [i for i, op in enumerate(prof.ops) if op.backward and op.name == "aten.mul.Tensor"]
    assert prof.allocator == "cpu-events"
    # held from just before mul_ (the binding wraps it) until the node lets go of it, after its backward
    assert [op.untracked_bytes for op in prof.ops[scale - 1:grad]] == [8] * (grad - scale + 1)
    assert all(op.untracked_bytes == 0 for op in prof.ops[grad + 1:])
    assert all(op.transient_bytes >= op.untracked_bytes for op in prof.ops)
