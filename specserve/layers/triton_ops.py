"""Fused elementwise kernels for CUDA: one launch where PyTorch takes several.

A decode step at small batch is a few hundred kernel launches around the weight reads; each of these
replaces 3-15 PyTorch kernels per layer. Each computes what its PyTorch counterpart in norm.py,
rotary.py, llama.py and sampler.py computes, with the same roundings to the model dtype (fp32 math in between).
"""
from __future__ import annotations

from typing import Optional

import torch

from .triton_launch import launch_kernel, wait_for_previous

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ROPE_HEADS = 4  # q heads a `rope_and_cache` program rotates (with its share of the kv heads); 0: every head


def use_triton(x: torch.Tensor) -> bool:
    """CUDA inference only: the kernels have no backward, so training keeps the PyTorch path."""
    return triton is not None and x.is_cuda and not torch.is_grad_enabled()


if triton is not None:
    @triton.jit
    def _add_rms_norm(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, n, eps,
                      HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)  # every load first: one memory round trip
        w = tl.load(W + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
                Out.dtype.element_ty)
            tl.store(ROut + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        y = (xf * rstd).to(Out.dtype.element_ty) * w
        tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)
        tl.store(Out + row * stride_o + cols, act * up, mask=mask)

    @triton.jit
    def _rotary(X, Cos, Sin, Pos, stride_t, stride_h, heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                PDL: tl.constexpr):
        wait_for_previous(PDL)
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos + tok)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < heads
        cos = tl.load(Cos + pos * 2 * HALF + d).to(X.dtype.element_ty).to(tl.float32)
        sin = tl.load(Sin + pos * 2 * HALF + d).to(X.dtype.element_ty).to(tl.float32)
        base = X + tok * stride_t + h * stride_h
        a = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + d, (a * cos - b * sin).to(X.dtype.element_ty), mask=mask)
        tl.store(base + HALF + d, (b * cos + a * sin).to(X.dtype.element_ty), mask=mask)


if triton is not None:
    @triton.jit
    def _normed(a, b, W, eps, HALF: tl.constexpr, dtype: tl.constexpr):
        """RMSNorm of each row of heads split in halves a, b [heads, HALF] (fp32), as RMSNorm rounds it:
        the normalised value to the model dtype, times the weight, rounded again; back in fp32."""
        d = tl.arange(0, HALF)[None, :]
        inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1))[:, None] / (2 * HALF) + eps)
        wa = tl.load(W + d).to(tl.float32)
        wb = tl.load(W + HALF + d).to(tl.float32)
        a = ((a * inv).to(dtype).to(tl.float32) * wa).to(dtype).to(tl.float32)
        b = ((b * inv).to(dtype).to(tl.float32) * wb).to(dtype).to(tl.float32)
        return a, b

    @triton.jit
    def _rope_and_cache(Q, K, V, KC, VC, Cos, Sin, Pos, Slots, QW, KW, eps, stride_qt, stride_qh, stride_kt,
                        stride_kh, stride_vt, stride_vh, stride_ct, stride_ch, heads, kv_heads, q_per, kv_per,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, NORM: tl.constexpr,
                        PDL: tl.constexpr):
        wait_for_previous(PDL)
        # every load before any store (a store may alias a later load, so the compiler keeps their order):
        # two memory round trips, the position's and then cos / sin, where loads after stores took four
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos + tok)
        slot = tl.load(Slots + tok)
        d = tl.arange(0, HALF)[None, :]
        group = tl.program_id(1)  # q heads [group * q_per, + q_per) and kv heads [group * kv_per, + kv_per)
        h = group * q_per + tl.arange(0, BLOCK_H)[:, None]
        qmask = (h < heads) & (h < (group + 1) * q_per)
        qp = Q + tok * stride_qt + h * stride_qh
        qa = tl.load(qp + d, mask=qmask, other=0.0).to(tl.float32)
        qb = tl.load(qp + HALF + d, mask=qmask, other=0.0).to(tl.float32)
        kh = group * kv_per + tl.arange(0, BLOCK_KH)[:, None]
        kmask = (kh < kv_heads) & (kh < (group + 1) * kv_per)
        kp = K + tok * stride_kt + kh * stride_kh
        ka = tl.load(kp + d, mask=kmask, other=0.0).to(tl.float32)
        kb = tl.load(kp + HALF + d, mask=kmask, other=0.0).to(tl.float32)
        vd = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(V + tok * stride_vt + kh * stride_vh + vd, mask=kmask, other=0.0)
        cos = tl.load(Cos + pos * 2 * HALF + d).to(Q.dtype.element_ty).to(tl.float32)
        sin = tl.load(Sin + pos * 2 * HALF + d).to(Q.dtype.element_ty).to(tl.float32)
        if NORM:
            qa, qb = _normed(qa, qb, QW, eps, HALF, Q.dtype.element_ty)
            ka, kb = _normed(ka, kb, KW, eps, HALF, K.dtype.element_ty)
        tl.store(qp + d, (qa * cos - qb * sin).to(Q.dtype.element_ty), mask=qmask)
        tl.store(qp + HALF + d, (qb * cos + qa * sin).to(Q.dtype.element_ty), mask=qmask)
        cb = KC + slot * stride_ct + kh * stride_ch
        tl.store(cb + d, (ka * cos - kb * sin).to(KC.dtype.element_ty), mask=kmask)
        tl.store(cb + HALF + d, (kb * cos + ka * sin).to(KC.dtype.element_ty), mask=kmask)
        tl.store(VC + slot * stride_ct + kh * stride_ch + vd, v, mask=kmask)


