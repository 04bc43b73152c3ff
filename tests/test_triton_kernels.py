"""The Triton paged-attention kernel against the torch backend: prefill chunks, decode, chains and trees, with
and without key splits (split-K); split-K in CUDA graphs replayed at new lengths; the split rule.

Runs on CUDA (`--device cuda`); the attention tests also on CPU under Triton's interpreter (TRITON_INTERPRET=1,
where half precision is fp16: the interpreter does bf16 arithmetic on the raw bits); else skipped.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve.device import Constants
from specserve.engine.cuda_graph import capture_all
from specserve.layers import triton_attention
from specserve.layers.attention import TritonBackend, build_metadata
from specserve.layers.triton_split import splits_for

from .conftest import DEVICE, INTERPRET, kernel_marks

needs_kernels, needs_cuda = kernel_marks()
HALF = torch.float16 if INTERPRET else torch.bfloat16


def random_tree(q: int, rng: random.Random) -> torch.Tensor:
    """[q, q] ancestor mask of a random tree over q nodes in topological order (node 0 = root)."""
    mask = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        mask[i] = mask[rng.randrange(i)]
        mask[i, i] = True
    return mask


def random_tables(seq_lens, block_size, rng, num_blocks=None):
    """Block tables of sequences of seq_lens keys over shuffled blocks (4 spare blocks unless num_blocks given)."""
    needs = [-(-n // block_size) for n in seq_lens]
    blocks = list(range(num_blocks if num_blocks is not None else sum(needs) + 4))
    rng.shuffle(blocks)
    starts = [sum(needs[:i]) for i in range(len(needs))]
    return [blocks[s:s + n] for s, n in zip(starts, needs)], len(blocks)


def reference(q_lens, seq_lens, tables, block_size, masks, q, k, v, cache, scale, skip_first=False):
    """The torch backend's attention (writes k, v into cache)."""
    meta = build_metadata(q_lens, seq_lens, tables, block_size, cache.device, masks)
    return (meta.without_first_key() if skip_first else meta).attend(q, k, v, cache, scale)


def run_case(q_lens, ctx_lens, heads, kv_heads, head_dim, dtype, trees=False, block_size=16, seed=0,
             num_splits=None, skip_first=False):
    """The kernel (num_splits: forced key splits, else the backend's choice) against the torch backend."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = torch.device(DEVICE["name"])
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    tables, num_blocks = random_tables(seq_lens, block_size, rng)
    cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=device)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(total, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(total, kv_heads, head_dim, dtype=dtype, device=device)
    masks = [random_tree(n, rng) if trees and n > 1 else None for n in q_lens] if trees else None
    scale = head_dim ** -0.5
    ref_cache = cache.float()  # the reference computes in fp32 over the same (rounded) values
    ref = reference(q_lens, seq_lens, tables, block_size, masks, q.float(), k.float(), v.float(), ref_cache, scale,
                    skip_first)
    if num_splits is None:
        meta = TritonBackend().metadata(q_lens, seq_lens, tables, block_size, device, heads // kv_heads, masks)
    else:
        meta = triton_attention.build_triton_metadata(q_lens, seq_lens, tables, block_size, device, heads // kv_heads,
                                                      masks, num_splits=num_splits)
    out = (meta.without_first_key() if skip_first else meta).attend(q, k, v, cache, scale)
    assert torch.equal(cache.float(), ref_cache), "KV written to different slots"
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32), (32, 8, 128), (4, 4, 24)])
def test_decode_and_prefill(heads, kv_heads, head_dim):
    run_case([1, 1, 1], [5, 40, 200], heads, kv_heads, head_dim, torch.float32)
    run_case([37, 1, 130, 4], [0, 17, 64, 3], heads, kv_heads, head_dim, torch.float32)
    run_case([300, 1], [100, 1000], heads, kv_heads, head_dim, HALF)


@needs_kernels
@pytest.mark.parametrize("q", [2, 4, 8, 16])
def test_trees(q):
    run_case([q, q, 1, q], [10, 100, 33, 0], 6, 2, 32, torch.float32, trees=True, seed=q)
    run_case([q] * 5, [70, 3, 15, 16, 17], 32, 8, 128, HALF, trees=True, seed=q + 1)


def test_bitmask_uses_every_bit():
    tree = torch.zeros(2, 64, dtype=torch.bool)
    tree[0, 63] = True
    tree[1, :] = True
    assert triton_attention.tree_bitmask(tree).tolist() == [-(1 << 63), -1]



SPLIT_CASES = {  # (q_lens, ctx_lens, trees): contexts from empty to a few chunks (later splits empty)
    "decode": ([1, 1, 1, 1], [0, 5, 70, 300], False),
    "chain": ([4, 4, 4], [0, 63, 250], False),
    "tree": ([8, 8, 1, 8], [2, 100, 33, 290], True),
    "prefill": ([40, 1, 40], [0, 200, 130], False),
}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", list(SPLIT_CASES))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_splits(num_splits, kind, dtype):
    """Split-K is exact: every forced number of splits gives the torch backend's attention (GQA group 3 padded
    to 4 rows; prefill tiles of one sequence with different kv ends)."""
    q_lens, ctx_lens, trees = SPLIT_CASES[kind]
    run_case(q_lens, ctx_lens, 6, 2, 32, dtype, trees=trees, num_splits=num_splits, seed=num_splits)


@needs_kernels
@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("kind", list(SPLIT_CASES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_loaded_ahead(monkeypatch, num_splits, kind, ahead):
    """Page numbers loaded a tile ahead of their keys (PAGES_AHEAD, the default) or in the walk give the same
    attention, the last tile's look-ahead past the end masked."""
    monkeypatch.setattr(triton_attention, "PAGES_AHEAD", ahead)
    q_lens, ctx_lens, trees = SPLIT_CASES[kind]
    run_case(q_lens, ctx_lens, 6, 2, 32, torch.float32, trees=trees, num_splits=num_splits, seed=num_splits)
    run_case([1, 1, 1], [5, 40, 200], 32, 8, 128, HALF, num_splits=num_splits)


