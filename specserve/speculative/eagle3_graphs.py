"""CUDA graphs of EAGLE-3's steady-state drafting: the catch-up forward and every draft depth, one replay.

In steady state each drafting sequence has at most Q = (most steps of any shape) + 1 pairs to catch up on
(the tokens its previous verify accepted, plus one). One graph per (batch size, shape) runs the draft on
a padded [batch, Q] block of pairs, then grows the shape's candidates (`Eagle3Proposer.grow`; a chain's by
`grow_chain`, an argmax a depth: the tree's top-k and scores cost 110 us a step on the 8B shape) with the
attention metadata of every depth computed on the device from the static inputs: the sequences' root
positions and block tables. Padding pairs and padding rows write their KV to a scratch slot that no block
owns. The host fills the static inputs (token ids, pair counts, root positions, block tables, and the
pending target features gathered from the tensors they sit in) and reads the candidates.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..device import Constants, RowGather, to_device
from ..engine.cuda_graph import capture_all, capture_sizes
from ..engine.sequence import Sequence
from ..layers.attention import padded_tables
from .shapes import Shape

if TYPE_CHECKING:
    from .eagle3_proposer import Eagle3Proposer

log = logging.getLogger(__name__)


class DraftGraphs:
    def __init__(self, proposer: "Eagle3Proposer", shapes: list[Shape], max_bs: int, max_blocks: int,
                 scratch_slot: int):
        """shapes: the speculative shapes to capture; max_blocks: the longest block table a drafting
        sequence can have; scratch_slot: a draft KV slot no block owns."""
        self.proposer, self.shapes = proposer, [s for s in shapes if s.steps > 0]
        self.sizes = capture_sizes(max_bs)
        self.q = max(s.steps for s in self.shapes) + 1  # pairs per sequence in a catch-up
        self.scratch_slot = scratch_slot
        dev, q = proposer.device, self.q
        aux_dim = proposer.block_features.shape[1]
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(max_bs * q, **i64)  # [B*Q] token j+1 of each pair
        self.features = torch.zeros(max_bs * q, aux_dim, dtype=proposer.block_features.dtype, device=dev)
        self.q_lens = torch.ones(max_bs, **i32)  # [B] pairs to catch up on (padding rows: 1)
        self.ends = torch.ones(max_bs, **i64)  # [B] num_computed_tokens: the root's position
        self.live = torch.zeros(max_bs, dtype=torch.bool, device=dev)  # [B] a real sequence
        self.tables = torch.zeros(max_bs, max_blocks, **i32)
        self.graphs: dict[tuple[int, Shape], torch.cuda.CUDAGraph] = {}
        # per key: candidates as `grow` returns them, for a chain `grow_chain`'s tokens alone (a 1-tuple)
        self.outputs: dict[tuple[int, Shape], tuple[torch.Tensor, ...]] = {}
        self.replays = 0
        self.const = Constants(dev)  # made in each capture's warm-up run

    # ---- what the graph runs ---------------------------------------------------------------------
    def _meta(self, bs: int, q: int, seq_lens: torch.Tensor, q_lens: torch.Tensor, slots: torch.Tensor,
              tree_bits: torch.Tensor, tree_len: int):
        """Metadata of q query slots per row (q_lens[b] of them real) ending at kv length seq_lens[b]."""
        p = self.proposer
        tree_lens = self.const.full((bs,), tree_len, torch.int32)
        return p.backend.static_metadata(slots, self.tables[:bs], seq_lens.int(), q_lens, tree_bits, tree_lens, q,
                                         p.group, p.block_size, p.kv_cache, skip_first_key=True)

    def _slots(self, bs: int, kv: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """[bs * n] cache slots of kv indices kv [bs, n]; the scratch slot where not valid (None: all valid) or
        not live."""
        page = self.proposer.block_size
        slots = self.tables[:bs].long().gather(1, kv // page) * page + kv % page
        keep = self.live[:bs, None] if valid is None else valid & self.live[:bs, None]
        return torch.where(keep, slots, self.scratch_slot).view(-1)

    def _catch_up(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft on each row's pairs (pair j at kv index j + 1); the last pair's logits and hidden."""
        q = self.q
        q_lens, seq_lens = self.q_lens[:bs], self.ends[:bs] + 1
        i = self.const.arange(q)
        kv = seq_lens[:, None] - q_lens[:, None] + i  # [bs, Q]
        valid = i < q_lens[:, None]
        kv = torch.where(valid, kv, 1)
        positions = (kv - 1).view(-1)
        meta = self._meta(bs, q, seq_lens, q_lens, self._slots(bs, kv, valid),
                          self.const.full((bs * q,), 0), 0)
        last = self.const.arange(0, bs * q, q) + q_lens - 1  # [bs]
        logits, h = self.proposer.draft(self.ids[:bs * q], self.features[:bs * q], positions, meta, last)
        return logits, h[last]

    def _expand(self, bs: int, depth: int, tokens: torch.Tensor, h_in: torch.Tensor, ancestors: torch.Tensor):
        """One draft depth: K nodes per row at kv indices past the root (see `Eagle3Proposer._expand`)."""
        k = tokens.shape[1]
        seq_lens = self.ends[:bs] + depth * k + 1
        kv = seq_lens[:, None] - k + self.const.arange(k)  # [bs, K]
        bits = self.proposer.backend.tree_bitmask(ancestors).view(-1) if k > 1 else self.const.full((bs,), 0)
        meta = self._meta(bs, k, seq_lens, self.const.full((bs,), k, torch.int32), self._slots(bs, kv), bits,
                          depth * k if k > 1 else 0)
        positions = (self.ends[:bs] + depth - 1).repeat_interleave(k)
        return self.proposer.draft(tokens.reshape(-1), h_in.reshape(bs * k, -1), positions, meta)

    def _run(self, bs: int, shape: Shape):
        logits, hidden = self._catch_up(bs)

        def expand(*args):
            return self._expand(bs, *args)

        if shape.topk == 1:  # as eager drafting: an argmax a depth; a chain's readers take only its tokens
            return (self.proposer.grow_chain(logits, hidden, shape.steps, expand),)
        return self.proposer.grow(logits, hidden, shape, expand)

    # ---- capture and replay ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        keys = [(bs, shape) for shape in self.shapes for bs in reversed(self.sizes)]
        self.graphs, self.outputs = capture_all(keys, self._run)
        torch.cuda.synchronize(self.ids.device)
        seconds = time.perf_counter() - start
        log.info("captured %d draft CUDA graphs in %.1f s", len(self.graphs), seconds)
        return seconds

    def fits(self, seqs: list[Sequence], shape: Shape, settled: bool = True) -> bool:
        """A captured shape and batch size, and (settled) at most Q pairs to catch up on per sequence (see
        `Eagle3Proposer.settle`)."""
        return (len(seqs) <= self.sizes[-1] and shape in self.shapes
                and (not settled or all(s.num_computed_tokens - s.draft_state.computed <= self.q for s in seqs)))

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], shape: Shape) -> tuple[torch.Tensor, ...]:
        """Fill the static inputs from seqs (marking their pairs seen) and replay; candidates as `grow`'s (a
        chain's: `grow_chain`'s tokens, alone in a 1-tuple)."""
        bs = self.fill(seqs)
        self.graphs[(bs, shape)].replay()
        self.replays += 1
        return tuple(x[:len(seqs)] for x in self.outputs[(bs, shape)])

    def fill(self, seqs: list[Sequence]) -> int:
        """Fill the static inputs from seqs, marking their pairs seen; returns the batch size to replay."""
        bs = next(b for b in self.sizes if b >= len(seqs))
        q, real = self.q, len(seqs)
        ids = [0] * (bs * q)
        q_lens, ends = [1] * bs, [1] * bs
        gather = RowGather()
        for b, seq in enumerate(seqs):
            state, end = seq.draft_state, seq.num_computed_tokens
            n = end - state.computed
            ids[b * q:b * q + n] = seq.token_ids[state.computed + 1:end + 1]
            q_lens[b], ends[b] = n, end
            row = b * q
            for t, rows in state.take(n):
                gather.add(t, rows, range(row, row + len(rows)))
                row += len(rows)
            assert not state.pending, f"{seq.request_id}: pending features past the computed positions"
        dev = self.ids.device
        longs = to_device(ids + ends + [int(b < real) for b in range(bs)] + q_lens, torch.long, dev)
        self.ids[:bs * q].copy_(longs[:bs * q])
        self.ends[:bs].copy_(longs[bs * q:bs * q + bs])
        self.live[:bs].copy_(longs[bs * q + bs:bs * q + 2 * bs].bool())
        self.q_lens[:bs].copy_(longs[bs * q + 2 * bs:])
        tables = padded_tables([s.block_table for s in seqs])  # [real, width]
        self.tables[:real, :tables.shape[1]].copy_(to_device(tables, torch.int32, dev))
        gather.into(self.features)
        return bs
