"""Paged attention on CUDA: one Triton kernel for prefill chunks, decode and tree-masked verify.

The kernel reads keys and values straight from the paged cache through the block table, so a step
costs what its live KV costs (no gather into padded tensors). Work is cut into *tiles*: up to
BLOCK_Q query tokens of one sequence, times the query heads sharing one KV head (grouped-query
attention), so a tile's rows are (query token, head) pairs. Each tile walks the sequence's keys in
BLOCK_N chunks with an online softmax (flash attention).

Visibility follows `attention.build_metadata`: query i of a sequence with q new tokens and kv length
L sits at kv index L - q + i and sees every key up to it; when a tree of m nodes is given, the last m
keys are visible only where the query token's bitmask (bit j = key L - m + j) says so.

All metadata tensors have fixed shapes for a given (batch, tokens per sequence), so decode and
verify steps can be captured in CUDA graphs and replayed after refilling the tensors in place.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import torch

from ..device import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backend is used instead
    triton = None

MAX_TREE = 64  # tree-masked keys per sequence (bits of one int64)


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_attention(
        Q, KC, VC, Out,  # Q, Out [T, H, D]; KC, VC [slots, Hkv, D]
        block_tables, seq_lens, q_starts, q_lens, tree_bits, tree_lens, tile_seq, tile_q0,
        stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh, stride_bt,
        scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
        SKIP_FIRST: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.load(tile_seq + tile)
        q0 = tl.load(tile_q0 + tile)
        L = tl.load(seq_lens + b)
        qn = tl.load(q_lens + b)
        qs = tl.load(q_starts + b)
        tree_start = L - tl.load(tree_lens + b)
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        qi = q0 + rows // GROUP_PAD
        g = rows % GROUP_PAD
        valid = (qi < qn) & (g < GROUP)
        head = kvh * GROUP + g
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        tok = (qs + qi).to(tl.int64)
        q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        causal = L - qn + qi  # kv index of each row's query token
        bits = tl.load(tree_bits + tok, mask=valid, other=0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(L, L - qn + q0 + BLOCK_Q)
        for start in range(0, kv_end, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jvalid = j < kv_end
            page = tl.load(block_tables + b * stride_bt + j // PAGE, mask=jvalid, other=0)
            slot = page.to(tl.int64) * PAGE + j % PAGE
            kv_off = slot[:, None] * stride_ct + kvh * stride_ch + d[None, :]
            kv_mask = jvalid[:, None] & dmask[None, :]
            k = tl.load(KC + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N]
            shift = tl.maximum(j - tree_start, 0).to(tl.int64)
            in_tree = (j >= tree_start)[None, :]
            tree_ok = ((bits[:, None] >> shift[None, :]) & 1) != 0
            visible = (j[None, :] <= causal[:, None]) & jvalid[None, :] & (~in_tree | tree_ok)
            if SKIP_FIRST:
                visible = visible & (j[None, :] > 0)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=valid[:, None] & dmask[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_q_for(max_q: int, group: int) -> int:
    """Query tokens per tile: enough rows for the tensor cores (16), at most 64 rows for prefill."""
    group_pad = _pow2(group)
    least = max(1, 16 // group_pad)
    if max_q <= 16:
        return max(least, _pow2(max_q))
    return max(least, 64 // group_pad)


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32 kv length including the new tokens
    q_starts: torch.Tensor  # [batch] int32 flat index of each sequence's first new token
    q_lens: torch.Tensor  # [batch] int32
    tree_bits: torch.Tensor  # [num_tokens] int64 visibility of the last tree_lens[b] keys
    tree_lens: torch.Tensor  # [batch] int32 (0 = causal only)
    tile_seq: torch.Tensor  # [num_tiles] int32 sequence of each tile
    tile_q0: torch.Tensor  # [num_tiles] int32 first query token of each tile within its sequence
    block_q: int
    page: int
    skip_first_key: bool = False  # key 0 of every sequence hidden
    kv_cache: Optional[torch.Tensor] = None  # [layers, 2, slots, kv_heads, head_dim]
    fuses_kv_write: ClassVar[bool] = True  # the model may write rotated keys and values itself (rope_and_cache)

    def without_first_key(self) -> "TritonMetadata":
        """The same step with key 0 of every sequence hidden (the EAGLE-3 draft stores pairs one slot late)."""
        return replace(self, skip_first_key=True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
               scale: float, kv_written: bool = False) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]; cache [2, slots, Hkv, D] -> [T, H, D]
        if not kv_written:
            cache[0, self.slot_mapping] = k
            cache[1, self.slot_mapping] = v
        out = torch.empty_like(q)
        heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        group = heads // kv_heads
        kc, vc = cache[0], cache[1]
        _paged_attention[(self.tile_seq.shape[0], kv_heads)](
            q, kc, vc, out, self.block_tables, self.seq_lens, self.q_starts, self.q_lens, self.tree_bits,
            self.tree_lens, self.tile_seq, self.tile_q0,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), out.stride(0), out.stride(1),
            self.block_tables.stride(0), scale,
            GROUP=group, GROUP_PAD=_pow2(group), BLOCK_Q=self.block_q, BLOCK_N=64 if head_dim <= 128 else 32,
            HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)), PAGE=self.page,
            IEEE=q.dtype == torch.float32, SKIP_FIRST=self.skip_first_key, num_warps=4)
        return out


def tree_bitmask(tree: torch.Tensor) -> torch.Tensor:
    """[..., q, m] bool visibility over the last m keys -> [..., q] int64 (bit j = key j), same device."""
    m = tree.shape[-1]
    if m > MAX_TREE:
        raise ValueError(f"tree attention covers at most {MAX_TREE} keys, got {m}")
    shifts = torch.arange(m, device=tree.device, dtype=torch.long)
    return (tree.long() << shifts).sum(-1)  # distinct bits: the sum is their OR, bit 63 wraps to the sign


def tree_bits(trees: list[Optional[torch.Tensor]], q_lens: list[int], device: torch.device) -> torch.Tensor:
    """[num_tokens] int64 bitmasks of a step's queries (0 for sequences without a tree)."""
    if all(t is not None for t in trees) and len({tuple(t.shape) for t in trees}) == 1:
        return tree_bitmask(to_device(torch.stack(trees), torch.bool, device)).reshape(-1)
    parts = [tree_bitmask(to_device(t, torch.bool, device)) if t is not None
             else torch.zeros(q, dtype=torch.long, device=device)
             for t, q in zip(trees, q_lens)]
    return torch.cat(parts)