@needs_kernels
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("kind", list(SPLIT_CASES))
def test_tiles_indexed_without_loads(monkeypatch, kind, uniform):
    """Steps whose sequences all have q queries and one tile (decode, a chain's verify) index their tiles and
    first tokens from the program id (UNIFORM_TILES, the default) or load them: the same attention."""
    monkeypatch.setattr(triton_attention, "UNIFORM_TILES", uniform)
    q_lens, ctx_lens, trees = SPLIT_CASES[kind]
    device = torch.device(DEVICE["name"])
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    tables, _ = random_tables(seq_lens, 16, random.Random(0))
    meta = triton_attention.build_triton_metadata(q_lens, seq_lens, tables, 16, device, 3)
    assert meta.uniform_q == {"decode": 1, "chain": 4}.get(kind, 0)
    for num_splits in (1, 3):
        run_case(q_lens, ctx_lens, 6, 2, 32, torch.float32, trees=trees, num_splits=num_splits, seed=num_splits)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 24), (8, 2, 16), (2, 1, 192)])
@pytest.mark.parametrize("skip_first", [False, True])
def test_splits_shapes_and_skip_first(heads, kv_heads, head_dim, skip_first):
    """Head sizes that are not a power of two, wide heads (BLOCK_N 32), the EAGLE-3 draft's hidden key 0."""
    run_case([1, 5, 1], [1, 90, 260], heads, kv_heads, head_dim, torch.float32, trees=True, num_splits=4,
             skip_first=skip_first)


@needs_kernels
def test_splits_long_context():
    run_case([1, 8], [3000, 2500], 4, 2, 32, torch.float32, trees=True, num_splits=8)


LONG_CASES = {  # (q_lens, ctx_lens, trees) at the 8B shape's heads, up to 32k keys
    "decode": ([1, 1], [32768, 16000], False),
    "tree": ([8, 4], [32760, 9000], True),
    "prefill": ([512, 1], [31744, 4096], False),
}


@needs_cuda
@pytest.mark.parametrize("kind", list(LONG_CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 8, 64, 128])
def test_long_contexts(kind, num_splits):
    """Contexts up to 32k keys in bf16 against fp32 attention, at the backend's split choice and forced ones."""
    q_lens, ctx_lens, trees = LONG_CASES[kind]
    run_case(q_lens, ctx_lens, 32, 8, 128, torch.bfloat16, trees=trees, num_splits=num_splits, seed=len(kind))


