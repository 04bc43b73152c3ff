"""x @ W.T for the few rows of a small decode batch or one request's verify, as a Triton kernel.

At batch 1 a decode step is the weight reads of its linears (Llama-3.1-8B shape on the H200: cuBLAS ran the
q/k/v and output projections at ~3.1 TB/s of the 4.8, the down projection as a split-K GEMM plus a reduce
launch; docs/performance.md, session 15). Here each program reads a strip of BLOCK_N rows of W once, end to
end along K, in BLOCK_K-wide tiles pipelined NUM_STAGES deep, and keeps every x row's dot products with it:
W is read once for all rows, with no split over K and no second launch.

Two ways to multiply a tile (`DOT`): tensor cores (`tl.dot`, the rows padded to 16) or FMAs into a
[rows, BLOCK_N, BLOCK_K] accumulator summed once at the end. Either way a row's sums run in the same blocks
whatever the rows beside it, so a verify of 4 tokens gives each the bits a 1-row step would.
"""
from __future__ import annotations

import torch

from .triton_split import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # up to this many rows of x; more go to the GEMM
DOT_ROWS = 16  # rows of a tensor-core tile (x padded to this)

Launch = tuple[int, int, int, int, bool]  # (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT)


if triton is not None:
    @triton.jit
    def _gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              DOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        ks = tl.arange(0, BLOCK_K)
        nmask, mmask = cols < N, rows < M
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        if PDL:  # launched before the kernel ahead of it ends: wait for its writes, let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:
            acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = ks < K - k
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            if DOT:
                if IEEE:
                    acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            else:
                acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if not DOT:
            acc = tl.sum(acc3, 2)
        tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def block_n(n: int, sms: int) -> int:
    """Rows of W per program: 32, halved (to 8) while that leaves fewer than two programs per SM."""
    size = 32
    while size > 8 and triton.cdiv(n, size) < 2 * sms:
        size //= 2
    return size


def default_launch(n: int, k: int, device: torch.device) -> Launch:
    """The launch for an [n, k] weight."""
    return (max(16, block_n(n, sm_count(device))), 256, 4, 4, True)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         launch: Launch | None = None, pdl: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) in x's dtype, fp32 sums; x of at most MAX_ROWS rows, both with
    contiguous K. launch: see `Launch` (benchmarks/gemv_kernel.py compares them); else `default_launch`."""
    rows = x.reshape(-1, x.shape[-1])  # [m, K]
    m, k = rows.shape
    n = weight.shape[0]
    if m > MAX_ROWS or rows.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes up to {MAX_ROWS} rows with contiguous K, got {m} rows, strides "
                         f"{rows.stride()} and {weight.stride()}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [m, N]
    if m:
        size, width, warps, stages, dot = launch or default_launch(n, k, x.device)
        block_m = DOT_ROWS if dot else triton.next_power_of_2(m)
        _gemv[(triton.cdiv(n, size),)](rows, weight, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
                                       BLOCK_M=block_m, BLOCK_N=size, BLOCK_K=width, NUM_STAGES=stages, DOT=dot,
                                       IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=warps,
                                       **({"launch_pdl": True} if pdl else {}))
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], n)
