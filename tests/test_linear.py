"""The linear product the layers use: F.linear's result in every orientation and shape it takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.layers.linear import FEW_ROWS, linear


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


@pytest.mark.parametrize("rows", [1, 2, 4, FEW_ROWS, FEW_ROWS + 1])
def test_few_rows_in_any_layout_give_a_row_major_result(rows):
    """A product's input may be a transposed view (another op's output); the result is F.linear's and row-major
    whatever the input's layout, so that the next product gets row-major rows: MKL's few-row kernel read a
    transposed input 2-3x slower (docs/performance.md, session 28)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(72, 48, generator=gen)
    for x in (torch.randn(rows, 48, generator=gen), torch.randn(48, rows, generator=gen).T):
        got = linear(x, w)
        assert got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_keeps_autograd_and_other_dtypes_on_f_linear():
    x = torch.randn(2, 8, requires_grad=True)
    w = torch.randn(4, 8)
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))
    half = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_store_kv_writes_the_full_projections_keys_and_values(qk_norm):
    """A decoder attention's store_kv projects k and v alone (the weight's rows after q's) and writes them
    rotated (k normed first with Qwen3's q/k norm) to their slots, as the whole q/k/v projection would: 4
    query heads per KV head, bias on, rows at scattered positions and slots; on CUDA through the fused kernel."""
    from specserve.layers.rotary import RotaryEmbedding
    from specserve.models.config import DecoderShape
    from specserve.models.llama import DecoderAttention

    from .conftest import DEVICE

    dev = torch.device(DEVICE["name"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = DecoderShape(vocab_size=32, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=2,
                         head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, 256, 10000.0, None)
    attn = DecoderAttention(shape, rotary, qkv_bias=True, qk_norm=qk_norm, layer=1)
    for p in attn.parameters():
        p.data.normal_(0, 0.2)
    attn = attn.to(dev, dtype)
    x = torch.randn(7, 128, device=dev, dtype=dtype)
    positions = torch.tensor([0, 5, 9, 100, 101, 37, 255], device=dev)
    slots = torch.tensor([3, 11, 4, 60, 0, 12, 40], device=dev)
    cache = torch.full((2, 2, 64, 2, 32), float("nan"), device=dev, dtype=dtype)
    attn.store_kv(x, positions, slots, cache)
    q, k, v = attn._project(x)
    _, want_k = rotary.to(dev)(positions, q, k)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1, 0, slots].float(), want_k.float(), **tol)
    torch.testing.assert_close(cache[1, 1, slots].float(), v.float(), **tol)
    unwritten = torch.ones(64, dtype=torch.bool, device=dev)
    unwritten[slots] = False
    assert cache[1][:, unwritten].isnan().all() and cache[0].isnan().all(), "wrote outside the given slots"
