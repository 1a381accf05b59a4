"""libra.testing's comparison helpers: bit-identical means the same bits."""

import pytest
import torch

from libra.testing import assert_grads_equal, bit_equal


def test_bit_equal_compares_bits_not_values():
    nan = torch.tensor([float("nan"), 1.0])
    assert bit_equal(nan, nan.clone())  # torch.equal says a NaN differs from itself
    assert not torch.equal(nan, nan.clone())
    assert not bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    assert not bit_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not bit_equal(torch.ones(2), torch.ones(1, 2))
    z = torch.randn(3, 4, dtype=torch.complex64)
    assert bit_equal(z.t(), z.clone().t()) and not bit_equal(z, z + 1e-3)
    assert bit_equal(torch.arange(4), torch.arange(4)) and not bit_equal(torch.arange(4), torch.arange(1, 5))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    a(torch.ones(1, 2)).sum().backward()
    b(torch.ones(1, 2)).sum().backward()
    assert_grads_equal(a, b)
    with torch.no_grad():
        b.bias.grad[0] = -b.bias.grad[0] if b.bias.grad[0] != 0 else -0.0
    with pytest.raises(AssertionError, match="bias.grad differs"):
        assert_grads_equal(a, b)
