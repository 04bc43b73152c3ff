"""Paged attention on CUDA: one Triton kernel for prefill chunks, decode and tree-masked verify.

The kernel reads keys and values straight from the paged cache through the block table, so a step
costs what its live KV costs (no gather into padded tensors). Work is cut into *tiles*: up to
BLOCK_Q query tokens of one sequence, times the query heads sharing one KV head (grouped-query
attention), so a tile's rows are (query token, head) pairs. Each tile walks the sequence's keys in
BLOCK_N chunks with an online softmax (flash attention).

Split-K ("flash-decoding", triton_split): at batch 1 a decode step has only one tile per KV head, too few
programs to keep a GPU's multiprocessors busy while they stream a long context, and a short context's walk is a
chain of dependent loads that one program takes in turn. The grid then gets a third
dimension of `num_splits` (TritonMetadata, chosen by triton_split.splits_for from the step's shape): program
`split` walks only keys [split * chunk, (split + 1) * chunk) of its tile's kv_end keys, with
chunk = ceil(ceil(kv_end / num_splits) / BLOCK_N) * BLOCK_N computed in the kernel from the tile's own kv_end.
So the grid depends only on shapes, and a CUDA graph captured with a fixed num_splits stays correct at any
replayed length (splits past the end write a neutral partial). The splits write fp32 partials (max, sum of
exponentials, unnormalised output) to scratch that a second kernel merges. With one split the kernel writes
the normalised output directly, as before.

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

from ..device import Constants, to_device
from .triton_launch import launch_kernel, let_next_launch, sm_count, wait_for_previous
from .triton_split import combine_splits, splits_for

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
        PartAcc, PartM, PartL,  # NUM_SPLITS > 1: fp32 partials PartAcc [T, H, NUM_SPLITS, D], PartM, PartL [T, H, S]
        block_tables, seq_lens, q_starts, q_lens, tree_bits, tree_lens, tile_seq, tile_q0,
        stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh, stride_bt,
        scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
        SKIP_FIRST: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGES_AHEAD: tl.constexpr, UNIFORM_Q: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_previous(PDL)
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        if UNIFORM_Q:  # tile b is sequence b, whose queries start at b * UNIFORM_Q: no tile loads ahead of the rest
            b = tile
            q0 = 0
            qs = tile * UNIFORM_Q
        else:
            b = tl.load(tile_seq + tile)
            q0 = tl.load(tile_q0 + tile)
            qs = tl.load(q_starts + b)
        L = tl.load(seq_lens + b)
        qn = tl.load(q_lens + b)
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
        kv_end = tl.minimum(L, L - qn + q0 + BLOCK_Q)  # keys [0, kv_end) are visible to some row of the tile
        if NUM_SPLITS == 1:
            lo = 0
            hi = kv_end
        else:  # this split's share of them; empty for splits past the end (padding rows: kv_end <= 0)
            kv_end = tl.maximum(kv_end, 0)
            chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = tl.program_id(2) * chunk
            hi = tl.minimum(lo + chunk, kv_end)
        table = block_tables + b * stride_bt
        if PAGES_AHEAD:  # each tile's page numbers loaded a tile ahead: K and V get pipeline buffers (session 53)
            j_ahead = lo + tl.arange(0, BLOCK_N)
            page_ahead = tl.load(table + j_ahead // PAGE, mask=j_ahead < hi, other=0)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jvalid = j < hi
            if PAGES_AHEAD:
                page = page_ahead
                page_ahead = tl.load(table + (j + BLOCK_N) // PAGE, mask=j + BLOCK_N < hi, other=0)
            else:
                page = tl.load(table + j // PAGE, mask=jvalid, other=0)
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
        let_next_launch(PDL)
        if NUM_SPLITS == 1:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=valid[:, None] & dmask[None, :])
        else:  # unnormalised; a split that saw no visible key leaves m = -inf, l = 0, acc = 0
            row = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + tl.program_id(2)  # [BLOCK_M]
            tl.store(PartM + row, m_i, mask=valid)
            tl.store(PartL + row, l_i, mask=valid)
            tl.store(PartAcc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=valid[:, None] & dmask[None, :])


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_n_for(head_dim: int) -> int:
    """Keys per step of a tile's walk (fewer for wide heads: registers)."""
    return 64 if head_dim <= 128 else 32


PAGES_AHEAD = True  # load each tile's page numbers a tile ahead of its keys
UNIFORM_TILES = True  # steps whose sequences have one tile each (decode, verify) index tiles without loading them
STAGES = None  # num_stages of the launch (None: Triton's default)