if triton is not None:
    @triton.jit
    def _embed_norm_pair(Ids, Emb, H, WE, WH, Out, stride_e, stride_h, stride_o, n, eps, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        tok = tl.load(Ids + row).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        e = tl.load(Emb + tok * stride_e + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(e * e, 0) / n + eps)
        w = tl.load(WE + cols, mask=mask, other=0.0)
        y = (e * rstd).to(Out.dtype.element_ty) * w
        tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
        w = tl.load(WH + cols, mask=mask, other=0.0)
        y = (h * rstd).to(Out.dtype.element_ty) * w
        tl.store(Out + row * stride_o + n + cols, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _keep_features(Aux, Feat, BFeat, Rows, Pos, Tables, stride_a, stride_f, stride_b, stride_t, scratch_row,
                       scratch_block, page, max_col, dim, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        b = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        row = tl.load(Rows + b)
        pos = tl.load(Pos + b)
        block = tl.load(Tables + b * stride_t + tl.minimum(pos // page, max_col)).to(tl.int64)
        target = tl.where((row != scratch_row) & ((pos + 1) % page == 0), block, scratch_block)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(Aux + b * stride_a + cols, mask=mask)
        tl.store(Feat + row * stride_f + cols, x, mask=mask)
        tl.store(BFeat + target * stride_b + cols, x, mask=mask)


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _splitmix64(x):
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _gumbel_argmax(X, Seeds, Pos, Rows, Val, Idx, stride_x, stride_v, vocab, BLOCK: tl.constexpr,
                       MASKED: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        row = tl.program_id(0).to(tl.int64)
        if MASKED:  # rows not asked for: nothing read or written
            if tl.load(Rows + row) == 0:
                return
        chunk = tl.program_id(1)
        seed = tl.load(Seeds + row).to(tl.uint64, bitcast=True)
        pos = tl.load(Pos + row).to(tl.uint64, bitcast=True)
        state = _splitmix64(_splitmix64(seed) + pos)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        bits = _splitmix64(state + (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        u = ((bits >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2^-52
        noise = -libdevice.log(-libdevice.log(u))
        x = tl.load(X + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float64)
        v = tl.where(mask, x + noise, float("-inf"))
        nan = v != v
        top = tl.max(tl.where(nan, float("-inf"), v), 0)
        first_top = tl.min(tl.where(v == top, cols, vocab), 0)
        first_nan = tl.min(tl.where(nan, cols, vocab), 0)
        has_nan = first_nan < vocab  # torch.argmax's rule: a NaN is the maximum
        tl.store(Val + row * stride_v + chunk, tl.where(has_nan, float("nan"), top))
        tl.store(Idx + row * stride_v + chunk, tl.where(has_nan, first_nan, first_top).to(tl.int64))


def gumbel_argmax(filtered: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n] int64: argmax_x(float64(filtered[i, x]) + G(seeds[i], positions[i], x)), what
    `sampler.seeded_tokens` computes with `sampler.gumbel_noise` (same noise bits, float64 logs, the lowest
    index on ties, the first NaN if any), without the [n, vocab] int64 and float64 intermediates.
    filtered [n, vocab] fp32 (-inf outside the filters), seeds [n] int64, positions [n] int64; rows [n] bool:
    only those rows (the others' results undefined, their programs exit at once).
    One program per (row, block of vocabulary) takes its block's best; a torch argmax picks among blocks."""
    n, vocab = filtered.shape
    filtered = filtered.contiguous()
    block = 2048
    chunks = triton.cdiv(vocab, block)
    vals = torch.empty(n, chunks, dtype=torch.float64, device=filtered.device)  # [n, chunks]
    idx = torch.empty(n, chunks, dtype=torch.long, device=filtered.device)  # [n, chunks]
    if n:  # fp fusion on, as nvcc's default --fmad=true compiles torch's log
        masked = rows.to(torch.int32) if rows is not None else idx  # unread without MASKED
        launch_kernel(_gumbel_argmax, (n, chunks), filtered, seeds.long().contiguous(), positions.long().contiguous(),
                      masked, vals, idx, filtered.stride(0), vals.stride(0), vocab, BLOCK=block,
                      MASKED=rows is not None, num_warps=8, enable_fp_fusion=True)
    return idx.gather(1, vals.argmax(-1, keepdim=True)).squeeze(1)


def embed_norm_pair(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                    w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """[n, 2H]: RMSNorm(table[ids]) beside RMSNorm(hidden), weights w_embed and w_hidden (what an embedding,
    two RMSNorms and a cat compute, EAGLE-3's layer input), one launch. ids [n], table [vocab, H],
    hidden [n, H]."""
    n, width = hidden.shape
    out = torch.empty(n, 2 * width, dtype=hidden.dtype, device=hidden.device)
    if n:
        launch_kernel(_embed_norm_pair, (n,), ids, table, hidden, w_embed, w_hidden, out, table.stride(0),
                      hidden.stride(0), out.stride(0), width, eps, BLOCK=_pow2(width), num_warps=8)
    return out


def keep_features(aux: torch.Tensor, features: torch.Tensor, block_features: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor, tables: torch.Tensor, page: int) -> None:
    """What EAGLE-3's draft following plain decoding keeps of a step (speculative/eagle3_follow.py), one
    launch. Per batch row b: features[rows[b]] = aux[b] and, at a block's last position,
    block_features[block] = aux[b]. The last row of features and of block_features is scratch: rows[b]
    equal to it marks a padding row. aux [bs, dim]; features [seqs + 1, dim]; block_features
    [blocks + 1, dim]; rows, positions [bs]; tables [bs, max_blocks]."""
    bs, dim = aux.shape
    block = 1024
    launch_kernel(_keep_features, (bs, triton.cdiv(dim, block)), aux, features, block_features, rows, positions, tables,
                  aux.stride(0), features.stride(0), block_features.stride(0), tables.stride(0), features.shape[0] - 1,
                  block_features.shape[0] - 1, page, tables.shape[1] - 1, dim, BLOCK=block, num_warps=4)


def rotary_fits(x: torch.Tensor, head_dim: int) -> bool:
    """Can the rotary kernels take heads of head_dim beside x (CUDA inference, half the head a power of 2)?"""
    half = head_dim // 2
    return use_triton(x) and half >= 8 and half & (half - 1) == 0


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                   qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> None:
    """Rotate q in place and write rotated k and v to their cache slots, in one launch; with qk_norm (q's
    and k's RMSNorm weights [D], eps) each head of q and k is normed first (Qwen3).
    q [T, H, D], k and v [T, Hkv, D], cache [2, num_slots, Hkv, D], slots [T]."""
    tokens, heads, head_dim = q.shape
    if not tokens:
        return
    kc, vc = cache[0], cache[1]
    qw, kw, eps = qk_norm if qk_norm is not None else (q, k, 0.0)  # unread without NORM
    kv_heads = k.shape[1]
    q_per = min(ROPE_HEADS or heads, heads)  # 0 only without q heads (`store_kv`'s keys)
    groups = triton.cdiv(heads, q_per) if q_per else 1
    kv_per = triton.cdiv(kv_heads, groups)
    launch_kernel(_rope_and_cache, (tokens, groups), q, k, v, kc, vc, cos, sin, positions, slots, qw, kw, eps,
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0),
                  kc.stride(1), heads, kv_heads, q_per, kv_per, HALF=head_dim // 2, BLOCK_H=_pow2(max(q_per, 1)),
                  BLOCK_KH=_pow2(kv_per), NORM=qk_norm is not None, num_warps=4)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """norm(x + residual) and x + residual (x alone when residual is None); x [n, hidden]."""
    n, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    launch_kernel(_add_rms_norm, (n,), x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                  res_out.stride(0), hidden, eps, HAS_RES=residual is not None, BLOCK=_pow2(hidden), num_warps=8)
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [tokens, 2n]."""
    tokens, two_n = x.shape
    n = two_n // 2
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    block = 1024
    launch_kernel(_silu_and_mul, (tokens, triton.cdiv(n, block)), x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                  num_warps=4)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place (rotate-half layout); cos, sin [max_pos, head_dim] fp32."""
    tokens, heads, head_dim = x.shape
    if tokens:
        launch_kernel(_rotary, (tokens,), x, cos, sin, positions, x.stride(0), x.stride(1), heads, HALF=head_dim // 2,
                      BLOCK_H=_pow2(heads), num_warps=4)
    return x


if triton is not None:
    @triton.jit(do_not_specialize=["n", "tokens", "bs", "real", "width", "scratch", "has_pending", "has_rows",
                                   "zero_tree"])
    def _fill_step(Packed, Pending, Ids, Positions, Slots, TreeBits, Rows, SeqLens, TreeLens, Tables, n, tokens, bs,
                   real, width, stride_table, scratch, has_pending, has_rows, zero_tree, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Packed (int64) = ids [n] | positions [n] | slots [n] | Rows' values [bs] if has_rows | seq_lens [bs] |
        # tree_lens [bs] | tables [real, width]; ids below 0 are placeholders -1-r for Pending[r]. One compiled
        # variant whatever the step (flags and sizes not specialised): no compile inside a running engine
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        known = i < n
        ids = tl.load(Packed + i, mask=known, other=0)
        if has_pending != 0:
            ids = tl.where(ids >= 0, ids, tl.load(Pending + tl.maximum(-1 - ids, 0), mask=known & (ids < 0), other=0))
        tl.store(Ids + i, ids, mask=known)
        tl.store(Positions + i, tl.load(Packed + n + i, mask=known), mask=known)
        slots = tl.load(Packed + 2 * n + i, mask=known, other=0)
        tl.store(Slots + i, tl.where(known, slots, scratch), mask=i < tokens)
        if zero_tree != 0:
            tl.store(TreeBits + i, tl.zeros([BLOCK], tl.int64), mask=known)
        row = i < bs
        at = 3 * n
        if has_rows != 0:
            tl.store(Rows + i, tl.load(Packed + at + i, mask=row), mask=row)
            at += bs
        tl.store(SeqLens + i, tl.load(Packed + at + i, mask=row).to(tl.int32), mask=row)
        tl.store(TreeLens + i, tl.load(Packed + at + bs + i, mask=row).to(tl.int32), mask=row)
        cell = i < real * width
        tl.store(Tables + (i // tl.maximum(width, 1)) * stride_table + i % tl.maximum(width, 1),
                 tl.load(Packed + at + 2 * bs + i, mask=cell).to(tl.int32), mask=cell)


def fill_step(packed: torch.Tensor, pending: Optional[torch.Tensor], ids: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, tree_bits: Optional[torch.Tensor], rows: Optional[torch.Tensor],
              seq_lens: torch.Tensor, tree_lens: torch.Tensor, tables: torch.Tensor, n: int, tokens: int, real: int,
              width: int, scratch: int) -> None:
    """A decode graph's static inputs from one packed int64 tensor, in one launch (cuda_graph.GraphRunner.replay):
    packed = ids [n] | positions [n] | slots [n] | rows [bs] (with rows) | seq_lens [bs] | tree_lens [bs] |
    tables [real, width], bs = len(seq_lens). ids[:n] (placeholders -1-r resolved to pending[r]), positions[:n],
    slots[:tokens] (scratch past n), tree_bits[:n] zeroed (None: left), rows, seq_lens, tree_lens and
    tables[:real, :width] written."""
    bs = seq_lens.shape[0]
    block = 128
    programs = triton.cdiv(max(tokens, bs, real * width, 1), block)
    launch_kernel(_fill_step, (programs,), packed, packed if pending is None else pending, ids, positions, slots,
                  ids if tree_bits is None else tree_bits, ids if rows is None else rows, seq_lens, tree_lens, tables,
                  n, tokens, bs, real, width, tables.stride(0), scratch, int(pending is not None),
                  int(rows is not None), int(tree_bits is not None), BLOCK=block, num_warps=4)