def test_splits_for():
    """At most one wave of programs (3 x 132 on an H100 / H200) or MIN_WAVES of them, never 1.3."""
    assert splits_for(1, 8, 16384, 64) == 32  # batch 1 of an 8B Llama: 8 programs -> 256; 64 would make 1.3 waves
    assert splits_for(1, 8, 32768, 64) == 32
    assert splits_for(16, 8, 4096, 64) == 2  # 128 -> 256
    assert splits_for(64, 8, 4096, 64) == 4  # 512 programs are 1.3 waves: 2,048 are 5.2
    assert splits_for(64, 8, 16384, 64) == 4
    assert splits_for(256, 8, 256, 64) == 1  # 2,048 programs: 5.2 waves already
    assert splits_for(128, 8, 288, 64) == 1  # 2.6 waves, but 5 blocks make no splits of 4 or more
    assert splits_for(2, 8, 16384, 64, sms=78) == 8  # 16 programs -> 128 of one wave of 234
    assert splits_for(1, 8, 400, 64) == 8  # short context: a block a split (7, rounded up), 64 programs
    assert splits_for(1, 8, 6 * 4 * 64, 64) == 32  # 24 blocks -> 32 splits: 256 programs
    assert splits_for(16, 8, 320, 64) == 1  # 128 programs: 3 splits would fill the wave, too few to pay
    assert splits_for(8, 8, 320, 64) == 4  # 64 programs: 4 splits of 2 blocks (5 blocks)
    assert splits_for(1, 8, 6 * 4 * 64, 64, resident=1) == 16  # one wave of 132: 16, more than 4 blocks allow (6)
    assert splits_for(1, 8, 100_000, 32) == 32  # 49 would fill the wave; a power of two below
    assert splits_for(3, 8, 100_000, 64) == 16  # 24 programs -> 384
    assert splits_for(1, 1, 10 ** 6, 64) == 64  # at most 64


def test_metadata_chooses_splits():
    """From the step's tiles and longest context, or (CUDA graphs) the longest context its block tables hold;
    the KV heads and head size from the cache."""
    cpu, cache = torch.device("cpu"), torch.empty(1, 2, 16, 8, 128)
    build = triton_attention.build_triton_metadata
    assert build([1], [16384], [list(range(1024))], 16, cpu, 4, kv_cache=cache).num_splits == 32
    assert build([1] * 64, [16384] * 64, [list(range(1024))] * 64, 16, cpu, 4, kv_cache=cache).num_splits == 4
    assert build([1], [300], [list(range(19))], 16, cpu, 4, kv_cache=cache).num_splits == 8
    assert build([1], [16384], [list(range(1024))], 16, cpu, 4).num_splits == 1  # no cache: no shapes
    assert build([1], [16384], [list(range(1024))], 16, cpu, 4, kv_cache=cache, num_splits=3).num_splits == 3

    def static(bs, width):
        i32 = dict(dtype=torch.int32)
        return triton_attention.static_triton_metadata(
            torch.zeros(bs, dtype=torch.long), torch.zeros(bs, width, **i32), torch.zeros(bs, **i32),
            torch.ones(bs, **i32), torch.zeros(bs, dtype=torch.long), torch.zeros(bs, **i32), 1, 4, 16, cache, False,
            Constants(cache.device)).num_splits

    assert (static(1, 1024), static(2, 1024), static(32, 1024), static(66, 1024), static(1, 8)) == (32, 16, 1, 4, 1)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q,num_splits", [(1, None), (1, 8), (4, 3)])