def launch_options(head_dim: int) -> dict:
    """BLOCK_N and the launch settings of `_paged_attention` (benchmarks/attention_kernel.py tries others)."""
    stages = {} if STAGES is None else {"num_stages": STAGES}
    return {"BLOCK_N": block_n_for(head_dim), "num_warps": 4, "PAGES_AHEAD": PAGES_AHEAD, **stages}


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
    num_splits: int = 1  # key splits per tile (triton_split.splits_for): 1 = one program walks the whole context
    uniform_q: int = 0  # q > 0: every sequence has q query slots and one tile (tile_seq = arange, q_starts = b * q)
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
        if q.stride(-1) != 1:  # the kernel reads a head's values side by side (a CPU linear's output is not)
            q = q.contiguous()
        out = torch.empty_like(q)
        (tokens, heads, head_dim), kv_heads, splits = q.shape, k.shape[1], self.num_splits
        if splits == 1:
            acc = row_max = row_sum = out  # not read
        else:  # fp32 partials of each (token, head, split), merged into out by combine_splits
            acc = torch.empty(tokens, heads, splits, head_dim, dtype=torch.float32, device=q.device)
            row_max, row_sum = torch.empty(2, tokens, heads, splits, dtype=torch.float32, device=q.device)
        group = heads // kv_heads
        kc, vc = cache[0], cache[1]
        launch_kernel(_paged_attention, (self.tile_seq.shape[0], kv_heads, splits), q, kc, vc, out, acc, row_max,
                      row_sum, self.block_tables, self.seq_lens, self.q_starts, self.q_lens, self.tree_bits,
                      self.tree_lens, self.tile_seq, self.tile_q0, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
                      out.stride(0), out.stride(1), self.block_tables.stride(0), scale, GROUP=group,
                      GROUP_PAD=_pow2(group), BLOCK_Q=self.block_q, HEAD_DIM=head_dim, BLOCK_D=max(16, _pow2(head_dim)),
                      PAGE=self.page, IEEE=q.dtype == torch.float32, SKIP_FIRST=self.skip_first_key, NUM_SPLITS=splits,
                      UNIFORM_Q=self.uniform_q if UNIFORM_TILES else 0, **launch_options(head_dim))
        return out if splits == 1 else combine_splits(acc, row_max, row_sum, out)


def auto_splits(num_tiles: int, max_kv: int, kv_cache: torch.Tensor, device: torch.device) -> int:
    """triton_split.splits_for a step of num_tiles tiles over contexts of up to max_kv keys, with the KV heads and
    head size of kv_cache ([layers, 2, slots, kv_heads, head_dim]) and the multiprocessors of device."""
    kv_heads, head_dim = kv_cache.shape[-2:]
    return splits_for(num_tiles, kv_heads, max_kv, block_n_for(head_dim), sm_count(device))


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


