"""x @ W.T for one decode row (or a few), as a Triton kernel, with a decoder layer's work around it fused in.

At batch 1 a decode step is the weight reads of its linears. On the H200 cuBLAS streams the Llama-3.1-8B q/k/v and
output projections at 68% / 57% of copy bandwidth and splits the down projection's K with a reduce launch after
it. Here each program reads a strip of BLOCK_N rows of W once, end to end along K, in BLOCK_K-wide tiles pipelined
NUM_STAGES deep: at one row multiplying on the FMA units into a [rows, BLOCK_N, BLOCK_K] accumulator summed once
at the end (`one_row_launch`: every 8B and 30B-A3B weight shape reads as fast as F.linear or faster, q/k/v 15.9
against 17.4 us, o 11.2 / 13.7, down 30.9 / 33.4 plus its reduce, gate/up 58.9 / 58.5, 30B-A3B o 6.5 / 9.8); at
2-16 rows on the tensor cores, the rows padded to 16 (`FEW_ROWS`: within ~1 us of cuBLAS per 8B product at 4 and
16 rows, where FMA strips lose up to 11 us; `benchmarks/gemv_kernel.py --sweep`, docs/performance.md session 29).
No split over K, no second launch; a row's sums run in the same blocks whatever the rows beside it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_launch import launch_kernel, let_next_launch, sm_count, wait_for_previous

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 4  # rows of x on the FMA units (the accumulator grows with them)
MAX_DOT_ROWS = 16  # rows of x on the tensor cores (one 16-row tile)


class Launch(NamedTuple):
    block_n: int  # output features a program computes
    block_k: int  # the width of a K tile
    warps: int
    stages: int  # K tiles in flight
    dot: bool = False  # tensor cores (rows padded to 16; block_n >= 16) instead of FMAs


ONE_ROW = Launch(8, 512, 4, 3)
NARROW_ONE_ROW = Launch(4, 2048, 4, 2)  # a one-row product with few rows of W (`one_row_launch`)
FEW_ROWS = {  # per 8B product at 4 rows, the fastest tensor-core launch of the session-29 sweep
    "qkv": Launch(32, 128, 4, 5, True), "o": Launch(32, 128, 4, 5, True),
    "gate_up": Launch(32, 256, 4, 3, True), "down": Launch(32, 512, 4, 3, True),
}


ONE_ROW_LAYER = dict.fromkeys(FEW_ROWS)  # every decoder-layer product at one row: `one_row_launch` of its shape


def layer_launches(rows: int) -> dict[str, Launch | None]:
    """The launch of each decoder-layer product (qkv, o, gate_up, down) at this many rows (None: `gemv`'s rule)."""
    return FEW_ROWS if rows > 1 else ONE_ROW_LAYER


def one_row_launch(n: int, device) -> Launch:
    """The launch of a product of n output features at one row: ONE_ROW, unless its grid would leave fewer than two
    programs a multiprocessor; then NARROW_ONE_ROW, twice the programs, each requesting its strip in 2048-wide
    tiles. On the H200 that takes the Qwen3-30B-A3B batch-1 graph from 2.71 to 2.65 ms (its o and router products:
    o 7.1 -> 6.5 us), where every 8B product, each with two or more programs a multiprocessor, is slower with it
    (4.03 against 3.93 ms; docs/performance.md session 53)."""
    one, narrow = Launch(*ONE_ROW), Launch(*NARROW_ONE_ROW)  # plain tuples too, as benchmarks/recapture.py sets them
    return one if triton.cdiv(n, one.block_n) >= 2 * sm_count(device) else narrow


class RopeWrite(NamedTuple):
    """What a q/k/v product does with its output (`gemv`'s rope): rotate q and k (rotate-half layout, cos and
    sin [max_positions, head_dim] fp32 at positions [m]) and write k and v into cache [2, slots, kv_heads,
    head_dim] at slots [m], as `triton_ops.rope_and_cache` does after the product."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int


if triton is not None:
    @triton.jit
    def _gemv(X, W, Y, Bias, Parts, R, PartsOut, Scale, Scaled, Cos, Sin, Pos, Slots, KC, VC, M, N, K, stride_xm,
              stride_wn, stride_ym, stride_rm, num_parts, eps, q_end, k_end, stride_ct, stride_ch,
              RMS: tl.constexpr, RESIDUAL: tl.constexpr, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
              PAIRED: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PARTS_PAD: tl.constexpr,
              EVICT: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Y = x @ W.T, then in order: RMS: / rms of each row, its sum of squares the sum of Parts [M, num_parts]
        # over K; + Bias; RESIDUAL: + R, PartsOut [M, programs] getting each program's sum of squares of its
        # columns, and SCALE: Scaled = Y * Scale. PAIRED (ROPE or GATE): W's rows are blocks of 2 * HALF, each
        # the a and b halves of HALF pairs; a program takes BLOCK_N // 2 pairs of one block. ROPE: q's blocks
        # (heads) below q_end, k's below k_end, then v's; q and k rotated, k and v also written to KC / VC.
        # GATE: Y [M, N / 2] = silu(a) * b.
        if PAIRED != 0:
            PAIRS: tl.constexpr = BLOCK_N // 2
            start = tl.program_id(0) * BLOCK_N
            first = (start // (2 * HALF)) * 2 * HALF + start % (2 * HALF) // 2  # the program's first pair
            pair = tl.arange(0, PAIRS)[:, None] + tl.arange(0, 2)[None, :] * HALF  # [PAIRS, 2]
            cols = tl.reshape(first + pair, (BLOCK_N,))  # [BLOCK_N] output features: a0, b0, a1, b1, ...
        else:
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        ks = tl.arange(0, BLOCK_K)
        nmask, mmask = cols < N, rows < M
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        omask = mmask[:, None] & nmask[None, :]
        if HAS_BIAS:  # the epilogue's loads before the weights stream, not after
            bias = tl.load(Bias + cols, mask=nmask, other=0.0)
        if RESIDUAL:
            r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=omask, other=0.0)
            if SCALE:
                weight = tl.load(Scale + cols, mask=nmask, other=0.0)
        if RMS:
            p = tl.arange(0, PARTS_PAD)
            parts = tl.load(Parts + rows[:, None] * num_parts + p[None, :],
                            mask=mmask[:, None] & (p < num_parts)[None, :], other=0.0)  # [BLOCK_M, PARTS_PAD]
        if DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = ks < K - k
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy=EVICT)
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            if DOT:
                acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        let_next_launch(PDL)
        if DOT:
            y = acc  # [BLOCK_M, BLOCK_N]
        else:
            y = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_N]
        if RMS:
            y = y / tl.sqrt(tl.sum(parts, 1) / K + eps)[:, None]
        y = y.to(Y.dtype.element_ty)
        if HAS_BIAS:
            y += bias[None, :]
        if RESIDUAL:  # as _add_rms_norm rounds the stream
            y = (y.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
            yf = tl.where(omask, y.to(tl.float32), 0.0)
            tl.store(PartsOut + rows * tl.num_programs(0) + tl.program_id(0), tl.sum(yf * yf, 1), mask=mmask)
            if SCALE:
                scaled = y * weight[None, :]
                tl.store(Scaled + rows[:, None] * stride_ym + cols[None, :], scaled, mask=omask)
        if PAIRED == 1:  # as _rope_and_cache rounds it
            pos = tl.load(Pos + rows, mask=mmask, other=0).to(tl.int64)[:, None]  # [BLOCK_M, 1]
            d = first % (2 * HALF) + tl.arange(0, PAIRS)[None, :]  # [1, PAIRS]
            cos = tl.load(Cos + pos * 2 * HALF + d, mask=mmask[:, None], other=0.0).to(Y.dtype.element_ty)
            sin = tl.load(Sin + pos * 2 * HALF + d, mask=mmask[:, None], other=0.0).to(Y.dtype.element_ty)
            a, b = tl.split(tl.reshape(y, (BLOCK_M, PAIRS, 2)))  # [BLOCK_M, PAIRS] each
            a, b, cos, sin = a.to(tl.float32), b.to(tl.float32), cos.to(tl.float32), sin.to(tl.float32)
            turned = tl.reshape(tl.join(a * cos - b * sin, b * cos + a * sin), (BLOCK_M, BLOCK_N))
            y = tl.where(start < k_end, turned.to(Y.dtype.element_ty), y)
            slot = tl.load(Slots + rows, mask=mmask, other=0).to(tl.int64)[:, None]  # [BLOCK_M, 1]
            in_v = cols >= k_end
            kv = tl.where(in_v, cols - k_end, cols - q_end)
            at = slot * stride_ct + (kv // (2 * HALF) * stride_ch + kv % (2 * HALF))[None, :]  # [BLOCK_M, BLOCK_N]
            tl.store(KC + at, y, mask=omask & ((cols >= q_end) & ~in_v)[None, :])
            tl.store(VC + at, y, mask=omask & in_v[None, :])
        if PAIRED == 2:  # as _silu_and_mul rounds it
            gate, up = tl.split(tl.reshape(y, (BLOCK_M, PAIRS, 2)))  # [BLOCK_M, PAIRS] each
            gate = gate.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty) * up
            out = first + tl.arange(0, PAIRS)  # [PAIRS]
            tl.store(Y + rows[:, None] * stride_ym + out[None, :], act, mask=mmask[:, None] & (out < N // 2)[None, :])
        else:
            tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y, mask=omask)


NONE, ROPE, GATE = 0, 1, 2  # what a paired product does with its pairs (see `gemv`)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         launch: tuple | None = None, rms: tuple[torch.Tensor, float] | None = None,
         residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
         rope: RopeWrite | None = None, gate: bool = False, evict: str = "evict_first"):
    """x [..., K] @ weight [N, K].T (+ bias) in x's dtype, fp32 sums; x of at most MAX_ROWS rows (MAX_DOT_ROWS
    with a tensor-core launch), both with contiguous K. launch: a `Launch` or its fields as a tuple
    (benchmarks/gemv_kernel.py compares them); None: `one_row_launch` of the weight's shape.

    Fused after the product, for a decoder layer in few launches (rounded as the unfused kernels round, but
    for the norm), nothing before it (work on x inside the K loop slowed tensor-core tiles 2-10x):
    - rms (parts [m, p] fp32, eps): x is a stream already multiplied by its RMSNorm's weight (`scale`), the
      product divided by the stream's rms, its sum of squares over K the sum of its parts: rms_norm(stream) *
      weight @ W.T, where the unfused norm rounds stream / rms to x's dtype first;
    - residual [..., N]: returns (x @ W.T (+ bias) + residual, parts [m, programs] fp32 of its squares, and
      with scale [N] that sum times scale, else None): the next norm's inputs;
    - rope: the product is a q/k/v projection whose q and k come out rotated and whose k and v are written
      to the cache (`RopeWrite`; the launch's block_n / 2 must divide head_dim / 2);
    - gate: weight is gate and up projections stacked [2I, K]; returns silu(x @ gate.T) * (x @ up.T) [..., I].
    evict: the L2 policy of the weight's loads: "evict_first" for weights streamed once a step, "" (the default
    policy) for a small weight that could stay in L2 from one step to the next."""
    n, k = weight.shape
    launch = Launch(*launch) if launch is not None else one_row_launch(n, weight.device)
    launch = launch._replace(block_k=min(launch.block_k, max(16, triton.next_power_of_2(k))))  # no tile wider than K
    rows = x.reshape(-1, x.shape[-1])  # [m, K]
    m = rows.shape[0]
    limit = MAX_DOT_ROWS if launch.dot else MAX_ROWS
    if m > limit or rows.stride(1) != 1 or weight.stride(1) != 1 or rows.shape[1] != k:
        raise ValueError(f"gemv takes up to {limit} rows with contiguous K, got {tuple(rows.shape)} for a "
                         f"weight {tuple(weight.shape)}, strides {rows.stride()} and {weight.stride()}")
    half = rope.head_dim // 2 if rope is not None else n // 2 if gate else 1
    if (rope is not None or gate) and not pairs_fit(2 * half, launch):
        raise ValueError(f"a paired epilogue needs block_n / 2 dividing {half}, got block_n {launch.block_n}")
    programs = triton.cdiv(n, launch.block_n)
    y = torch.empty(m, n // 2 if gate else n, dtype=x.dtype, device=x.device)  # [m, N] ([m, N / 2] gated)
    r = residual.reshape(m, n) if residual is not None else y
    parts_out = torch.empty(m, programs, dtype=torch.float32, device=x.device) if residual is not None else None
    scaled = torch.empty_like(y) if scale is not None else None
    parts, eps = rms if rms is not None else (None, 0.0)
    num_parts = parts.shape[1] if parts is not None else 1
    cos, sin, positions, cache, slots, heads, kv_heads, _ = rope if rope is not None else (y, y, y, None, y, 0, 0, 0)
    kc, vc, cache_strides = (cache[0], cache[1], cache.stride()[1:3]) if rope is not None else (y, y, (0, 0))
    block_m = max(16, triton.next_power_of_2(m)) if launch.dot else triton.next_power_of_2(max(m, 1))
    if m:
        launch_kernel(_gemv, (programs,), rows, weight, y, y if bias is None else bias, y if parts is None else parts,
                      r, y if parts_out is None else parts_out, y if scale is None else scale,
                      y if scaled is None else scaled, cos, sin, positions, slots, kc, vc, m, n, k, rows.stride(0),
                      weight.stride(0), y.stride(0), r.stride(0), num_parts, eps, 2 * half * heads,
                      2 * half * (heads + kv_heads), *cache_strides, RMS=rms is not None, RESIDUAL=residual is not None,
                      SCALE=scale is not None, HAS_BIAS=bias is not None,
                      PAIRED=ROPE if rope is not None else GATE if gate else NONE, DOT=launch.dot, HALF=half,
                      BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, NUM_STAGES=launch.stages,
                      PARTS_PAD=triton.next_power_of_2(num_parts), EVICT=evict, num_warps=launch.warps)
    y = y.reshape(*x.shape[:-1], y.shape[1])
    if residual is None:
        return y
    return y, parts_out, None if scaled is None else scaled.reshape(y.shape)


def pairs_fit(block: int, launch: tuple | None) -> bool:
    """Whether a paired epilogue (rope over heads of `block` features, or gate over gate/up of `block`) fits
    this launch (None: either of `one_row_launch`'s): its block_n / 2 pairs divide block / 2."""
    pairs = Launch(*(launch or ONE_ROW)).block_n // 2  # ONE_ROW's pairs a multiple of NARROW_ONE_ROW's
    return block % 2 == 0 and pairs > 0 and (block // 2) % pairs == 0