def test_split_cuda_graph_replays_new_lengths(q, num_splits, dtype):
    """Split-K captured in a CUDA graph at a fixed num_splits, replayed at longer and shorter contexts than at
    capture (some splits empty) and with padding rows: what eager attention and the torch backend compute."""
    dev, bs, heads, kv_heads, head_dim, page, width = torch.device(DEVICE["name"]), 3, 8, 2, 64, 16, 64
    group, scale, rng = heads // kv_heads, head_dim ** -0.5, random.Random(q)
    torch.manual_seed(q)
    scratch_slot = bs * width * page  # a block past the tables' pool
    cache = torch.randn(2, scratch_slot + page, kv_heads, head_dim, dtype=dtype, device=dev)
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.long, device=dev)
    slots, bits = torch.zeros(bs * q, **i64), torch.zeros(bs * q, **i64)
    tables, seq_lens, tree_lens = torch.zeros(bs, width, **i32), torch.zeros(bs, **i32), torch.zeros(bs, **i32)
    xq = torch.zeros(bs * q, heads, head_dim, dtype=dtype, device=dev)
    xk, xv = (torch.zeros(bs * q, kv_heads, head_dim, dtype=dtype, device=dev) for _ in range(2))
    meta = triton_attention.static_triton_metadata(slots, tables, seq_lens, torch.full((bs,), q, **i32), bits,
                                                   tree_lens, q, group, page, cache[None], False, Constants(dev),
                                                   num_splits)
    assert meta.num_splits == (num_splits or 16)  # auto: 6 programs; 1024 keys at most: 16 blocks, one a split

    def fill(ctx_lens):  # a step of len(ctx_lens) <= bs sequences, the rest padding rows
        from specserve.layers.attention import new_token_slots, padded_tables

        real = len(ctx_lens)
        q_lens, lens = [q] * real, [c + q for c in ctx_lens]
        tabs, _ = random_tables(lens, page, rng, num_blocks=bs * width)
        trees = [random_tree(q, rng) for _ in range(real)] if q > 1 else None
        slots.fill_(scratch_slot)
        slots[:real * q].copy_(torch.tensor(new_token_slots(q_lens, lens, tabs, page)))
        table = padded_tables(tabs)
        tables.zero_()
        tables[:real, :table.shape[1]].copy_(table)
        seq_lens.zero_()
        seq_lens[:real].copy_(torch.tensor(lens))
        bits.zero_()
        tree_lens.zero_()
        if trees:
            bits[:real * q].copy_(triton_attention.tree_bits(trees, q_lens, dev))
            tree_lens[:real] = q
        for x in (xq, xk, xv):
            x.normal_()
        return q_lens, lens, tabs, trees

    fill([500, 40, 9])
    graphs, outputs = capture_all([()], lambda: meta.attend(xq, xk, xv, cache, scale))
    graph, out = graphs[()], outputs[()]
    for ctx_lens in ([1024 - q, 7, 600], [3, 0], [130, 1000 - q, 64], [0]):
        q_lens, lens, tabs, trees = fill(ctx_lens)
        n = len(lens) * q
        before = cache.clone()
        graph.replay()
        eager = triton_attention.build_triton_metadata(q_lens, lens, tabs, page, dev, group, trees,
                                                       num_splits=meta.num_splits)
        want = eager.attend(xq[:n], xk[:n], xv[:n], before.clone(), scale)
        ref = reference(q_lens, lens, tabs, page, trees, xq[:n], xk[:n], xv[:n], before, scale)
        torch.testing.assert_close(out[:n], want)
        err = (out[:n].float() - ref.float()).norm() / ref.float().norm()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (ctx_lens, err)

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels(dtype):
    """Each fused kernel against the PyTorch code it replaces (fresh random inputs, poisoned outputs)."""
    import torch.nn.functional as F

    from specserve.layers import triton_ops
    from specserve.layers.norm import RMSNorm
    from specserve.layers.rotary import RotaryEmbedding, _rotate_half

    dev, tol = torch.device(DEVICE["name"]), (1e-5 if dtype == torch.float32 else 2e-2)
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


@needs_kernels
@pytest.mark.parametrize("m,launch", [(1, (8, 64, 4, 2)), (3, (8, 64, 4, 2)), (4, (32, 64, 4, 2, True)),
                                      (9, (16, 128, 4, 2, True))])
