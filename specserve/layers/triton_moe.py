"""Fused mixture-of-experts experts on CUDA: the routed SwiGLU MLPs of `moe.Experts` in two Triton GEMMs.

For each token t and each of its top_k (expert e, weight w) pairs it computes
w * w2[e] @ (silu(gate) * up), with gate and up the two halves of w13[e] @ x[t], and sums over the pairs.

The n * top_k assignments are first laid out by expert in blocks of BLOCK_M rows, each block belonging to one
expert and each expert's rows padded to a whole number of blocks (`align_blocks`, two small kernels). Then one
launch per GEMM: a program takes one block and one BLOCK_N-wide tile of output columns, gathers its rows (x by
token for gate/up, the activations by assignment for down) and multiplies them by its expert's weights. The
gate/up GEMM applies SwiGLU in its epilogue, the down GEMM scales each row by its routing weight, and the top_k
rows of each token are summed by a third kernel (`sum_experts`; deterministic: no atomics in the sums). Every
shape depends only on (n, top_k, experts, hidden, intermediate), never on the routing, and nothing is read back
to the host, so a CUDA graph can hold the whole computation and replay it with new routing.

A batch of at most DIRECT_TOKENS tokens (a decode step at batch 1 or 2) skips the layout: its few rows are
weight reads, each expert's a row or two. One launch per assignment reads its expert's gate/up strips for
SwiGLU (`_direct_up`), and one per assignment reads its expert's down strips and scales them
(`_direct_down`), summed over the top_k by `sum_experts`: three launches a layer where the layout, the GEMMs
and the sum took five (a torch sum and a cast were two). (A program per token looping over its experts read
the down weights at ~0.6 TB/s on the H200: too few bytes in flight; session 31 found the same with the loop
over experts and K as one.)

`route` is the router before them in one launch (softmax, top-k, renormalisation, cast) where torch takes ~6.
"""
from __future__ import annotations

import torch

from .triton_launch import launch_kernel, let_next_launch, sm_count, wait_for_previous

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


