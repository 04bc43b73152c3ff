"""Attention over the paged KV cache, behind one small interface.

An `AttentionBackend` (`attention_backend(name)`, chosen once from the configuration) builds one metadata
object per step, which carries the step's KV cache ([layers, k/v, slots, kv_heads, head_dim], the runner's or
the draft's); every layer's `Attention` hands it the step's queries, keys and values and its layer index, and
the metadata writes the keys and values into that layer's cache slots and attends over each sequence's
cached context. Two
backends: "torch" (padded SDPA over gathered KV, this file: any device, differentiable) and "triton" (the
paged CUDA kernel of triton_attention, whose fixed-shape metadata the CUDA graphs also replay). A
backend whose metadata `fuses_kv_write` lets the model write rotated keys and the values into the cache in
one kernel and pass `kv_written=True`. A step may hold
prefill chunks, single decode tokens and several verify tokens per sequence at once. `tree_masks[i]`
([q_len, m] bool) replaces causal order over sequence i's last m keys (its speculative tokens) with
ancestor-only visibility; the keys before them stay visible to every new token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..device import Constants


@dataclass
class PaddedRows:
    """Sequences of similar query length, attended in one padded SDPA call."""

    out_index: torch.Tensor  # [num_valid] flat token index of each valid query, row-major
    query_index: torch.Tensor  # [rows, max_q] flat token index of each padded query (pad -> 0)
    query_valid: torch.Tensor  # [rows, max_q] bool
    kv_slots: torch.Tensor  # [rows, max_kv] cache slot of each context position (pad -> slot of position 0)
    mask: torch.Tensor  # [rows, 1, max_q, max_kv] bool, True = may attend
    alone: bool = False  # the step's only row: its queries are the step's tokens in order, none padded

    def attend(self, q: torch.Tensor, cache: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
        keys = self._gather(cache[0]).transpose(1, 2)  # [rows, kv_heads, max_kv, head_dim]
        values = self._gather(cache[1]).transpose(1, 2)
        queries = q.transpose(0, 1)[None] if self.alone else q[self.query_index].transpose(1, 2)
        # queries: [rows, heads, max_q, head_dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        if self.alone:
            return out[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
        return out.transpose(1, 2)[self.query_valid]  # [num_valid, heads, head_dim]

    def _gather(self, cache: torch.Tensor) -> torch.Tensor:
        """cache [slots, kv_heads, head_dim] at kv_slots -> [rows, max_kv, kv_heads, head_dim]. index_select on
        the flat slots: on a CPU 2-4x faster than advanced indexing with the 2-D slot tensor."""
        return cache.index_select(0, self.kv_slots.reshape(-1)).view(*self.kv_slots.shape, *cache.shape[1:])


@dataclass
class AttentionMetadata:
    """A step's padded attention: the rows are grouped by query length (up to 16, then powers of two), so a step
    mixing a long prefill chunk with single decode tokens does not pad every decode row to the chunk."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    block_tables: torch.Tensor  # [batch, max_blocks]
    groups: list[PaddedRows]
    kv_cache: Optional[torch.Tensor] = None  # [layers, 2, slots, kv_heads, head_dim]
    fuses_kv_write: ClassVar[bool] = False

    def without_first_key(self) -> "AttentionMetadata":
        """The same step with key 0 of every sequence hidden (the EAGLE-3 draft stores pairs one slot late)."""
        for g in self.groups:
            g.mask[:, 0, :, 0] &= ~g.query_valid
        return self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D]; cache [2, slots, Hkv, D] -> [T, H, D]
        cache[0, self.slot_mapping] = k
        cache[1, self.slot_mapping] = v
        gqa = q.shape[1] != k.shape[1]
        if len(self.groups) == 1:
            return self.groups[0].attend(q, cache, scale, gqa)
        out = q.new_empty(q.shape)
        for g in self.groups:
            out = out.index_put((g.out_index,), g.attend(q, cache, scale, gqa))
        return out


