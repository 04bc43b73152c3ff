"""The Triton paged-attention kernel against the torch backend: prefill chunks, decode, chains and trees.

Runs on CUDA (`--device cuda`); skipped on CPU-only machines without Triton.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.layers import triton_attention
from specserve.layers.attention import TritonBackend, build_metadata

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
    meta = TritonBackend().metadata(q_lens, seq_lens, tables, block_size, device, heads // kv_heads, masks)
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


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_norm_pair_is_two_norms_side_by_side(dtype):
    """EAGLE-3's layer input in one launch: what the embedding, two RMSNorms and a cat compute, bit for bit."""
    from specserve.layers import triton_ops
    from specserve.layers.norm import RMSNorm

    torch.manual_seed(0)
    dev, hidden = torch.device("cuda"), 192
    table = torch.randn(100, hidden, dtype=dtype, device=dev)
    h = torch.randn(7, hidden, dtype=dtype, device=dev) * 3
    ids = torch.tensor([5, 0, 99, 5, 17, 3, 64], device=dev)
    norms = [RMSNorm(hidden, 1e-5).to(dev, dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data = 1 + torch.randn(hidden, dtype=dtype, device=dev) * 0.1
    with torch.inference_mode():
        out = triton_ops.embed_norm_pair(ids, table, h, norms[0].weight, norms[1].weight, 1e-5)
        want = torch.cat([norms[0](table[ids]), norms[1](h)], dim=-1)
    assert torch.equal(out, want)


@needs_cuda
def test_keep_features_moves_rows_and_block_ends():
    """The follower's bookkeeping: this step's features into the requests' rows, block ends kept, padding
    rows (the scratch row) touching only scratch."""
    from specserve.layers import triton_ops

    torch.manual_seed(0)
    dev, dim, page = torch.device("cuda"), 2500, 4
    features = torch.randn(6, dim, device=dev)  # 5 requests + scratch
    block_features = torch.zeros(9, dim, device=dev)  # 8 blocks + scratch
    aux = torch.randn(4, dim, device=dev)
    rows = torch.tensor([3, 0, 5, 5], device=dev)  # two padding rows
    positions = torch.tensor([7, 0, 11, 3], device=dev)
    tables = torch.tensor([[2, 6, 1, 0], [4, 0, 0, 0], [7, 7, 7, 7], [1, 1, 1, 1]], dtype=torch.int32, device=dev)
    before = features.clone()
    triton_ops.keep_features(aux, features, block_features, rows, positions, tables, page)
    assert torch.equal(features[[3, 0]], aux[:2]) and torch.equal(features[[1, 2, 4]], before[[1, 2, 4]])
    assert torch.equal(block_features[6], aux[0])  # position 7 ends block 1 of row 0's table: block 6
    assert block_features[:8].abs().sum(-1).nonzero().flatten().tolist() == [6]


@needs_cuda
def test_gumbel_argmax_equals_the_torch_path(monkeypatch):
    """The fused seeded sample against argmax(filtered.double() + gumbel_noise): the same token in every row,
    -inf filtered rows, large ranges, ties (the lowest index), NaN (the first), extreme int64 seeds."""
    from specserve import SamplingParams
    from specserve.layers import triton_ops
    from specserve.layers.sampler import filtered_logits, gumbel_noise, seed_tensor, seeded_tokens

    dev, g = torch.device("cuda"), torch.Generator().manual_seed(0)  # inputs drawn on the CPU
    for vocab in (4096, 128256):
        for n in (1, 7, 64, 300):
            x = torch.randn(n, vocab, generator=g).to(dev)  # [n, V]
            x *= torch.logspace(-2, 3, n, device=dev).unsqueeze(1)  # temperatures 100 .. 0.001
            kth = x.topk(min(50, vocab), -1).values[:, -1:]  # [n, 1]
            x[::3] = x[::3].masked_fill(x[::3] < kth[::3], float("-inf"))  # top-k filtered rows
            seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g).to(dev)  # [n]
            positions = torch.randint(0, 10 ** 6 + 1, (n,), generator=g).to(dev)  # [n]
            seeds[:4] = torch.tensor([-1, -2 ** 63, 2 ** 63 - 1, 0][:n], device=dev)
            if n >= 7:
                x[1] = float("-inf")
                x[1, vocab - 3] = 0.0  # one finite token
                x[2, [vocab - 1, 5, vocab // 2]] = 1e30  # ties after the noise: the lowest index wins
                x[3] = float("-inf")  # nothing finite: token 0, as torch.argmax
                x[4, [vocab - 2, vocab // 3]] = float("nan")  # the first NaN, as torch.argmax
            got = triton_ops.gumbel_argmax(x, seeds, positions)
            want = (x.double() + gumbel_noise(seeds, positions, vocab)).argmax(-1)
            assert got.dtype == torch.long and torch.equal(got, want), (n, vocab, (got != want).nonzero().flatten())
            if n >= 7:
                assert got[1:5].tolist() == [vocab - 3, 5, 0, vocab // 3]

    logits = torch.randn(6, 128256, generator=g).to(dev) * 4
    params = [SamplingParams(seed=s, temperature=t, top_k=k, top_p=p) for s, t, k, p in
              [(3, 1.0, 0, 1.0), (-5, 0.7, 50, 1.0), (1 << 70, 1.3, 0, 0.9), (42, 1.0, 0, 1.0), (42, 0.5, 20, 0.8),
               ((1 << 64) - 1, 2.0, 0, 1.0)]]
    positions = torch.tensor([0, 17, 10 ** 6, 3, 4, 123456], device=dev)
    want = (filtered_logits(logits, params).double() + gumbel_noise(seed_tensor(params, dev), positions,
                                                                    128256)).argmax(-1)
    kernel, calls = triton_ops.gumbel_argmax, []
    monkeypatch.setattr(triton_ops, "gumbel_argmax", lambda *args: calls.append(1) or kernel(*args))
    assert torch.equal(seeded_tokens(logits, params, positions), want) and calls == [1]  # the kernel, on CUDA
