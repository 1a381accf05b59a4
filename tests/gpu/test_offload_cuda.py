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
