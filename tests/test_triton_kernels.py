"""The Triton paged-attention kernel against the torch backend: prefill chunks, decode, chains and trees.

Runs on CUDA (`--device cuda`); skipped on CPU-only machines without Triton.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.layers import triton_attention
from specserve.layers.attention import build_metadata

from .conftest import DEVICE

needs_cuda = pytest.mark.skipif(not triton_attention.available() or DEVICE["name"] != "cuda",
                                reason="the Triton kernel runs on CUDA")


def random_tree(q: int, rng: random.Random) -> torch.Tensor:
    """[q, q] ancestor mask of a random tree over q nodes in topological order (node 0 = root)."""
    mask = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        mask[i] = mask[rng.randrange(i)]
        mask[i, i] = True
    return mask


def run_case(q_lens, ctx_lens, heads, kv_heads, head_dim, dtype, trees=False, block_size=16, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = torch.device(DEVICE["name"])
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks = list(range(sum(-(-n // block_size) for n in seq_lens) + 4))
    rng.shuffle(blocks)
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(blocks[used:used + need])
        used += need
    slots = len(blocks) * block_size
    cache = torch.randn(2, slots, kv_heads, head_dim, dtype=dtype, device=device)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(total, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(total, kv_heads, head_dim, dtype=dtype, device=device)
    masks = [random_tree(n, rng) if trees and n > 1 else None for n in q_lens] if trees else None
    scale = head_dim ** -0.5
    ref_cache = cache.clone()
    ref = build_metadata(q_lens, seq_lens, tables, block_size, device, masks).attend(q, k, v, ref_cache, scale)
    meta = build_metadata(q_lens, seq_lens, tables, block_size, device, masks, backend="triton",
                          group=heads // kv_heads)
    out = meta.attend(q, k, v, cache, scale)
    assert torch.equal(cache, ref_cache), "KV written to different slots"
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32), (32, 8, 128), (4, 4, 24)])
def test_decode_and_prefill(heads, kv_heads, head_dim):
    run_case([1, 1, 1], [5, 40, 200], heads, kv_heads, head_dim, torch.float32)
    run_case([37, 1, 130, 4], [0, 17, 64, 3], heads, kv_heads, head_dim, torch.float32)
    run_case([300, 1], [100, 1000], heads, kv_heads, head_dim, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("q", [2, 4, 8, 16])
def test_trees(q):
    run_case([q, q, 1, q], [10, 100, 33, 0], 6, 2, 32, torch.float32, trees=True, seed=q)
    run_case([q] * 5, [70, 3, 15, 16, 17], 32, 8, 128, torch.bfloat16, trees=True, seed=q + 1)


def test_bitmask_uses_every_bit():
    tree = torch.zeros(2, 64, dtype=torch.bool)
    tree[0, 63] = True
    tree[1, :] = True
    assert triton_attention.tree_bitmask(tree).tolist() == [-(1 << 63), -1]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels(dtype):
    """Each fused kernel against the PyTorch code it replaces (fresh random inputs, poisoned outputs)."""
    import torch.nn.functional as F

    from specserve.layers import triton_ops
    from specserve.layers.norm import RMSNorm
    from specserve.layers.rotary import RotaryEmbedding, _rotate_half

    dev, tol = torch.device("cuda"), (1e-5 if dtype == torch.float32 else 2e-2)
    x, r = torch.randn(7, 4096, dtype=dtype, device=dev), torch.randn(7, 4096, dtype=dtype, device=dev)
    norm = RMSNorm(4096, 1e-5).to(dev, dtype)
    norm.weight.normal_()
    out, stream = triton_ops.add_rms_norm(x, r, norm.weight, 1e-5)
    assert torch.equal(stream, x + r)
    assert (out.float() - norm._norm(x + r).float()).norm() / out.float().norm() < tol
    g = torch.randn(5, 2 * 14336, dtype=dtype, device=dev)
    ref = F.silu(g[:, :14336]) * g[:, 14336:]
    assert (triton_ops.silu_and_mul(g).float() - ref.float()).norm() / ref.float().norm() < tol
    rot = RotaryEmbedding(128, 4096, 500000.0, None).to(dev)
    q, pos = torch.randn(9, 32, 128, dtype=dtype, device=dev), torch.randint(0, 4096, (9,), device=dev)
    cos, sin = rot.cos[pos].unsqueeze(1).to(dtype), rot.sin[pos].unsqueeze(1).to(dtype)
    ref = q * cos + _rotate_half(q) * sin
    got = triton_ops.rotary_(q.clone(), pos, rot.cos, rot.sin)
    assert (got.float() - ref.float()).norm() / ref.float().norm() < tol


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write(dtype):
    """q rotated in place and rotated k, v written to their slots, as rotary + cache scatter do."""
    from specserve.layers import triton_ops
    from specserve.layers.rotary import RotaryEmbedding, _rotate_half

    dev, tol = torch.device("cuda"), (1e-6 if dtype == torch.float32 else 2e-2)
    rot = RotaryEmbedding(128, 4096, 500000.0, None).to(dev)
    qkv = torch.randn(9, (32 + 8 + 8) * 128, dtype=dtype, device=dev)  # views, as the model has them
    q, k, v = qkv[:, :4096].view(9, 32, 128), qkv[:, 4096:5120].view(9, 8, 128), qkv[:, 5120:].view(9, 8, 128)
    pos, slots = torch.randint(0, 4096, (9,), device=dev), torch.randperm(64, device=dev)[:9]
    cos, sin = rot.cos[pos].unsqueeze(1).to(dtype), rot.sin[pos].unsqueeze(1).to(dtype)
    want_q, want_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    cache = torch.full((2, 64, 8, 128), float("nan"), dtype=dtype, device=dev)
    triton_ops.rope_and_cache(q, k, v, pos, rot.cos, rot.sin, cache, slots)
    assert (q.float() - want_q.float()).norm() / want_q.float().norm() < tol
    assert (cache[0, slots].float() - want_k.float()).norm() / want_k.float().norm() < tol
    assert torch.equal(cache[1, slots], v)
    untouched = torch.ones(64, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert cache[:, untouched].isnan().all(), "wrote outside the given slots"
