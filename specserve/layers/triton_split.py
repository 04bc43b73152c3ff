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
MIN_LATENCY_SPLITS = 4  # fewer do not pay for the merge's launch (about two or three blocks' walk)
MIN_WAVES = 4  # a grid of more programs than one wave: enough waves that the last one's tail costs little
COMBINE_WARPS = 4  # num_warps of `_combine_splits`
RESIDENT = 3  # `_paged_attention` programs a multiprocessor holds at once (head size 128: 71,680 bytes of shared
# memory each since the page numbers are loaded a tile ahead, so K and V get two buffers at three stages)


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
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=COMBINE_WARPS)
    return out


def splits_for(num_tiles: int, kv_heads: int, max_kv: int, block_n: int, sms: int = 132,
               resident: int = RESIDENT) -> int:
    """Key splits per tile for a step of num_tiles tiles over contexts of up to max_kv keys. A wave is `resident`
    programs on each of the GPU's `sms` multiprocessors; the (tile, KV head, split) programs should be at most one
    wave or many (MIN_WAVES): a grid of 1.3 waves runs its last 0.3 after the rest, one program a multiprocessor.
    - Programs of one split fill a wave or more: split further only to reach MIN_WAVES, each split walking
      MIN_BLOCKS_PER_SPLIT blocks of block_n keys or more.
    - Fewer: the larger of, each within one wave,
      - latency: one block a split (the blocks of max_kv, rounded up to a power of two): a short context's walk
        is a chain of dependent loads, which splits cut short; none below MIN_LATENCY_SPLITS;
      - bandwidth: each split MIN_BLOCKS_PER_SPLIT blocks or more.
    At most MAX_SPLITS, rounded down to a power of two (each value is a kernel specialisation, compiled once).
    (H200, 8B shape, the kernel alone, us a layer at the rule's choice / the old one's, which aimed at 4 programs a
    multiprocessor: batch 1 at 16k keys 24.6 (32 splits) / 28.1 (64: 512 programs, 1.3 waves of 3 x 132), at 32k
    40.1 / 50.4, batch 16 at 4k 69.1 (2) / 82.6 (4), at 16k 249.6 / 300.9, batch 64 at 4k 268.7 (4) / 310.3 (1);
    docs/performance.md session 60.)"""
    programs = num_tiles * kv_heads
    blocks = -(-max_kv // block_n)
    wave = resident * sms
    if programs >= wave:
        splits = 1
        while programs * splits < MIN_WAVES * wave and blocks // (2 * splits) >= MIN_BLOCKS_PER_SPLIT:
            splits *= 2
        return splits
    latency = min(1 << max(0, blocks - 1).bit_length(), wave // programs)
    latency = latency if latency >= MIN_LATENCY_SPLITS else 1
    bandwidth = min(blocks // MIN_BLOCKS_PER_SPLIT, wave // programs)
    fits = min(MAX_SPLITS, max(latency, bandwidth))
    return 1 << (fits.bit_length() - 1) if fits >= 2 else 1
