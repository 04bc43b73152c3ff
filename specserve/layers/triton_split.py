"""Split-K ("flash-decoding") for the paged-attention kernel of triton_attention: how many key splits a step
gets, and the kernel that merges the splits' partial results.

With splits, program (tile, kv head, split) of `_paged_attention` walks one contiguous range of its tile's keys
and writes, per row (query token, head), its running max m, its sum of exponentials l (relative to m) and its
unnormalised output acc into fp32 scratch laid out [tokens, heads, splits, (head_dim)]. `_combine_splits` then
merges the splits of each row: m = max_s m_s, w_s = exp(m_s - m), out = sum_s w_s acc_s / sum_s w_s l_s.
"""
from __future__ import annotations

import functools

import torch

from .triton_launch import pdl, wait_for_previous

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backend is used instead
    triton = None

MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4  # each split walks at least this many BLOCK_N key blocks
WAVES = 4  # programs per multiprocessor that keep enough loads in flight to stream the KV at full bandwidth


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
    _combine_splits[(tokens, heads)](
        acc, row_max, row_sum, out, out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4, **pdl(acc))
    return out


def splits_for(num_tiles: int, kv_heads: int, max_kv: int, block_n: int, sms: int = 132) -> int:
    """Key splits per tile: the largest power of two that keeps the (tile, KV head, split) programs within WAVES
    per multiprocessor of the GPU's `sms` (1 when the tiles alone reach that), at most MAX_SPLITS and at most
    the largest power of two that still gives each split MIN_BLOCKS_PER_SPLIT blocks of block_n keys of
    max_kv. Powers of two only: each value is a kernel specialisation (compiled once), so few values
    may occur. (H200, 8B shape: batch 16 at 16k keys takes 302 us a layer with 2 splits, 1 wave, and 252 with
    4; batch 1 at 32k 50 us with 32 splits and 43 with 64: benchmarks/attention_kernel.py.)"""
    fits = min(MAX_SPLITS, max_kv // (MIN_BLOCKS_PER_SPLIT * block_n), WAVES * sms // (num_tiles * kv_heads))
    return 1 << (fits.bit_length() - 1) if fits >= 2 else 1


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device; 132 (an H100 / H200) elsewhere."""
    device = torch.device(device)
    return _sm_count(device) if device.type == "cuda" else 132