def test_gemv_rotates_q_and_k_and_writes_the_cache_as_rope_and_cache_does(m, launch):
    """A q/k/v product (input normed, with bias) whose epilogue rotates q and k and writes k and v to their
    cache slots: Y and the cache as the product then `rope_and_cache` leave them, and no other slot written
    (4 query heads and 2 kv heads of 32; pairs of rotate-half columns in one program)."""
    from specserve.layers import triton_gemv, triton_ops
    from specserve.layers.rotary import RotaryEmbedding

    dev, dtype = torch.device(DEVICE["name"]), HALF
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, hidden = 4, 2, 32, 96
    rot = RotaryEmbedding(dim, 512, 10000.0, None).to(dev)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) * 0.1).to(dev, dtype)
    bias, norm_w = (torch.randn(w.shape[0], generator=gen) * 0.1).to(dev, dtype), torch.randn(hidden).to(dev, dtype)
    x = torch.randn(m, hidden, generator=gen).to(dev, dtype)
    parts = x.float().pow(2).sum(1, keepdim=True)  # [m, 1]
    pos, slots = torch.randint(0, 512, (m,), generator=gen).to(dev), torch.randperm(32, generator=gen)[:m].to(dev)
    empty = torch.full((2, 32, kv_heads, dim), float("nan"), dtype=dtype, device=dev)
    x, rms = x * norm_w, (parts, 1e-6)
    want, want_cache = triton_gemv.gemv(x, w, bias, launch, rms=rms), empty.clone()
    q, kk, v = want[:, :heads * dim], want[:, heads * dim:(heads + kv_heads) * dim], want[:, (heads + kv_heads) * dim:]
    triton_ops.rope_and_cache(q.view(m, heads, dim), kk.view(m, kv_heads, dim), v.view(m, kv_heads, dim), pos,
                              rot.cos, rot.sin, want_cache, slots)
    kk.view(m, kv_heads, dim).copy_(want_cache[0, slots])  # the rotated keys, where the fused product leaves them
    cache = empty.clone()
    got = triton_gemv.gemv(x, w, bias, launch, rms=rms,
                           rope=triton_gemv.RopeWrite(rot.cos, rot.sin, pos, cache, slots, heads, kv_heads, dim))
    for a, b in [(got, want), (cache[:, slots], want_cache[:, slots])]:
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
    assert torch.equal(got[:, (heads + kv_heads) * dim:], want[:, (heads + kv_heads) * dim:])
    untouched = torch.ones(32, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert cache[:, untouched].isnan().all(), "wrote outside the given slots"
    with pytest.raises(ValueError, match="paired epilogue"):
        triton_gemv.gemv(x, w, bias, (64, 64, 4, 2, True), rms=rms,
                         rope=triton_gemv.RopeWrite(rot.cos, rot.sin, pos, cache, slots, heads, kv_heads, dim))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write(dtype):
    """q rotated in place and rotated k, v written to their slots, as rotary + cache scatter do."""
    from specserve.layers import triton_ops
    from specserve.layers.rotary import RotaryEmbedding, _rotate_half

    dev, tol = torch.device(DEVICE["name"]), (1e-6 if dtype == torch.float32 else 2e-2)
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


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("per", [0, 1, 3])
def test_rope_and_cache_norms_q_and_k_per_head(monkeypatch, dtype, per):
    """Qwen3's q/k norm fused in: each head of q and k RMS-normed (RMSNorm's roundings), then rotated, as
    RMSNorm on [T, heads, D] then rotary do (4 heads of 64, 2 kv heads; q and k scaled off unit size), with
    every head in one program or `per` q heads a program (1: programs without a kv head; 3: groups of 3 and 1)."""
    from specserve.layers import triton_ops
    from specserve.layers.norm import RMSNorm
    from specserve.layers.rotary import RotaryEmbedding

    monkeypatch.setattr(triton_ops, "ROPE_HEADS", per)

    dev, tol = torch.device(DEVICE["name"]), (1e-5 if dtype == torch.float32 else 1e-2)
    rot = RotaryEmbedding(64, 512, 1000000.0, None).to(dev)
    qkv = 3 * torch.randn(5, (4 + 2 + 2) * 64, dtype=dtype, device=dev)
    q, k, v = qkv[:, :256].view(5, 4, 64), qkv[:, 256:384].view(5, 2, 64), qkv[:, 384:].view(5, 2, 64)
    norms = [RMSNorm(64, 1e-6).to(dev, dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.normal_()
    pos, slots = torch.randint(0, 512, (5,), device=dev), torch.randperm(16, device=dev)[:5]
    want_q, want_k = rot(pos, norms[0]._norm(q), norms[1]._norm(k))
    cache = torch.full((2, 16, 2, 64), float("nan"), dtype=dtype, device=dev)
    triton_ops.rope_and_cache(q, k, v, pos, rot.cos, rot.sin, cache, slots, (norms[0].weight, norms[1].weight, 1e-6))
    assert (q.float() - want_q.float()).norm() / want_q.float().norm() < tol
    assert (cache[0, slots].float() - want_k.float()).norm() / want_k.float().norm() < tol
    assert torch.equal(cache[1, slots], v)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("n,k", [(96, 512), (40, 300), (8, 1000)])
def test_gemv_is_the_linear_and_rows_do_not_change_each_other(dtype, n, k):
    """x @ W.T (+ bias) for 1-4 rows, against fp32 F.linear (K not a multiple of the block, N not a multiple of
    the strip; weights and rows as strided views); each row's bits are the same computed alone or beside
    others (the sums over K run in the same blocks)."""
    import torch.nn.functional as F

    from specserve.layers import triton_gemv

    dev, tol = torch.device(DEVICE["name"]), (1e-5 if dtype == torch.float32 else 1e-2)
    w = torch.randn(n, k + 8, dtype=dtype, device=dev)[:, 4:k + 4]  # rows of W strided
    bias = torch.randn(n, dtype=dtype, device=dev)
    x = torch.randn(4, k, dtype=dtype, device=dev)
    x = torch.randn(16, k, dtype=dtype, device=dev)
    launches = [triton_gemv.ONE_ROW, triton_gemv.NARROW_ONE_ROW, (16, 128, 4, 2), (4, 256, 2, 5)]
    if dtype != torch.float32:  # tensor cores: half precision (fp32 would multiply in tf32)
        launches += [(32, 128, 4, 3, True), (16, 256, 4, 2, True)]
    for m in (1, 2, 3, 4, 16):
        want = F.linear(x[:m].float(), w.float(), bias.float())
        for launch in launches:
            if m > (triton_gemv.MAX_DOT_ROWS if triton_gemv.Launch(*launch).dot else triton_gemv.MAX_ROWS):
                continue
            got = triton_gemv.gemv(x[:m], w, bias, launch=launch)
            assert got.shape == (m, n) and got.dtype == dtype
            assert (got.float() - want).norm() / want.norm() < tol, (m, launch)
    together = triton_gemv.gemv(x[:4], w)
    assert all(torch.equal(triton_gemv.gemv(x[i:i + 1], w)[0], together[i]) for i in range(4))
    assert triton_gemv.gemv(x[:2].view(2, 1, k), w).shape == (2, 1, n)
    with pytest.raises(ValueError, match="up to 4 rows"):
        triton_gemv.gemv(torch.randn(5, k, dtype=dtype, device=dev), w)


@needs_kernels
def test_gemv_takes_its_one_row_launches_as_plain_tuples(monkeypatch):
    """`benchmarks/recapture.py` sets module launches to tuples (`triton_gemv.NARROW_ONE_ROW=(4,2048,4,3)`): the
    default launch may be one, as a given launch may."""
    import torch.nn.functional as F

    from specserve.layers import triton_gemv

    dev = torch.device(DEVICE["name"])
    w, x = torch.randn(16, 96, device=dev), torch.randn(1, 96, device=dev)
    for name in ("ONE_ROW", "NARROW_ONE_ROW"):
        monkeypatch.setattr(triton_gemv, name, (4, 64, 4, 3))
    torch.testing.assert_close(triton_gemv.gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m,launch", [(1, (8, 32, 4, 2)), (3, (8, 32, 4, 2)), (4, (16, 32, 4, 2, True))])
def test_gemv_fuses_the_norm_the_gate_and_the_residual_as_the_kernels_apart_round(m, launch):
    """A decoder layer's products fused with what surrounds them: the residual added after a product (its sum
    of squares in parts, the stream times the next norm's weight beside it); a product of that scaled stream
    divided by its rms, as the norm then the product; the gate/up product returning silu(gate) * up; against
    add_rms_norm, silu_and_mul and the sum computed apart (the same roundings; the norm's sum of squares in
    another order). K in two or more blocks."""
    from specserve.layers import triton_gemv, triton_ops

    dev, dtype = torch.device(DEVICE["name"]), HALF
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    hidden, inter = 96, 160
    w_o, w_down, w_gate_up = rand(hidden, 64, scale=0.1), rand(hidden, inter, scale=0.1), rand(2 * inter, hidden)
    attn, stream, norm_w = rand(m, 64), rand(m, hidden), rand(hidden)
    # residual: y = x @ W.T + stream, parts sum to each row's sum of squares, scaled = y * norm weight
    y, parts, scaled = triton_gemv.gemv(attn, w_o, residual=stream, scale=norm_w, launch=launch)
    want = (triton_gemv.gemv(attn, w_o, launch=launch).float() + stream.float()).to(dtype)
    assert torch.equal(y, want) and parts.shape == (m, hidden // launch[0])
    assert torch.equal(scaled, y * norm_w)
    torch.testing.assert_close(parts.sum(1), y.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    assert triton_gemv.gemv(attn, w_o, residual=stream, launch=launch)[2] is None
    # the scaled stream's product over its rms, gated: add_rms_norm's output, the product, silu_and_mul
    normed = triton_ops.add_rms_norm(y, None, norm_w, 1e-6)[0]
    got = triton_gemv.gemv(scaled, w_gate_up, rms=(parts, 1e-6), gate=True, launch=launch)
    want = triton_ops.silu_and_mul(triton_gemv.gemv(normed, w_gate_up, launch=launch))
    assert got.shape == (m, inter)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    ungated = triton_gemv.gemv(scaled, w_gate_up, rms=(parts, 1e-6), launch=launch)
    assert torch.equal(got, triton_ops.silu_and_mul(ungated)), "the gate rounds as silu_and_mul"
    with pytest.raises(ValueError, match="up to"):
        triton_gemv.gemv(rand(m, 2 * inter), w_down)  # the width is wrong
    with pytest.raises(ValueError, match="paired epilogue"):
        triton_gemv.gemv(scaled, w_gate_up[:2 * 70], gate=True, launch=(32, 32, 4, 2, True))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_norm_pair_is_two_norms_side_by_side(dtype):
    """EAGLE-3's layer input in one launch: what the embedding, two RMSNorms and a cat compute, bit for bit."""
    from specserve.layers import triton_ops
    from specserve.layers.norm import RMSNorm

    torch.manual_seed(0)
    dev, hidden = torch.device(DEVICE["name"]), 192
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


@needs_kernels
@pytest.mark.parametrize("follows", [False, True])
@pytest.mark.parametrize("trees", [False, True])
def test_fill_step_writes_what_the_separate_copies_wrote(follows, trees):
    """A decode graph's static inputs from one packed copy and one launch (`cuda_graph.packed_inputs`,
    `triton_ops.fill_step`) against the copies they replace: placeholders resolved from the pending tokens,
    slots past the step's tokens the scratch slot, tables, lengths and request rows, entries past them untouched."""
    from specserve.engine.cuda_graph import StepInputs, packed_inputs, resolve_ids
    from specserve.layers import triton_ops

    device, q, bs, scratch, block = torch.device(DEVICE["name"]), 2, 4, 999, 4
    step = StepInputs(ids=[5, -2, 7, -1, 11, 12], positions=[8, 9, 3, 4, 13, 14], q_lens=[2, 2, 2],
                      seq_lens=[10, 5, 15], block_tables=[[3, 1, 4], [2, 0], [6, 5, 7, 8]],
                      trees=[None, torch.ones(2, 2), None] if trees else [None] * 3, logit_index=[1, 3, 5],
                      req_indices=[2, 0, 1])
    pending = torch.tensor([40, 41, 42], device=device)
    n, real = len(step.ids), len(step.q_lens)

    def buffers():
        return dict(ids=torch.full((12,), -7, device=device), positions=torch.full((12,), -7, device=device),
                    slots=torch.full((12,), -7, device=device), tree_bits=torch.full((12,), -7, device=device),
                    rows=torch.full((bs + 1,), -7, device=device),
                    seq_lens=torch.full((bs + 1,), -7, dtype=torch.int32, device=device),
                    tree_lens=torch.full((bs + 1,), -7, dtype=torch.int32, device=device),
                    tables=torch.full((bs + 1, 6), -7, dtype=torch.int32, device=device))

    got, want = buffers(), buffers()
    packed, width = packed_inputs(step, block, bs, 9 if follows else None)
    triton_ops.fill_step(torch.from_numpy(packed).to(device), pending, got["ids"], got["positions"], got["slots"],
                         None if trees else got["tree_bits"], got["rows"][:bs] if follows else None,
                         got["seq_lens"][:bs], got["tree_lens"][:bs], got["tables"], n, bs * q, real, width, scratch)
    slots = [t[p // block] * block + p % block
             for t, s in zip(step.block_tables, step.seq_lens) for p in (s - 2, s - 1)]
    want["ids"][:n] = resolve_ids(torch.tensor(step.ids, device=device), pending)
    want["positions"][:n] = torch.tensor(step.positions)
    want["slots"][:n] = torch.tensor(slots)
    want["slots"][n:bs * q] = scratch
    if not trees:
        want["tree_bits"][:n] = 0
    if follows:
        want["rows"][:bs] = torch.tensor([2, 0, 1, 9])
    want["seq_lens"][:bs] = torch.tensor([10, 5, 15, 0])
    want["tree_lens"][:bs] = torch.tensor([0, 2, 0, 0] if trees else [0, 0, 0, 0])
    for r, table in enumerate(step.block_tables):
        want["tables"][r, :width] = torch.tensor(table + [0] * (width - len(table)))
    assert want["ids"][:n].tolist() == [5, 41, 7, 40, 11, 12]
    for name in want:
        assert torch.equal(got[name], want[name]), name


@needs_cuda
def test_keep_features_moves_rows_and_block_ends():
    """The follower's bookkeeping: this step's features into the requests' rows, block ends kept, padding
    rows (the scratch row) touching only scratch."""
    from specserve.layers import triton_ops

    torch.manual_seed(0)
    dev, dim, page = torch.device(DEVICE["name"]), 2500, 4
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

    dev, g = torch.device(DEVICE["name"]), torch.Generator().manual_seed(0)  # inputs drawn on the CPU
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


def mixed_case(tiles, rows, tokens, dev, rng, dtype, heads=6, kv_heads=2, head_dim=32, page=16, width=40):
    """Fixed buffers of `rows` rows (+ the padding row) and `tokens` tokens, metadata over them with the mixed
    tiles, and `fill(ctx_lens, q_lens)` that sets a step into them and returns its reference attention."""
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.long, device=dev)
    scratch = (rows + 1) * width * page
    cache = torch.randn(2, scratch + page, kv_heads, head_dim, dtype=dtype, device=dev)
    slots, bits = torch.full((tokens,), scratch, **i64), torch.zeros(tokens, **i64)
    tables = torch.zeros(rows + 1, width, **i32)
    seq_lens, q_lens_t, tree_lens = (torch.zeros(rows + 1, **i32) for _ in range(3))
    xq = torch.zeros(tokens, heads, head_dim, dtype=dtype, device=dev)
    xk, xv = (torch.zeros(tokens, kv_heads, head_dim, dtype=dtype, device=dev) for _ in range(2))
    meta = triton_attention.static_triton_metadata(slots, tables, seq_lens, q_lens_t, bits, tree_lens, tokens,
                                                   heads // kv_heads, page, cache[None], False, Constants(dev),
                                                   tiles=tiles.view(tokens))

    def fill(ctx_lens, q_lens):
        from specserve.layers.attention import new_token_slots, padded_tables

        real, n = len(q_lens), sum(q_lens)
        lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        tabs, _ = random_tables(lens, page, rng, num_blocks=rows * width)
        slots.fill_(scratch)
        slots[:n].copy_(torch.tensor(new_token_slots(q_lens, lens, tabs, page)))
        table = padded_tables(tabs)
        tables[:real, :table.shape[1]].copy_(table)
        seq_lens[:real].copy_(torch.tensor(lens))
        q_lens_t[:real].copy_(torch.tensor(q_lens))
        tiles.fill(q_lens, tokens)
        for x in (xq, xk, xv):
            x.normal_()
        before = cache.clone()
        ref = reference(q_lens, lens, tabs, page, None, xq[:n].float(), xk[:n].float(), xv[:n].float(),
                        before.float(), head_dim ** -0.5)
        return n, ref

    return meta, (xq, xk, xv, cache, head_dim ** -0.5), fill


MIXED_STEPS = [([0, 40, 7], [30, 1, 1]), ([100], [64]), ([3, 0, 250, 17], [1, 20, 1, 1]), ([9, 9], [1, 1])]


@needs_kernels
@pytest.mark.parametrize("rows,tokens", [(4, 64), (8, 128)])
def test_mixed_tiles_over_fixed_buffers(rows, tokens):
    """Steps of prefill chunks beside decode tokens, set into fixed buffers with MixedTiles (the padding row's
    tiles doing nothing): the torch backend's attention, step after step in the same buffers."""
    dev, rng = torch.device(DEVICE["name"]), random.Random(rows)
    tiles = triton_attention.MixedTiles(tokens, rows, 3, dev)
    meta, args, fill = mixed_case(tiles, rows, tokens, dev, rng, torch.float32)
    for ctx_lens, q_lens in MIXED_STEPS:
        n, ref = fill(ctx_lens, q_lens)
        out = meta.attend(*args)
        err = (out[:n] - ref).norm() / ref.norm()
        assert err < 1e-5, (ctx_lens, q_lens, err)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_tiles_in_a_cuda_graph(dtype):
    """The same, captured once in a CUDA graph and replayed for each step."""
    dev, rng, rows, tokens = torch.device(DEVICE["name"]), random.Random(1), 4, 96
    tiles = triton_attention.MixedTiles(tokens, rows, 3, dev)
    meta, args, fill = mixed_case(tiles, rows, tokens, dev, rng, dtype)
    fill(*MIXED_STEPS[0])
    graphs, outputs = capture_all([()], lambda: meta.attend(*args))
    for ctx_lens, q_lens in MIXED_STEPS:
        n, ref = fill(ctx_lens, q_lens)
        graphs[()].replay()
        err = (outputs[()][:n].float() - ref).norm() / ref.norm()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (ctx_lens, q_lens, err)