class AttentionBackend:
    """Builds a step's attention metadata: q_lens[i] new tokens of sequence i occupy its last q_lens[i] of
    seq_lens[i] positions, whose cache slots block_tables[i] (blocks of block_size) give; tree_masks[i]
    ([q_len, m] bool, or None) sets the visibility of its last m keys; group: query heads per KV head;
    kv_cache: [layers, 2, slots, kv_heads, head_dim], the cache the step's layers read and write.
    A backend with `graphs` also builds metadata over fixed-shape device tensors (`static_metadata`), which
    CUDA graphs capture and the host refills before each replay (engine/cuda_graph.py,
    speculative/eagle3_graphs.py, speculative/eagle3_loop.py), its trees encoded by the backend's
    `tree_bits` / `tree_bitmask`."""

    name = ""
    graphs = False

    def metadata(self, q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                 device: torch.device, group: int = 1, tree_masks: Optional[list[Optional[torch.Tensor]]] = None,
                 kv_cache: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def static_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        q_lens: torch.Tensor, tree_bits: torch.Tensor, tree_lens: torch.Tensor, q: int, group: int,
                        page: int, kv_cache: torch.Tensor, skip_first_key: bool = False, tiles=None):
        """Metadata of `batch` rows of q query slots each (q_lens[b] of them real): slot_mapping [batch * q]
        int64, block_tables [batch, max_blocks] int32, seq_lens / q_lens / tree_lens [batch] int32 (a row's
        kv length with its new tokens; 0 for a padding row), tree_bits [batch * q] int64 (`tree_bits`);
        skip_first_key hides key 0 of every row (the EAGLE-3 draft stores pairs one slot late). tiles: for rows
        of any query lengths packed one after another (a mixed step), the backend's own work split over them,
        refilled by the host before each replay (the triton backend's: q_starts, tile_seq, tile_q0, block_q)."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")

    def mixed_tiles(self, max_tokens: int, max_rows: int, group: int, device: torch.device):
        """The `tiles` of static metadata over rows of any query lengths, up to max_tokens tokens and max_rows rows
        (engine/cuda_graph.py's mixed graphs): `view(tokens)` gives a graph's tiles, `fill(q_lens, tokens)` sets
        a step's; row max_rows is a padding row that must keep seq_lens and q_lens 0."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graphs")


class TorchBackend(AttentionBackend):
    """Padded SDPA over gathered KV (any device, differentiable); `build_metadata`."""

    name = "torch"

    def metadata(self, q_lens, seq_lens, block_tables, block_size, device, group=1, tree_masks=None, kv_cache=None):
        return build_metadata(q_lens, seq_lens, block_tables, block_size, device, tree_masks, kv_cache)


class TritonBackend(AttentionBackend):
    """The paged Triton kernel (CUDA; triton_attention.build_triton_metadata, static_triton_metadata)."""

    name = "triton"
    graphs = True

    def __init__(self):
        self.constants: dict[torch.device, Constants] = {}  # static metadata's tile tensors, per device

    def metadata(self, q_lens, seq_lens, block_tables, block_size, device, group=1, tree_masks=None, kv_cache=None):
        from .triton_attention import build_triton_metadata  # imports triton: only on CUDA

        return build_triton_metadata(q_lens, seq_lens, block_tables, block_size, device, group, tree_masks,
                                     kv_cache)

    def static_metadata(self, slot_mapping, block_tables, seq_lens, q_lens, tree_bits, tree_lens, q, group, page,
                        kv_cache, skip_first_key=False, tiles=None):
        from .triton_attention import static_triton_metadata

        dev = seq_lens.device
        const = self.constants.setdefault(dev, Constants(dev))
        return static_triton_metadata(slot_mapping, block_tables, seq_lens, q_lens, tree_bits, tree_lens, q, group,
                                      page, kv_cache, skip_first_key, const, tiles=tiles)

    def mixed_tiles(self, max_tokens, max_rows, group, device):
        from .triton_attention import MixedTiles

        return MixedTiles(max_tokens, max_rows, group, device)

    @staticmethod
    def tree_bitmask(tree: torch.Tensor) -> torch.Tensor:
        """[..., q, m] bool visibility over the last m keys -> [..., q] int64 (bit j = key j), same device."""
        from .triton_attention import tree_bitmask

        return tree_bitmask(tree)

    @staticmethod
    def tree_bits(trees: list[Optional[torch.Tensor]], q_lens: list[int], device: torch.device) -> torch.Tensor:
        """[num_tokens] int64 bitmasks of a step's queries (0 for sequences without a tree)."""
        from .triton_attention import tree_bits

        return tree_bits(trees, q_lens, device)


BACKENDS = {"torch": TorchBackend, "triton": TritonBackend}


def attention_backend(name: str) -> AttentionBackend:
    """The backend the configuration names (config.ExecutionConfig.attention_backend, resolved)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]()


def new_token_slots(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
                    ) -> list[int]:
    """Cache slot of each new token: q_lens[i] tokens ending at position seq_lens[i] - 1 of sequence i."""
    return [table[p // block_size] * block_size + p % block_size
            for q, n, table in zip(q_lens, seq_lens, block_tables) for p in range(n - q, n)]


def padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[batch, longest table] int32, zero-padded."""
    width = max(1, max(len(t) for t in block_tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)



def build_metadata(q_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device, tree_masks: Optional[list[Optional[torch.Tensor]]] = None,
                   kv_cache: Optional[torch.Tensor] = None) -> AttentionMetadata:
    """The torch backend's metadata (see `AttentionBackend.metadata`). Built in numpy: on a CPU a step's few
    dozen small index operations cost ~1 us each there against 5-10 us as torch operations."""
    q, n = np.asarray(q_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)  # [batch]
    max_blocks = -(-int(n.max()) // block_size)
    tables = np.zeros((len(q_lens), max_blocks), dtype=np.int64)  # [batch, max_blocks]
    for i, table in enumerate(block_tables):
        tables[i, :min(len(table), max_blocks)] = table[:max_blocks]
    starts = np.cumsum(q) - q  # [batch] first flat token index of each sequence
    row = np.repeat(np.arange(len(q_lens)), q)  # [num_tokens]
    pos = np.arange(int(q.sum())) - starts[row] + (n - q)[row]  # [num_tokens] position of each new token
    slots = tables[row, pos // block_size] * block_size + pos % block_size
    by_length: dict[int, list[int]] = {}
    for i, length in enumerate(q_lens):
        by_length.setdefault(max(0, (length - 1).bit_length() - 4), []).append(i)  # 1-16 together, then 17-32, ...
    groups = [_padded_rows(np.asarray(rows), q, n, starts, tables, block_size, tree_masks, device)
              for _, rows in sorted(by_length.items())]
    groups[0].alone = len(q_lens) == 1
    return AttentionMetadata(slot_mapping=_tensor(slots, device), block_tables=_tensor(tables, device),
                             groups=groups, kv_cache=kv_cache)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _padded_rows(rows: np.ndarray, q: np.ndarray, n: np.ndarray, starts: np.ndarray, tables: np.ndarray,
                 block_size: int, tree_masks: Optional[list[Optional[torch.Tensor]]],
                 device: torch.device) -> PaddedRows:
    """The padded tensors of one group of rows (indices into the step's sequences)."""
    q_rows, n_rows = q[rows], n[rows]  # [rows]
    j = np.arange(int(q_rows.max()))  # [max_q]
    key = np.arange(int(n_rows.max()))  # [max_kv]
    qvalid = j[None, :] < q_rows[:, None]  # [rows, max_q]
    qidx = np.where(qvalid, starts[rows][:, None] + j[None, :], 0)
    qpos = np.where(qvalid, (n_rows - q_rows)[:, None] + j[None, :], 0)
    kv_slots = tables[rows][:, key // block_size] * block_size + key % block_size  # [rows, max_kv]
    mask = (key[None, None, :] <= qpos[:, :, None]) & (key[None, None, :] < n_rows[:, None, None])
    if tree_masks is not None:
        for r, i in enumerate(rows):
            tree = tree_masks[i]
            if tree is not None:
                m = tree.shape[1]
                mask[r, :q[i], n[i] - m:n[i]] = tree.cpu().numpy()
    mask |= ~qvalid[:, :, None] & (key[None, None, :] == 0)  # padded rows attend somewhere: no NaN
    return PaddedRows(out_index=_tensor(qidx[qvalid], device), query_index=_tensor(qidx, device),
                      query_valid=_tensor(qvalid, device), kv_slots=_tensor(kv_slots, device),
                      mask=_tensor(mask[:, None], device))


class Attention(nn.Module):
    """Attention of new tokens against the paged cache (grouped-query aware) of layer `layer`; the step's
    metadata (built by an `AttentionBackend`, holding the cache) does the work."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer = layer
        self.scale = head_dim ** -0.5

    def cache(self, meta) -> torch.Tensor:
        """This layer's cache in the step's metadata: [2, slots, kv_heads, head_dim]."""
        return meta.kv_cache[self.layer]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        if kv_written:  # the caller already stored k and v in the cache (metadata that fuses_kv_write)
            return meta.attend(q, k, v, self.cache(meta), self.scale, kv_written=True)
        # q [num_tokens, heads, head_dim]; k, v [num_tokens, kv_heads, head_dim] -> [num_tokens, heads, head_dim]
        return meta.attend(q, k, v, self.cache(meta), self.scale)
