"""A (model, step) factory for `libra profile examples/gpt_factory.py:make`."""

from libra.testing import models


def make():
    model, x, y, loss_fn = models.make_gpt(batch=4, layers=6, d=128, seq=128)

    def step():
        loss_fn(model(x), y).backward()

    return model, step
