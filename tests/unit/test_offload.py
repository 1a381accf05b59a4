"""Offload on CPU: the same code path as on CUDA with plain copies. Host and device memory are one here, so these
tests check values, release and reuse, not the budget (that is the GPU check's job)."""

import gc
import weakref

import pytest

import libra
from libra.planner import Planning
from libra.runtime import offload as offload_mod
from libra.runtime.apply import _ACTIVE_ATTR

FAST = 1e13  # bytes per second: offloading is nearly free
SLOW = 1e6


def _plan(case, decisions, bandwidth=FAST, share=0.5):
    prof = case.profile
    planning = Planning(prof, bandwidth, decisions)
    return libra.plan(planning, max(prof.budget_for_share(share), planning.min_budget_bytes()))


@pytest.mark.parametrize("decisions", [{"keep", "offload"}, {"keep", "recompute"}, {"keep", "recompute", "offload"}])
def test_gradients_exact(case, decisions):
    plan = _plan(case, decisions)
    counts = plan.counts
    if "offload" in decisions and "recompute" not in decisions:
        assert counts[libra.Decision.OFFLOAD] > 0 and counts[libra.Decision.RECOMPUTE] <= counts[libra.Decision.KEEP]
    if "offload" not in decisions:
        assert counts[libra.Decision.OFFLOAD] == 0
    case.train(plan, steps=3)


def test_bandwidth_decides_the_trade(case):
    slow = _plan(case, {"keep", "recompute", "offload"}, SLOW, share=0.75)
    fast = _plan(case, {"keep", "recompute", "offload"}, FAST, share=0.75)
    assert slow.counts[libra.Decision.OFFLOAD] == 0 and slow.counts[libra.Decision.RECOMPUTE] > 0
    assert fast.counts[libra.Decision.OFFLOAD] > 0
    assert fast.predicted_step_seconds <= slow.predicted_step_seconds


def test_offloaded_storages_are_released_in_forward_and_the_pool_does_not_grow(case, monkeypatch):
    plan = _plan(case, {"keep", "offload"})
    sources = []
    original = offload_mod.HostCopy.__init__

    def watching(self, t, pool, stream):
        sources.append(weakref.ref(t.untyped_storage()))
        original(self, t, pool, stream)

    monkeypatch.setattr(offload_mod.HostCopy, "__init__", watching)
    model = case.ours
    pool_sizes = []
    with libra.apply(model, plan):
        pool = model.__dict__[_ACTIVE_ATTR].offload.pool
        for _ in range(3):
            sources.clear()
            loss = case.loss_fn(model(case.x), case.y)
            gc.collect()
            assert sources, "the plan offloads nothing"
            alive = [s for s in sources if s() is not None]
            assert not alive, f"{len(alive)} of {len(sources)} offloaded storages still on the device after forward"
            loss.backward()
            del loss
            model.zero_grad(set_to_none=True)
            pool_sizes.append(pool.allocated_bytes)
    assert pool_sizes[0] > 0 and pool_sizes[0] == pool_sizes[1] == pool_sizes[2]


def test_offload_needs_a_bandwidth_on_cpu(case):
    with pytest.raises(libra.LibraError, match="host_bandwidth"):
        libra.plan(case.profile, case.profile.budget_for_share(0.5), decisions={"offload"})
    plan = libra.plan(case.profile, case.profile.budget_for_share(0.5))
    assert plan.counts[libra.Decision.OFFLOAD] == 0
