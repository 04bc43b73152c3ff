"""EAGLE-3's draft keeps up with plain decoding inside the target's CUDA graphs.

A plain decode step computes one position per sequence; the draft's pair for it (target features at that
position, the token after it) completes only at the next step, once that token is sampled. Left for later,
these pairs cost the engine a copy of the auxiliary hidden states and host bookkeeping per step, and the
first speculative step after a plain phase a catch-up over every position decoded without the draft.

Instead, the target's plain-decode graphs (one token per sequence) run the draft's share themselves:
beside the model, on a second stream, `store_previous` stores per sequence the draft KV of the previous
pair (the feature kept from the step before, the token this step computes); after the model, `keep`
keeps this step's feature for the next step, in row `req_index` of `features`. The draft's kernels thus
overlap the target's (small batches leave most of the GPU idle), and the step ends one launch later. A sequence
that follows is one pair behind the target at every step boundary (draft pairs computed =
num_computed_tokens - 1, the next pair's feature in its row), which the proposer reads off when it needs
the state (`Eagle3Proposer.state`); `before_step` brings a sequence there before its first graphed plain
step (after a prefill, a verify or an eager step: the pairs in between are stored eagerly, once).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..device import RowGather
from ..engine.sequence import Sequence
from ..layers import triton_ops

if TYPE_CHECKING:
    from .eagle3_proposer import Eagle3Proposer


class DraftFollower:
    def __init__(self, proposer: "Eagle3Proposer", max_seqs: int):
        """max_seqs: request indices run below this; the row after them is scratch (padding rows)."""
        self.proposer = proposer
        aux = proposer.block_features
        # [seqs + 1, aux_dim]: per request index, the features of its latest computed position
        self.features = torch.zeros(max_seqs + 1, aux.shape[1], dtype=aux.dtype, device=aux.device)

    def before_step(self, seqs: list[Sequence]) -> None:
        """Host, before a plain-decode graph replays for seqs: bring every sequence that does not follow yet
        to one pair behind."""
        todo = [s for s in seqs if s.draft_state is None or not s.draft_state.follows]
        if todo:
            self._settle(todo)

    def _settle(self, seqs: list[Sequence]) -> None:
        """Store each sequence's pending pairs but the last, move the last one's feature to its row."""
        self.proposer.settle(seqs)
        gather = RowGather()
        for seq in seqs:
            state = seq.draft_state
            if seq.num_computed_tokens > state.computed:  # none before a one-token prompt's first step
                for t, rows in state.take(1):
                    gather.add(t, rows, [seq.req_index])
            assert not state.pending, f"{seq.request_id}: pending features past the computed positions"
            state.follows = True
        gather.into(self.features)

    def store_previous(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       rows: torch.Tensor) -> None:
        """In the graph, beside the model (it needs none of its outputs): ids, positions, slots [bs] the
        step's tokens, their positions and KV slots (the scratch slot on padding rows), rows [bs] the
        request indices (the scratch row on padding). Stores the draft KV of each row's previous pair: the
        feature kept in its row at the step before, the token this step computes. Pair p - 1 sits in
        position p's slot; at position 0 (a one-token prompt) a pair of position 0 lands in slot 0 of its
        block, which the draft never reads."""
        previous = self.features.index_select(0, rows)  # [bs, aux_dim]
        self.proposer.draft.store_kv(ids, previous, (positions - 1).clamp(min=0), slots, self.proposer.kv_cache)

    def store_chunk_pairs(self, next_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor) -> None:
        """In a mixed graph, after the model: the draft KV of the pairs within the step's prompt chunks, which the
        proposer would otherwise store from the step's outputs, eagerly (`Eagle3Proposer.observe`). Per token r:
        aux [n, aux_dim] its features, next_ids [n] the token after it, positions [n] its position, slots [n]
        the pair's slot (token r + 1's where both lie in one prompt chunk, else the scratch slot)."""
        self.proposer.draft.store_kv(next_ids, aux, positions, slots, self.proposer.kv_cache)

    def keep(self, aux: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> None:
        """In the graph, after the model and `store_previous`: aux [bs, aux_dim] this step's features into
        the rows (and the block features at a block's last position), for the next step; tables
        [bs, max_blocks] the block tables."""
        p = self.proposer
        triton_ops.keep_features(aux, self.features, p.all_block_features, rows, positions, tables, p.block_size)
