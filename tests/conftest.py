import copy
import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run unless asked otherwise (HYPOTHESIS_PROFILE=explore):
# CI must not fail on a draw no one can reproduce locally. Exploring finds new cases; each found case becomes a
# regression test of its own.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import libra
from libra.testing import AllocatorMeter, assert_grads_equal, models

MODELS = {
    "mlp": lambda: models.make_mlp(batch=2048, d=128, hidden=512, depth=6),
    "gpt": lambda: models.make_gpt(batch=4, layers=6, d=128, seq=128, dropout=0.1),
    "resnet": lambda: models.make_resnet(batch=8, size=32),
}


class Case:
    """One model, a profile of it, and the means to train an eager copy and a Libra copy side by side.

    The same tensors are live whenever a Libra step starts as when the profile was taken: every case's base model,
    eager copy and Libra copy, none holding gradients (SGD without momentum keeps no state). ``take_profile`` runs
    once all cases exist (the ``case`` fixture), so the order tests first ask for them does not matter.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.base, self.x, self.y, self.loss_fn = MODELS[name]()
        self.eager = copy.deepcopy(self.base)
        self.ours = copy.deepcopy(self.base)

    def take_profile(self) -> None:
        # after a warm-up step, as the README advises: a first step's kernel temporaries depend on what ran before
        # it in the process (oneDNN creates a convolution's primitive, and its scratch memory, on first use), and
        # the profile, with the plans tests compare, would depend on which tests ran first
        for model in (self.eager, self.ours):
            torch.manual_seed(1)
            self.loss_fn(model(self.x), self.y).backward()
            model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        self.profile = libra.profile(self.ours, lambda: self.loss_fn(self.ours(self.x), self.y).backward())
        torch.manual_seed(1234)
        self.loss_fn(self.eager(self.x), self.y).backward()
        assert_grads_equal(self.eager, self.ours)
        self.reset()

    def reset(self) -> None:
        self.eager = copy.deepcopy(self.base)
        self.ours = copy.deepcopy(self.base)

    def train(self, plan, steps: int = 3):
        """Trains both copies for ``steps`` SGD steps; returns the Libra steps' meters. Asserts bit-equality."""
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (self.eager, self.ours)]
        meters = []
        for i in range(steps):
            torch.manual_seed(100 + i)
            with AllocatorMeter(extra=list(self.ours.parameters())) as meter:
                with libra.apply(self.ours, plan):
                    loss_o = self.loss_fn(self.ours(self.x), self.y)
                    loss_o.backward()
            meters.append(meter)
            torch.manual_seed(100 + i)
            loss_e = self.loss_fn(self.eager(self.x), self.y)
            loss_e.backward()
            assert torch.equal(loss_e, loss_o)
            assert_grads_equal(self.eager, self.ours)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss_o, loss_e  # live tensors at the next step's start must be what they were when profiled
        assert_grads_equal(self.eager, self.ours)
        return meters


_CASES: dict[str, Case] = {}


@pytest.fixture(params=sorted(MODELS))
def case(request):
    if not _CASES:
        # every case's models first, then the profiles: each profile's static bytes then count the same live
        # tensors (all cases' models), whichever case a test uses first
        _CASES.update((name, Case(name)) for name in sorted(MODELS))
        for c in _CASES.values():
            c.take_profile()
    c = _CASES[request.param]
    c.reset()
    return c


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a shared
    2-core machine OpenMP's spinning makes tiny models several times slower, and eager/Libra comparisons do not
    depend on the thread count (both copies run with the same one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
