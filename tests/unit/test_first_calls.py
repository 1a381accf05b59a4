"""NOTE [First calls] (profiler/_warm.py): a profile of a process's first step times what later steps pay."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import libra
from libra._allocator import _folded
from libra._ops import op_info
from libra.profiler._warm import warm_first_call


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _warm(func, *args) -> list[str]:
    with _Calls() as calls:
        warm_first_call(func, op_info(func), args, {}, marked=False)
    return calls.names


def test_a_pure_op_runs_once_per_signature_and_process():
    aten = torch.ops.aten
    a, b = torch.randn(3, 17), torch.randn(17, 5)  # a signature no other test uses
    assert _warm(aten.mm.default, a, b) == ["aten.mm.default"]
    assert _warm(aten.mm.default, torch.randn(3, 17), torch.randn(17, 5)) == []  # same signature: warm already
    assert _warm(aten.mm.default, a.t().contiguous().t(), b) == ["aten.mm.default"]  # other strides: another


def test_ops_that_change_something_are_never_run_twice():
    aten = torch.ops.aten
    x = torch.randn(2, 19)
    before = x.clone()
    assert _warm(aten.relu_.default, x) == []  # writes its input
    assert _warm(aten.bernoulli.p, x, 0.5) == []  # draws from the generator
    mean, var = torch.zeros(19), torch.ones(19)
    assert _warm(aten.native_batch_norm.default, x, None, None, mean, var, True, 0.1, 1e-5) == []  # running stats
    assert torch.equal(x, before) and torch.equal(mean, torch.zeros(19))


def test_what_an_untimed_call_takes_and_gives_back_is_folded_away():
    memory = [(1, 100), (5, 64), (6, 32), (7, -64), (9, -100)]
    # the range (4, 8) took 64 and 32 and gave back 64: 32 it kept still counts, at the range's end
    assert _folded(memory, [(4, 8)]) == [(1, 100), (8, 32), (9, -100)]
    assert _folded(memory, [(4, 5)]) == [(1, 100), (5, 64), (6, 32), (7, -64), (9, -100)]


_FIRST_STEP = textwrap.dedent("""
    import sys, torch, libra
    from libra.testing import models
    torch.manual_seed(0)
    model, x, y, loss_fn = models.make_resnet(batch=8, size=32)
    step = lambda: loss_fn(model(x), y).backward()
    how = dict(fake=True, timing="safe") if sys.argv[1] == "fake-safe" else {}
    convs = []
    for _ in range(3):
        prof = libra.profile(model, step, **how)
        model.zero_grad(set_to_none=True)
        convs.append(sum(o.seconds for o in prof.ops if o.name.startswith("aten.convolution")))
    print(convs[0] / min(convs[1:]))
""")


@pytest.mark.parametrize("kind", ["real", "fake-safe"])
def test_a_first_step_profile_times_convolutions_like_a_later_one(kind):
    # Without the untimed first calls the first profile of a process timed the test ResNet's convolutions 2.3x a
    # later profile's on this 2-core machine (oneDNN creates each primitive on first use; a fake profile's timed
    # step is the first real one too: its eager step 1.8x); with them, 0.9-1.1x. Timing on a shared machine spikes
    # at random (a full suite on this machine once saw 1.7-2.1x in three runs in a row, 0.9-1.1x alone after), so
    # the process runs up to five times; one run within 1.6x passes.
    ratios = []
    for _ in range(5):
        out = subprocess.run([sys.executable, "-c", _FIRST_STEP, kind], capture_output=True, text=True, check=True)
        ratios.append(float(out.stdout.split()[-1]))
        if ratios[-1] < 1.6:
            return
    raise AssertionError(f"first-profile convolution time over a later profile's ({kind}): {ratios}")


def test_a_sparse_gradient_profiles():
    # a sparse tensor has no strides to key a signature on: its ops are never run twice
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16, sparse=True), torch.nn.Linear(16, 4))
    x = torch.randint(0, 100, (8, 5))
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2), (3,), check_invariants=True)
    assert _warm(torch.ops.aten.add.Tensor, sparse, sparse) == []
    prof = libra.profile(model, lambda: model(x).sum().backward())
    assert model[0].weight.grad.layout == torch.sparse_coo and prof.ops
