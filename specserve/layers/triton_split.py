"""Split-K ("flash-decoding") for the paged-attention kernel of triton_attention: how many key splits a step
gets, and the kernel that merges the splits' partial results.

With splits, program (tile, kv head, split) of `_paged_attention` walks one contiguous range of its tile's keys
and writes, per row (query token, head), its running max m, its sum of exponentials l (relative to m) and its
unnormalised output acc into fp32 scratch laid out [tokens, heads, splits, (head_dim)]. `_combine_splits` then
merges the splits of each row: m = max_s m_s, w_s = exp(m_s - m), out = sum_s w_s acc_s / sum_s w_s l_s.
"""
from __future__ import annotations

import torch

from .triton_launch import launch_kernel, wait_for_previous

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backend is used instead
    triton = None

MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4  # each split walks at least this many BLOCK_N key blocks
WAVES = 4  # programs per multiprocessor that keep enough loads in flight to stream the KV at full bandwidth
MIN_LATENCY_SPLITS = 4  # fewer do not pay for the merge's launch (about two or three blocks' walk)
RESIDENT = 2  # `_paged_attention` programs a multiprocessor holds at once (96 KB of staged keys and values each)


if triton is not None:
    @triton.jit
    def _combine_splits(Acc, M, L, Out, stride_ot, stride_oh,
                        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # grid (tokens, heads); Acc [T, H, S, D], M, L [T, H, S] fp32; Out [T, H, D]
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, BLOCK_D)
        smask = s < NUM_SPLITS
        dmask = d < HEAD_DIM
        row = (tok * tl.num_programs(1) + head) * NUM_SPLITS + s  # [SPLITS_PAD]
        m_s = tl.load(M + row, mask=smask, other=float("-inf"))
        l_s = tl.load(L + row, mask=smask, other=0.0)
        m = tl.max(m_s, 0)
        w = tl.exp(m_s - tl.where(m == float("-inf"), 0.0, m))  # 0 for splits that saw no visible key
        total = tl.sum(l_s * w, 0)
        acc = tl.load(Acc + row[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.maximum(total, 1e-30)  # a row that sees no key at all: 0
        tl.store(Out + tok * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


def combine_splits(acc: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor, out: torch.Tensor
                   ) -> torch.Tensor:
    """fp32 partials (contiguous) acc [T, H, S, D], row_max (m), row_sum (l) [T, H, S] -> out [T, H, D], written
    in place."""
    tokens, heads, splits, head_dim = acc.shape
    if tokens == 0:
        return out
    launch_kernel(_combine_splits, (tokens, heads), acc, row_max, row_sum, out, out.stride(0), out.stride(1),
                  NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4)
    return out


def splits_for(num_tiles: int, kv_heads: int, max_kv: int, block_n: int, sms: int = 132,
               resident: int = RESIDENT) -> int:
    """Key splits per tile for a step of num_tiles tiles over contexts of up to max_kv keys: the larger of
    - latency: one block of block_n keys a split (the blocks of max_kv, rounded up to a power of two) while the
      (tile, KV head, split) programs stay one wave, `resident` a multiprocessor of the GPU's `sms`: a short
      context's walk is a chain of dependent loads, which splits cut short; none below MIN_LATENCY_SPLITS;
    - bandwidth: programs up to WAVES a multiprocessor, each split MIN_BLOCKS_PER_SPLIT blocks or more;
    at most MAX_SPLITS, rounded down to a power of two (each value is a kernel specialisation, compiled once).
    (H200, 8B shape: batch 16 at 16k keys takes 302 us a layer with 2 splits, 1 wave, and 252 with 4; batch 1
    at 32k 50 us with 32 splits and 43 with 64: benchmarks/attention_kernel.py. Qwen3-30B-A3B at batch 1, 288
    keys: 8 splits of one block, 2.92 ms a step against 3.17 unsplit: docs/performance.md session 35.)"""
    programs = num_tiles * kv_heads
    blocks = -(-max_kv // block_n)
    latency = min(1 << max(0, blocks - 1).bit_length(), resident * sms // programs)
    latency = latency if latency >= MIN_LATENCY_SPLITS else 1
    bandwidth = min(blocks // MIN_BLOCKS_PER_SPLIT, WAVES * sms // programs)
    fits = min(MAX_SPLITS, max(latency, bandwidth))
    return 1 << (fits.bit_length() - 1) if fits >= 2 else 1
