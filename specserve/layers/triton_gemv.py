"""x @ W.T for the few rows of a small decode batch or one request's verify, as a Triton kernel.

At batch 1 a decode step is the weight reads of its linears (Llama-3.1-8B shape on the H200: the q/k/v and
output projections ran at ~3.1 TB/s of the 4.8, the down projection as a split-K GEMM plus a reduce
launch; docs/performance.md, session 15). Here each program reads a strip of BLOCK_N rows of W once, end to
end along K, and keeps every x row's dot products with it: W is read once for all rows, with no split over K
and no second launch. The sum over K runs in the same blocks whatever the number of rows, so a row's result
does not depend on the rows beside it (a verify of 4 tokens gives each the bits a 1-row step would).
Not called by the layers: on the H200 it lost to cuBLAS at every 8B and 30B-A3B weight shape (38-59% of copy
bandwidth at 1 row where cuBLAS read 58-98%; `benchmarks/gemv_kernel.py`, docs/performance.md session 17).
"""
from __future__ import annotations

import torch

from .triton_split import sm_count

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 4  # up to this many rows of x; more go to the GEMM
BLOCK_K = 256


if triton is not None:
    @triton.jit
    def _gemv(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        ks = tl.arange(0, BLOCK_K)
        nmask, mmask = cols < N, rows < M
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            kmask = ks < K - k
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], 2)  # [BLOCK_M, BLOCK_N]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def block_n(n: int, sms: int) -> int:
    """Rows of W per program: 32, halved (to 8) while that leaves fewer than two programs per SM."""
    size = 32
    while size > 8 and triton.cdiv(n, size) < 2 * sms:
        size //= 2
    return size


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         launch: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) in x's dtype, fp32 sums; x of at most MAX_ROWS rows, both with
    contiguous K.
    launch: (BLOCK_N, num_warps), else `block_n` and 4 warps (benchmarks/gemv_kernel.py compares them)."""
    rows = x.reshape(-1, x.shape[-1])  # [m, K]
    m, k = rows.shape
    n = weight.shape[0]
    if m > MAX_ROWS or rows.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes up to {MAX_ROWS} rows with contiguous K, got {m} rows, strides "
                         f"{rows.stride()} and {weight.stride()}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [m, N]
    if m:
        size, warps = launch or (block_n(n, sm_count(x.device)), 4)
        _gemv[(triton.cdiv(n, size),)](rows, weight, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
                                       BLOCK_M=triton.next_power_of_2(m), BLOCK_N=size, BLOCK_K=BLOCK_K,
                                       num_warps=warps)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], n)

