"""x @ W.T for one decode row (or a few), as a Triton kernel.

At batch 1 a decode step is the weight reads of its linears. On the H200 cuBLAS streams the Llama-3.1-8B
q/k/v and output projections at 68% / 57% of copy bandwidth and splits the down projection's K with a
reduce launch after it. Here each program reads a strip of BLOCK_N rows of W once, end to end along K, in
BLOCK_K-wide tiles pipelined NUM_STAGES deep, multiplying on the FMA units into a [rows, BLOCK_N, BLOCK_K]
accumulator summed once at the end: no split over K, no second launch. At one row and the launch of
`ONE_ROW`, every 8B and 30B-A3B weight shape reads as fast as F.linear or faster (q/k/v 15.9 against 17.4 us,
o 11.2 / 13.7, down 30.9 / 33.4 plus its reduce, gate/up 58.9 / 58.5; `benchmarks/gemv_kernel.py --sweep`,
docs/performance.md session 29). Tensor-core tiles (rows padded to 16) and programmatic dependent launch
were tried there and lost. A row's sums run in the same blocks whatever the rows beside it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 4  # up to this many rows of x (the accumulator grows with them)

Launch = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
ONE_ROW: Launch = (8, 512, 4, 3)


if triton is not None:
    @triton.jit
    def _gemv(X, W, Y, Bias, NormW, Parts, R, PartsOut, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
              num_parts, eps, INPUT: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              PARTS_PAD: tl.constexpr):
        # INPUT 0: x itself; 1 (NORMED): rms_norm(x) * NormW, x's sum of squares the sum of Parts [M, num_parts]
        # (applied as (x * NormW) @ W.T / rms: no wait for Parts before the weight streams);
        # 2 (GATED): silu(x[:, :K]) * x[:, K:]. RESIDUAL: Y = x @ W.T + R, and PartsOut [M, programs] gets each
        # program's sum of squares of its columns of Y (the next NORMED product's Parts).
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        ks = tl.arange(0, BLOCK_K)
        nmask, mmask = cols < N, rows < M
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = ks < K - k
            xmask = mmask[:, None] & kmask[None, :]
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=xmask, other=0.0)
            if INPUT == 1:  # x * norm weight here, x's 1 / rms after the sum
                x = x * tl.load(NormW + k + ks, mask=kmask, other=0.0)[None, :]
            if INPUT == 2:  # as _silu_and_mul rounds it
                up = tl.load(x_ptrs + K, mask=xmask, other=0.0)
                gate = x.to(tl.float32)
                x = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = tl.sum(acc, 2)  # [BLOCK_M, BLOCK_N]
        if INPUT == 1:
            p = tl.arange(0, PARTS_PAD)
            parts = tl.load(Parts + rows[:, None] * num_parts + p[None, :],
                            mask=mmask[:, None] & (p < num_parts)[None, :], other=0.0)  # [BLOCK_M, PARTS_PAD]
            y = y / tl.sqrt(tl.sum(parts, 1) / K + eps)[:, None]
        y = y.to(Y.dtype.element_ty)
        omask = mmask[:, None] & nmask[None, :]
        if HAS_BIAS:
            y += tl.load(Bias + cols, mask=nmask, other=0.0)[None, :]
        if RESIDUAL:  # as _add_rms_norm rounds the stream
            r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=omask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
            yf = tl.where(omask, y.to(tl.float32), 0.0)
            tl.store(PartsOut + rows * tl.num_programs(0) + tl.program_id(0), tl.sum(yf * yf, 1), mask=mmask)
        tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y, mask=omask)


PLAIN, NORMED, GATED = 0, 1, 2  # what a product's input is (see `gemv`)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         launch: Launch = ONE_ROW, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
         gated: bool = False, residual: torch.Tensor | None = None):
    """x [..., K] @ weight [N, K].T (+ bias) in x's dtype, fp32 sums; x of at most MAX_ROWS rows, both with
    contiguous K. launch: see `Launch` (benchmarks/gemv_kernel.py compares them).

    Fused around the product, for a decoder layer in few launches (rounded as the unfused kernels round, but
    for the norm):
    - norm (parts [m, p] fp32, norm weight [K], eps): the input is rms_norm(x) * weight, the sum of squares of
      each row of x being the sum of its parts (what a `residual` product returned); computed as
      ((x * weight) @ W.T) / rms(x), where the unfused norm rounds x / rms(x) to x's dtype first;
    - gated: x is [..., 2K], the input silu(x[..., :K]) * x[..., K:];
    - residual [..., N]: returns (x @ W.T (+ bias) + residual, parts [m, programs] fp32 of its squares)."""
    k = weight.shape[1]
    rows = x.reshape(-1, x.shape[-1])  # [m, K] ([m, 2K] gated)
    m, n = rows.shape[0], weight.shape[0]
    if m > MAX_ROWS or rows.stride(1) != 1 or weight.stride(1) != 1 or rows.shape[1] != k * (2 if gated else 1):
        raise ValueError(f"gemv takes up to {MAX_ROWS} rows with contiguous K, got {tuple(rows.shape)} for a "
                         f"weight {tuple(weight.shape)}, strides {rows.stride()} and {weight.stride()}")
    size, width, warps, stages = launch
    programs = triton.cdiv(n, size)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [m, N]
    r = residual.reshape(m, n) if residual is not None else y
    parts_out = torch.empty(m, programs if residual is not None else 0, dtype=torch.float32, device=x.device)
    norm_weight, parts, eps = norm if norm is not None else (y, parts_out, 0.0)
    if m:
        _gemv[(programs,)](rows, weight, y, y if bias is None else bias, norm_weight, parts, r, parts_out,
                           m, n, k, rows.stride(0), weight.stride(0), y.stride(0), r.stride(0), parts.shape[1], eps,
                           INPUT=NORMED if norm is not None else GATED if gated else PLAIN,
                           RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
                           BLOCK_M=triton.next_power_of_2(m), BLOCK_N=size, BLOCK_K=width, NUM_STAGES=stages,
                           PARTS_PAD=triton.next_power_of_2(max(parts.shape[1], 1)), num_warps=warps)
    y = y.reshape(*x.shape[:-1], n)
    return (y, parts_out) if residual is not None else y