DIRECT_TOKENS = 2  # at most this many tokens: the direct kernels, no layout by expert
SUM_BLOCK = 256  # most columns a `sum_experts` program sums
# L2 policy of the experts' weight loads: "evict_first" marks their lines to go first, so a layer's 75 MB of
# streamed experts (Qwen3-30B-A3B, one token) leave the small data every layer reads again (positions, block
# tables, keys and values, norm weights) in L2, as `triton_gemv`'s weight loads already do; "" for the default
WEIGHT_EVICTION = "evict_first"


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _align_count(experts, counts, ranks, sorted_ids, block_expert, n_assign, num_experts, max_padded, max_blocks,
                     CHUNK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # padding everywhere (sorted_ids = n_assign, block_expert = num_experts); each assignment's rank in its expert
        i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        tl.store(sorted_ids + i, tl.zeros_like(i) + n_assign, mask=i < max_padded)
        tl.store(block_expert + i, tl.zeros_like(i) + num_experts, mask=i < max_blocks)
        valid = i < n_assign
        e = tl.load(experts + i, mask=valid, other=0).to(tl.int32)
        tl.store(ranks + i, tl.atomic_add(counts + e, 1, mask=valid), mask=valid)

    @triton.jit
    def _align_place(experts, counts, ranks, sorted_ids, block_expert, n_assign, num_experts,
                     BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # each assignment to row (its expert's first row + rank); a block's first row names the block's expert
        ex = tl.arange(0, E_PAD)
        padded = (tl.load(counts + ex, mask=ex < num_experts, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = tl.cumsum(padded, 0) - padded  # [E_PAD]
        i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        valid = i < n_assign
        e = tl.load(experts + i, mask=valid, other=0).to(tl.int32)
        rank = tl.load(ranks + i, mask=valid, other=0)
        row = tl.gather(starts, e, 0) + rank
        tl.store(sorted_ids + row, i, mask=valid)
        tl.store(block_expert + row // BLOCK_M, e, mask=valid & (rank % BLOCK_M == 0))

    @triton.jit
    def _expert_gemm(A, W, Out, Scale, sorted_ids, block_expert, n_assign, num_experts, N, K,
                     stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om,
                     ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Out[i, cols] for the assignments i of one block of expert e, from row i // ROWS_PER_A of A:
        # GATED: silu(A @ W[e, :N]^T) * (A @ W[e, N:2N]^T); else Scale[i] * (A @ W[e]^T)
        e = tl.load(block_expert + tl.program_id(0))
        if e == num_experts:
            return
        ids = tl.load(sorted_ids + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        valid = ids < n_assign
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + (ids // ROWS_PER_A).to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
        w_ptrs = W + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            kmask = ks < K - k
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            wmask = kmask[:, None] & cmask[None, :]
            w = tl.load(w_ptrs, mask=wmask, other=0.0, eviction_policy=EVICT)  # [BLOCK_K, BLOCK_N]
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                up = tl.load(w_ptrs + N * stride_wn, mask=wmask, other=0.0, eviction_policy=EVICT)  # [BLOCK_K, BLOCK_N]
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        let_next_launch(PDL)
        dtype = Out.dtype.element_ty
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(dtype) * acc_up.to(dtype)
        else:
            out = acc.to(dtype) * tl.load(Scale + ids, mask=valid, other=0.0)[:, None]
        tl.store(Out + ids.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(dtype),
                 mask=valid[:, None] & cmask[None, :])

    @triton.jit
    def _route(Logits, Weights, Experts, stride_ln, stride_le, num_experts, TOP_K: tl.constexpr,
               K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # one token: softmax over the experts in fp32, then TOP_K rounds of argmax (lowest index on ties) and mask
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < num_experts
        x = tl.load(Logits + row * stride_ln + cols * stride_le, mask=valid, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # [BLOCK]; padding below every probability
        ks = tl.arange(0, K_PAD)
        w = tl.zeros((K_PAD,), tl.float32)
        ids = tl.zeros((K_PAD,), tl.int32)
        for k in tl.static_range(TOP_K):
            best, i = tl.max(p, 0, return_indices=True, return_indices_tie_break_left=True)
            w = tl.where(ks == k, best, w)
            ids = tl.where(ks == k, tl.minimum(i, num_experts - 1), ids)  # clamped: NaN logits stay in range
            p = tl.where(cols == i, -2.0, p)
        if RENORM:
            w = w / tl.sum(w, 0)
        tl.store(Weights + row * TOP_K + ks, w.to(Weights.dtype.element_ty), mask=ks < TOP_K)
        tl.store(Experts + row * TOP_K + ks, ids, mask=ks < TOP_K)


if triton is not None:
    @triton.jit
    def _direct_up(X, W13, Experts, Act, Parts, inter, hidden, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
                   stride_am, num_parts, eps, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   RMS: tl.constexpr, PARTS_PAD: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Act[a, cols] = silu(x[t] @ W13[e, cols]^T) * (x[t] @ W13[e, inter + cols]^T) for assignment a = t * TOP_K + j;
        # RMS: both products divided by the rms of row t, its sum of squares over hidden the sum of Parts[t]
        a = tl.program_id(0)
        e = tl.load(Experts + a).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < inter
        ks = tl.arange(0, BLOCK_K)
        if RMS:  # loaded before the weights stream, not after
            p = tl.arange(0, PARTS_PAD)
            total = tl.sum(tl.load(Parts + (a // TOP_K) * num_parts + p, mask=p < num_parts, other=0.0), 0)
        x_ptrs = X + (a // TOP_K).to(tl.int64) * stride_xm + ks * stride_xk  # [BLOCK_K]
        w_ptrs = W13 + e * stride_we + cols[:, None] * stride_wn + ks[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        gate = tl.zeros((BLOCK_N,), tl.float32)
        up = tl.zeros((BLOCK_N,), tl.float32)
        for k in range(0, hidden, BLOCK_K):
            kmask = ks < hidden - k
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)[None, :]
            wmask = nmask[:, None] & kmask[None, :]
            w_gate = tl.load(w_ptrs, mask=wmask, other=0.0, eviction_policy=EVICT)  # [BLOCK_N, BLOCK_K]
            w_up = tl.load(w_ptrs + inter * stride_wn, mask=wmask, other=0.0, eviction_policy=EVICT)
            gate += tl.sum(w_gate.to(tl.float32) * x, 1)
            up += tl.sum(w_up.to(tl.float32) * x, 1)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        let_next_launch(PDL)
        if RMS:
            rms = tl.sqrt(total / hidden + eps)
            gate = gate / rms
            up = up / rms
        dtype = Act.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        tl.store(Act + a * stride_am + cols, ((g / (1.0 + tl.exp(-g))).to(dtype) * up.to(dtype)).to(dtype),
                 mask=nmask)

    @triton.jit
    def _direct_down(Act, W2, Experts, Weights, Part, hidden, inter, stride_am, stride_we, stride_wn, stride_wk,
                     stride_pm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Part[a, cols] = Weights[a] * (Act[a] @ W2[e, cols]^T) for assignment a, e = Experts[a], in fp32
        a = tl.program_id(0)
        e = tl.load(Experts + a).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        act_ptrs = Act + a * stride_am + ks
        w_ptrs = W2 + e * stride_we + cols[:, None] * stride_wn + ks[None, :] * stride_wk
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k in range(0, inter, BLOCK_K):
            kmask = ks < inter - k
            act = tl.load(act_ptrs, mask=kmask, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0, eviction_policy=EVICT).to(tl.float32)
            acc += tl.sum(w * act, 1)
            act_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        let_next_launch(PDL)
        dtype = Act.dtype.element_ty
        tl.store(Part + a * stride_pm + cols, (acc.to(dtype) * tl.load(Weights + a)).to(tl.float32),
                 mask=nmask)  # as the GEMM's epilogue rounds it

    @triton.jit
    def _sum_experts(Part, Out, R, PartsOut, Scale, Scaled, hidden, stride_pm, stride_om, stride_rm,
                     TOP_K: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, SCALE: tl.constexpr,
                     PDL: tl.constexpr):
        wait_for_previous(PDL)
        # Out[t, cols] = sum over j < TOP_K of Part[t * TOP_K + j, cols], in fp32 in j order, then Out's dtype;
        # RESIDUAL: + R[t] (rounded as _add_rms_norm rounds the stream), PartsOut[t, program] its sum of squares
        # over cols; SCALE: Scaled[t, cols] = Out * Scale (the next norm's inputs, as triton_gemv's epilogue)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        if RESIDUAL:  # every load first: one memory round trip
            r = tl.load(R + t.to(tl.int64) * stride_rm + cols, mask=mask, other=0.0)
            if SCALE:
                weight = tl.load(Scale + cols, mask=mask, other=0.0)
        total = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(TOP_K):
            row = (t * TOP_K + j).to(tl.int64)
            total += tl.load(Part + row * stride_pm + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = Out.dtype.element_ty
        y = total.to(dtype)
        if RESIDUAL:
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
            yf = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(PartsOut + t * tl.num_programs(1) + tl.program_id(1), tl.sum(yf * yf, 0))
            if SCALE:
                scaled = y * weight
                tl.store(Scaled + t.to(tl.int64) * stride_om + cols, scaled, mask=mask)
        tl.store(Out + t.to(tl.int64) * stride_om + cols, y, mask=mask)


def sum_experts(part: torch.Tensor, top_k: int, dtype: torch.dtype, residual: torch.Tensor | None = None,
                scale: torch.Tensor | None = None):
    """part [n * top_k, hidden] (each token's top_k rows together) -> [n, hidden] in dtype: the sum of each token's
    rows in fp32, in row order, rounded once (what part.view(n, top_k, hidden).sum(1) then a cast give, in one
    launch instead of two).

    With residual [n, hidden] (a decoder layer's stream before the experts), as `triton_gemv.gemv`'s residual
    epilogue: returns (that sum + residual, parts [n, programs] fp32 of its squares, and with scale [hidden] the
    sum times scale, else None): the next norm's inputs, where `add_rms_norm` would be one launch more."""
    rows, hidden = part.shape
    n = rows // top_k
    out = torch.empty(n, hidden, dtype=dtype, device=part.device)  # [n, hidden]
    block = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    programs = triton.cdiv(hidden, block)
    parts = torch.empty(n, programs, dtype=torch.float32, device=part.device) if residual is not None else None
    scaled = torch.empty_like(out) if scale is not None else None
    if rows:
        r = residual if residual is not None else out
        launch_kernel(_sum_experts, (n, programs), part, out, r, out if parts is None else parts,
                      out if scale is None else scale, out if scaled is None else scaled, hidden, part.stride(0),
                      out.stride(0), r.stride(0), TOP_K=top_k, BLOCK=block, RESIDUAL=residual is not None,
                      SCALE=scale is not None, num_warps=4)
    if residual is None:
        return out
    return out, parts, scaled


def block_n(n: int, sms: int) -> int:
    """Rows of W per program: 32, halved (to 8) while that leaves fewer than two programs per SM."""
    size = 32
    while size > 8 and triton.cdiv(n, size) < 2 * sms:
        size //= 2
    return size


DirectLaunch = tuple[int, int, int]  # (BLOCK_N, BLOCK_K, num_warps); BLOCK_N 0: `block_n`'s choice
# measured on the H200 (Qwen3-30B-A3B shape, one token): up + down 31-32 us a layer against 41 with (0, 128, 4)
DIRECT_UP: DirectLaunch = (4, 1024, 4)
DIRECT_DOWN: DirectLaunch = (8, 256, 4)


def _direct(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor, up: DirectLaunch = DIRECT_UP, down: DirectLaunch = DIRECT_DOWN,
            rms: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
            scale: torch.Tensor | None = None):
    """`fused_experts` for a few tokens without the layout by expert: two launches and the sum (their settings:
    benchmarks/moe_direct_kernel.py compares them); rms, residual and scale as `direct_fused`."""
    n, hidden = x.shape
    top_k = experts.shape[1]
    inter = w2.shape[2]
    count = sm_count(x.device)
    flat_experts = experts.contiguous().view(-1)  # [n * top_k]
    routing = weights.contiguous().view(-1)  # [n * top_k]
    act = torch.empty(n * top_k, inter, dtype=x.dtype, device=x.device)  # [n * top_k, I]
    size = up[0] or block_n(n * top_k * inter, count)
    parts, eps = rms if rms is not None else (act, 0.0)
    num_parts = parts.shape[1] if rms is not None else 1
    launch_kernel(_direct_up, (n * top_k, triton.cdiv(inter, size)), x, w13, flat_experts, act, parts, inter, hidden,
                  x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), num_parts, eps,
                  TOP_K=top_k, BLOCK_N=size, BLOCK_K=up[1], RMS=rms is not None,
                  PARTS_PAD=triton.next_power_of_2(num_parts), EVICT=WEIGHT_EVICTION, num_warps=up[2])
    part = torch.empty(n * top_k, hidden, dtype=torch.float32, device=x.device)  # [n * top_k, hidden]
    size = down[0] or block_n(n * top_k * hidden, count)
    launch_kernel(_direct_down, (n * top_k, triton.cdiv(hidden, size)), act, w2, flat_experts, routing, part, hidden,
                  inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), part.stride(0), BLOCK_N=size,
                  BLOCK_K=down[1], EVICT=WEIGHT_EVICTION, num_warps=down[2])
    return sum_experts(part, top_k, x.dtype, residual, scale)  # [n, hidden] (with residual: and the next norm's)


def direct_fused(scaled: torch.Tensor, rms: tuple[torch.Tensor, float], w13: torch.Tensor, w2: torch.Tensor,
                 weights: torch.Tensor, experts: torch.Tensor, residual: torch.Tensor,
                 scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decoder layer's experts for at most DIRECT_TOKENS tokens with the norms around them fused
    (`LlamaModel.fused_rows`): scaled [n, hidden] (the stream times the post-attention norm's weight) and rms
    (the stream's sums of squares in parts [n, p], eps) as `triton_gemv.gemv`'s rms; residual [n, hidden], the
    stream; scale [hidden], the next layer's input norm weight (None: last layer). Returns the stream after the
    experts, its parts and it times scale (None without scale), as `triton_gemv.gemv`'s residual epilogue."""
    return _direct(scaled, w13, w2, weights, experts, rms=rms, residual=residual, scale=scale)


def _config(n_assign: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Small batches are bound by the weight reads: blocks of 16 rows (the least
    for tl.dot) and long K steps. Once experts average 16 rows or more, 64-row blocks read each expert's weights
    fewer times."""
    if n_assign < 16 * num_experts:
        return 16, 64, 128
    return 64, 64, 64


def align_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [n, top_k] -> (sorted_ids [max_padded] int32, block_expert [max_padded // block_m] int32).

    sorted_ids lists the assignments (t * top_k + k) grouped by expert (in no set order within an expert), each
    expert's group padded with the sentinel n * top_k to a multiple of block_m; block_expert is each block's
    expert, num_experts for the unused blocks at the end. max_padded covers the worst case, so the shapes do not
    depend on the routing. Two launches: count (atomics give each assignment its rank), then place."""
    flat = experts.contiguous().view(-1)  # [n * top_k]
    n_assign = flat.numel()
    max_padded = triton.cdiv(n_assign + min(n_assign, num_experts) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)  # [E]
    ranks = torch.empty(n_assign, dtype=torch.int32, device=flat.device)  # [n * top_k]
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=flat.device)
    chunk = 256
    launch_kernel(_align_count, (triton.cdiv(max_padded, chunk),), flat, counts, ranks, sorted_ids, block_expert,
                  n_assign, num_experts, max_padded, max_padded // block_m, CHUNK=chunk)
    launch_kernel(_align_place, (triton.cdiv(n_assign, chunk),), flat, counts, ranks, sorted_ids, block_expert,
                  n_assign, num_experts, BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts), CHUNK=chunk)
    return sorted_ids, block_expert


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor) -> torch.Tensor:
    """x [n, hidden], w13 [E, 2 * I, hidden] (gate rows, then up rows), w2 [E, hidden, I], weights and experts
    [n, top_k] -> [n, hidden] in x's dtype: the sum over each token's experts of weight * SwiGLU MLP(x), as in
    `moe.Experts.forward` (without the tensor-parallel all-reduce). No host sync: CUDA-graph safe."""
    n, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, inter = w2.shape[0], w2.shape[2]
    n_assign = n * top_k
    if n_assign == 0:
        return torch.zeros_like(x)
    if n <= DIRECT_TOKENS:
        return _direct(x, w13, w2, weights, experts)
    block_m, block_n, block_k = _config(n_assign, num_experts)
    sorted_ids, block_expert = align_blocks(experts, num_experts, block_m)
    scale = weights.contiguous().view(-1)  # [n * top_k]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(n_assign, inter, dtype=x.dtype, device=x.device)  # [n * top_k, I]
    launch_kernel(_expert_gemm, (block_expert.shape[0], triton.cdiv(inter, block_n)), x, w13, act, scale, sorted_ids,
                  block_expert, n_assign, num_experts, inter, hidden, x.stride(0), x.stride(1), w13.stride(0),
                  w13.stride(1), w13.stride(2), act.stride(0), ROWS_PER_A=top_k, GATED=True, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, EVICT=WEIGHT_EVICTION,
                  num_warps=4)
    y = torch.empty(n_assign, hidden, dtype=x.dtype, device=x.device)  # [n * top_k, hidden]
    launch_kernel(_expert_gemm, (block_expert.shape[0], triton.cdiv(hidden, block_n)), act, w2, y, scale, sorted_ids,
                  block_expert, n_assign, num_experts, hidden, inter, act.stride(0), act.stride(1), w2.stride(0),
                  w2.stride(1), w2.stride(2), y.stride(0), ROWS_PER_A=1, GATED=False, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, PRECISION=precision, EVICT=WEIGHT_EVICTION, num_warps=4)
    return sum_experts(y, top_k, x.dtype)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router in one launch: logits [n, E] (any float dtype; E up to about 512, one block) -> (weights
    [n, top_k] in out_dtype, experts [n, top_k] int32). Softmax over E in fp32, the top_k largest probabilities
    in descending order (ties to the lower expert index), optionally renormalised to sum 1: what
    torch.softmax(logits.float(), -1), torch.topk and a division give. One program per token, no host sync:
    CUDA-graph safe."""
    n, num_experts = logits.shape
    assert 0 < top_k <= num_experts
    weights = torch.empty(n, top_k, dtype=out_dtype, device=logits.device)  # [n, top_k]
    experts = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)  # [n, top_k]
    if n:
        block = triton.next_power_of_2(num_experts)
        launch_kernel(_route, (n,), logits, weights, experts, logits.stride(0), logits.stride(1), num_experts,
                      TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize, BLOCK=block,
                      num_warps=1 if block <= 128 else 4)
    return weights, experts