def build_triton_metadata(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                          device: torch.device, group: int,
                          tree_masks: Optional[list[Optional[torch.Tensor]]] = None,
                          kv_cache: Optional[torch.Tensor] = None) -> TritonMetadata:
    """The triton backend's metadata (the contract of attention.AttentionBackend.metadata)."""
    from .attention import new_token_slots, padded_tables

    batch = len(q_lens)
    block_q = block_q_for(max(q_lens), group)
    q_starts, tree_lens, tile_seq, tile_q0 = [], [], [], []
    start = 0
    for i, q in enumerate(q_lens):
        q_starts.append(start)
        tree = tree_masks[i] if tree_masks is not None else None
        tree_lens.append(tree.shape[1] if tree is not None else 0)
        for q0 in range(0, q, block_q):
            tile_seq.append(i)
            tile_q0.append(q0)
        start += q

    def t(values, dtype=torch.int32):
        return to_device(values, dtype, device)

    slots = new_token_slots(q_lens, seq_lens, block_tables, block_size)
    return TritonMetadata(slot_mapping=t(slots, torch.long), block_tables=t(padded_tables(block_tables)),
                          seq_lens=t(seq_lens), q_starts=t(q_starts), q_lens=t(q_lens),
                          tree_bits=tree_bits(tree_masks or [None] * batch, q_lens, device), tree_lens=t(tree_lens),
                          tile_seq=t(tile_seq),
                          tile_q0=t(tile_q0), block_q=block_q, page=block_size, kv_cache=kv_cache)


def static_triton_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           q_lens: torch.Tensor, tree_bits: torch.Tensor, tree_lens: torch.Tensor, q: int, group: int,
                           page: int, kv_cache: torch.Tensor, skip_first_key: bool,
                           constants: dict) -> TritonMetadata:
    """The triton backend's metadata over fixed-shape device tensors (attention.AttentionBackend.static_metadata):
    one tile per sequence of at most q <= 16 queries. `constants` caches the tile tensors per (batch, q)."""
    bs, dev = seq_lens.shape[0], seq_lens.device
    key = (bs, q, dev)
    if key not in constants:  # made in a capture's warm-up run, outside the graph
        i32 = dict(dtype=torch.int32, device=dev)
        constants[key] = (torch.arange(0, bs * q, q, **i32), torch.arange(bs, **i32), torch.zeros(bs, **i32))
    q_starts, tile_seq, tile_q0 = constants[key]
    return TritonMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, q_starts=q_starts,
                          q_lens=q_lens, tree_bits=tree_bits, tree_lens=tree_lens, tile_seq=tile_seq, tile_q0=tile_q0,
                          block_q=block_q_for(q, group), page=page, skip_first_key=skip_first_key, kv_cache=kv_cache)