def tiles_of(q_lens: list[int], block_q: int) -> tuple[list[int], list[int], list[int]]:
    """Each sequence's first flat token (q_starts) and the tiles that cover its queries: per tile its sequence
    and its first query within it, block_q queries a tile."""
    q_starts, tile_seq, tile_q0, start = [], [], [], 0
    for i, q in enumerate(q_lens):
        q_starts.append(start)
        tile_seq.extend([i] * -(-q // block_q))
        tile_q0.extend(range(0, q, block_q))
        start += q
    return q_starts, tile_seq, tile_q0


class MixedTiles:
    """The tile tensors of steps whose rows have any query lengths (prefill chunks beside decode tokens), for
    CUDA graphs of up to `max_tokens` tokens and `max_rows` rows: the host refills them before each replay
    (`fill`). Row `max_rows` is the padding row (its seq_lens and q_lens entries stay 0): the tiles past a step's
    own point at it and do nothing. A graph of `tokens` tokens launches `view(tokens)`'s tiles."""

    def __init__(self, max_tokens: int, max_rows: int, group: int, device: torch.device):
        self.block_q = block_q_for(max_tokens, group)
        self.pad_row = max_rows
        i32 = dict(dtype=torch.int32, device=device)
        self.q_starts = torch.zeros(max_rows + 1, **i32)
        self.tiles = torch.zeros(2, self._count(max_tokens), **i32)  # [tile_seq, tile_q0]
        self.tiles[0].fill_(max_rows)

    def _count(self, tokens: int) -> int:
        return tokens // self.block_q + self.pad_row  # the most tiles `tiles_of` gives for `tokens` queries

    def view(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """static_triton_metadata's `tiles` of a graph of `tokens` tokens."""
        n = self._count(tokens)
        return self.q_starts, self.tiles[0, :n], self.tiles[1, :n], self.block_q

    def fill(self, q_lens: list[int], tokens: int) -> None:
        """Set the tiles of a step of these rows (sum(q_lens) <= tokens, len(q_lens) <= max_rows) in a graph of
        `tokens` tokens."""
        q_starts, tile_seq, tile_q0 = tiles_of(q_lens, self.block_q)
        pad = self._count(tokens) - len(tile_seq)
        values = to_device(q_starts + tile_seq + [self.pad_row] * pad + tile_q0 + [0] * pad, torch.int32,
                           self.q_starts.device)
        rows, n = len(q_starts), len(tile_seq) + pad
        self.q_starts[:rows].copy_(values[:rows])
        self.tiles[:, :n].copy_(values[rows:].view(2, n))


def build_triton_metadata(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                          device: torch.device, group: int,
                          tree_masks: Optional[list[Optional[torch.Tensor]]] = None,
                          kv_cache: Optional[torch.Tensor] = None, num_splits: Optional[int] = None) -> TritonMetadata:
    """The triton backend's metadata (the contract of attention.AttentionBackend.metadata). num_splits: key
    splits per tile; by default `auto_splits` of the step (1 without kv_cache, whose shape it needs)."""
    from .attention import new_token_slots, padded_tables

    batch = len(q_lens)
    block_q = block_q_for(max(q_lens), group)
    q_starts, tile_seq, tile_q0 = tiles_of(q_lens, block_q)
    tree_lens = [0 if tree_masks is None or tree_masks[i] is None else tree_masks[i].shape[1] for i in range(batch)]

    def t(values, dtype=torch.int32):
        return to_device(values, dtype, device)

    slots = new_token_slots(q_lens, seq_lens, block_tables, block_size)
    uniform = q_lens[0] if len(set(q_lens)) == 1 and q_lens[0] <= block_q else 0
    if num_splits is None:
        num_splits = 1 if kv_cache is None else auto_splits(len(tile_seq), max(seq_lens), kv_cache, device)
    return TritonMetadata(slot_mapping=t(slots, torch.long), block_tables=t(padded_tables(block_tables)),
                          seq_lens=t(seq_lens), q_starts=t(q_starts), q_lens=t(q_lens),
                          tree_bits=tree_bits(tree_masks or [None] * batch, q_lens, device), tree_lens=t(tree_lens),
                          tile_seq=t(tile_seq),
                          tile_q0=t(tile_q0), block_q=block_q, page=block_size, kv_cache=kv_cache,
                          num_splits=num_splits, uniform_q=uniform)


def static_triton_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           q_lens: torch.Tensor, tree_bits: torch.Tensor, tree_lens: torch.Tensor, q: int, group: int,
                           page: int, kv_cache: torch.Tensor, skip_first_key: bool,
                           constants: Constants, num_splits: Optional[int] = None, tiles=None) -> TritonMetadata:
    """The triton backend's metadata over fixed-shape device tensors (attention.AttentionBackend.static_metadata):
    one tile per sequence of at most q <= 16 queries (their tile tensors from `constants`, made in a warm-up run), or
    the given `tiles` (q_starts [batch], tile_seq, tile_q0 [num_tiles] int32, block_q), which the host refills.
    num_splits: key splits per tile; by default `auto_splits` at the longest context the block tables can hold
    (the kernel sizes each split's share from the live length, so shorter replays stay correct)."""
    bs, dev = seq_lens.shape[0], seq_lens.device
    if tiles is not None:
        q_starts, tile_seq, tile_q0, block_q = tiles
        uniform = 0
    else:  # one tile a sequence: the kernel indexes them without these tensors (uniform_q)
        q_starts, tile_seq = constants.arange(0, bs * q, q, torch.int32), constants.arange(bs, dtype=torch.int32)
        tile_q0, block_q = constants.full((bs,), 0, torch.int32), block_q_for(q, group)
        uniform = q
    if num_splits is None:
        num_splits = auto_splits(tile_seq.shape[0], block_tables.shape[1] * page, kv_cache, dev)
    return TritonMetadata(slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, q_starts=q_starts,
                          q_lens=q_lens, tree_bits=tree_bits, tree_lens=tree_lens, tile_seq=tile_seq, tile_q0=tile_q0,
                          block_q=block_q, page=page, skip_first_key=skip_first_key, kv_cache=kv_cache,
                          num_splits=num_splits, uniform_q=uniform)
