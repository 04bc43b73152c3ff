"""The linear product the layers use: F.linear's result in every orientation and shape it takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.layers.linear import linear


@pytest.mark.parametrize("shape", [(1, 48), (4, 48), (3, 1, 48), (2, 5, 48), (300, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear(shape, bias):
    """One row (F.linear itself), a few rows, leading dimensions, many rows; with and without bias."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(72, 48, generator=gen)
    b = torch.randn(72, generator=gen) if bias else None
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 72)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_autograd_and_other_dtypes_on_f_linear():
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(4, 8)
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))
    half = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))
