"""CUDA only: offload copies race the compute stream; a too-early free or read shows up as wrong values."""

import pytest
import torch

from libra.runtime.offload import HostCopy, HostPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_offload_and_prefetch_while_a_long_kernel_runs():
    stream = torch.cuda.Stream()
    pool = HostPool(pin=True)
    x = torch.randn(4096, 1024, device="cuda")
    expected = x.clone()
    torch.cuda._sleep(50_000_000)  # the compute stream is busy while the copy is queued behind it
    copy = HostCopy(x, pool, stream)
    del x  # the caching allocator must not hand this memory out before the copy has read it
    garbage = torch.full((4096, 1024), 7.0, device="cuda")
    torch.cuda._sleep(50_000_000)
    copy.prefetch(stream)
    back = copy.get(stream)
    assert torch.equal(back, expected)
    copy.close()
    assert garbage.eq(7.0).all()


def test_pool_reuses_pinned_buffers():
    pool = HostPool(pin=True)
    a = pool.acquire(1 << 20)
    pool.release(a)
    assert pool.acquire(1 << 20) is a and pool.allocated_bytes == 1 << 20


class _Sleepy(torch.nn.Module):
    """Blocks whose last ReLU saves the output they return (it stays on the device) and an inner one whose output
    goes to host memory; each block keeps the compute stream busy, so the copies queue behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU())
            for _ in range(4)
        )

    def forward(self, x):
        for block in self.blocks:
            torch.cuda._sleep(5_000_000)
            x = block(x)
        return x


def test_hooked_calls_on_cuda_give_eager_gradients():
    """Hooked calls on the side stream (NOTE [Hooked regions]): inner outputs go to pinned buffers and come back,
    returned ones stay, and their buffers go back to the pool while a copy out may still be writing them."""
    import copy

    import libra
    from libra.planner import Planning
    from libra.planner.simulate import HOOKED

    torch.manual_seed(0)
    model, x = _Sleepy().cuda(), torch.randn(1024, 512, device="cuda")
    ref = copy.deepcopy(model)
    prof = libra.profile(model, lambda: model(x).sum().backward())
    model.zero_grad(set_to_none=True)
    planning = Planning(prof, 10e9)
    sel = planning.selections[0]
    state = {ui: HOOKED for ui, u in enumerate(sel.units) if u.module.startswith("blocks.") and sel.sim.hook_ok(ui)}
    assert len(state) == 4
    plan = planning.build(state, prof.eager_peak_bytes, sel.sim.run(state), "greedy", 0.0, sel)
    for _ in range(2):
        ref(x).sum().backward()
        with libra.apply(model, plan):
            model(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
