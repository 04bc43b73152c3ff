"""EAGLE-3 drafting: catch the draft up on the target's committed positions, then grow a tree.

The draft sees pairs (target features at position j, token j+1) and predicts token j+2. Its KV cache
uses the target's block tables, one slot late: pair j sits in position j+1's slot (slot 0 holds nothing),
so a block's draft KV depends only on the tokens of the block and its prefix, like the target's, and
the prefix cache can share it. The tokens drafted during a step go to scratch slots past the computed
prefix (which the scheduler reserves) and are overwritten by the next step, so rejected drafts never
need rolling back in the draft cache.

Prefix hits: the one pair that crosses into the first uncached block needs the target feature of the
last cached position, which was not computed; every block keeps that row (`block_features`, aux_dim
per block), so a request that starts on h cached blocks starts with h*block_size - 1 pairs done.

Prompt chunks: the pairs a chunk completes are stored from the prompt step's own tensors as soon as it
has run (`observe`), so a step after a prompt finds the draft one pair behind, as after any decode step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import torch

from ..config import SpeculativeConfig
from ..device import RowGather, to_device
from ..engine.sequence import Sequence
from ..layers.attention import AttentionBackend, TorchBackend
from ..models import ArchConfig
from .eagle3 import Eagle3Draft, load_eagle3
from .eagle3_follow import DraftFollower
from .eagle3_graphs import DraftGraphs
from .proposer import Proposer
from .shapes import Shape
from .synthetic import SyntheticAcceptance
from .tree import DraftTree, device_chains, select_trees

if TYPE_CHECKING:
    from ..engine.model_runner import StepTensors


@dataclass
class Pairs:
    """Pairs (target features at position j, token j+1) of several sequences, flattened in order."""

    ids: list[int]  # token j+1
    positions: list[int]  # j
    slots: list[int]  # the draft KV slot of pair j: position j+1's
    q_lens: list[int]  # pairs per sequence
    ends: list[int]  # per sequence: pairs seen once these are
    last: list[int]  # per sequence: the flat index of its last pair
    features: Optional[torch.Tensor]  # [len(ids), aux_dim]


@dataclass
class DraftState:
    computed: int = 0  # pairs whose draft KV is in the cache
    # target features of the positions after `computed`, unsliced: (a step's aux [tokens, aux_dim], rows)
    pending: list[tuple[torch.Tensor, Union[range, list[int]]]] = field(default_factory=list)
    # kept up by the plain-decode graphs (eagle3_follow.py): computed and pending are read off the sequence
    follows: bool = False

    def take(self, count: int) -> list[tuple[torch.Tensor, Union[range, list[int]]]]:
        """The first `count` pending features, now counted computed: their (tensor, rows) entries."""
        taken, rest, left = [], [], count
        for t, rows in self.pending:
            k = min(len(rows), left)
            if k:
                taken.append((t, rows[:k]))
            if k < len(rows):
                rest.append((t, rows[k:]))
            left -= k
        assert left == 0, f"{count - left} pending features, {count} taken"
        self.pending, self.computed = rest, self.computed + count
        return taken


def _one_behind(state: DraftState, start: int) -> bool:
    """Has the draft seen every pair before position start's but the last (its feature pending), or is
    start the first position?"""
    if start == 0:
        return state.computed == 0 and not state.pending
    return state.computed == start - 1 and sum(len(rows) for _, rows in state.pending) == 1


class Eagle3Proposer(Proposer):
    def __init__(self, config: SpeculativeConfig, target_arch: ArchConfig, target_embedding, num_slots_total: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, backend: Optional[AttentionBackend] = None,
                 load_format: str = "safetensors", seed: int = 0, synthetic: Optional[SyntheticAcceptance] = None):
        """target_embedding: the target's token embedding, whole (the draft shares it); load_format and
        seed as the target's (dummy weights for a dummy target); synthetic: trees rank children by its
        scores (benchmarks with synthetic acceptance)."""
        self.block_size = block_size
        self.synthetic = synthetic
        self.seed = seed
        self.backend = backend or TorchBackend()
        self.device = device
        self.draft: Eagle3Draft = load_eagle3(config.speculative_draft_model_path, target_arch, target_embedding,
                                              dtype, device, load_format, seed)
        if config.speculative_draft_model_quantization == "int8":
            self.draft.quantize_int8()
        self.aux_layers = self.draft.config.target_aux_layers(target_arch.num_layers)
        attn = self.draft.attention_layers()[0]
        # [1 layer, k/v, slots + scratch, kv_heads, head_dim], indexed by the target's block tables
        self.scratch_slot = num_slots_total  # padding rows of graph replays write here
        self.kv_cache = torch.zeros(1, 2, num_slots_total + 1, attn.num_kv_heads, attn.head_dim, dtype=dtype,
                                    device=device)
        self.group = attn.num_heads // attn.num_kv_heads
        # [blocks + scratch, aux_dim]: the target features of each block's last position
        aux_dim = len(self.aux_layers) * target_arch.hidden_size
        self.all_block_features = torch.zeros(num_slots_total // block_size + 1, aux_dim, dtype=dtype, device=device)
        self.block_features = self.all_block_features[:-1]  # [blocks, aux_dim]
        self.follower: Optional[DraftFollower] = None
        self.last_catch_up = 0  # pairs the latest propose() had to run before drafting
        self._depths: dict[Shape, torch.Tensor] = {}
        self.graphs: Optional[DraftGraphs] = None  # steady-state drafting replayed from CUDA graphs

    def num_slots(self, shape: Shape) -> int:
        return max(shape.num_nodes, (shape.steps - 1) * shape.topk + 1)

    def make_follower(self, max_seqs: int) -> DraftFollower:
        self.follower = DraftFollower(self, max_seqs)
        return self.follower

    def state(self, seq: Sequence, start: Optional[int] = None) -> DraftState:
        """seq's draft state as of `start` computed positions (default: all), created if it has none: a
        request that started on cached blocks has their pairs cached but the last, which needs the row
        block_features keeps; one that follows (eagle3_follow.py) is one pair behind."""
        start = seq.num_computed_tokens if start is None else start
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState()
            if start > 0:
                state.computed = start - 1
                block = seq.block_table[start // self.block_size - 1]
                state.pending.append((self.block_features, range(block, block + 1)))
        elif state.follows:
            state.follows, state.computed = False, start - 1
            state.pending = [(self.follower.features, range(seq.req_index, seq.req_index + 1))]
        return state

    def observe(self, aux: Optional[torch.Tensor], committed: list[tuple[Sequence, Union[range, list[int]]]],
                inputs: Optional["StepTensors"] = None) -> None:
        if aux is None:  # a plain-decode graph stored the pairs (eagle3_follow.py)
            return
        bs, blocks, rows, prompts = self.block_size, [], [], []
        for seq, idx in committed:
            end = seq.num_computed_tokens
            start = end - len(idx)
            state = self.state(seq, start)
            if inputs is not None and len(idx) > 1 and end <= seq.num_prompt_tokens and _one_behind(state, start):
                prompts.append((seq, idx))
            else:
                state.pending.append((aux, idx))
            for i in range(bs - 1 - start % bs, end - start, bs):  # rows at the last position of a block
                blocks.append(seq.block_table[(start + i) // bs])
                rows.append(idx[i])
        if blocks:  # one copy per step for every sequence
            self.block_features[self._ids(blocks)] = aux[self._ids(rows)]
        if prompts:
            self._store_prompt_pairs(aux, inputs, prompts)

    def _store_prompt_pairs(self, aux: torch.Tensor, inputs: "StepTensors",
                            prompts: list[tuple[Sequence, range]]) -> None:
        """Store the draft KV of the pairs a step's prompt chunks complete, from the step's own tensors:
        within a chunk of rows r0..r1-1 the pair of row r is (aux[r], the token of row r + 1), in row r + 1's
        slot (stored already where the step's graph did: `inputs.chunk_pairs_stored`); the pair before the
        chunk (a feature left pending, the chunk's first token) joins them. Each sequence is one pair behind
        after it: the chunk's last feature waits for the next token."""
        within, crossing, gather = [], [], RowGather()
        for seq, idx in prompts:
            state = seq.draft_state
            if state.pending:
                for t, r in state.take(1):
                    gather.add(t, r, [len(crossing)])
                crossing.append(idx.start)
            if not inputs.chunk_pairs_stored:
                within.append(torch.arange(idx.start, idx.stop - 1))
            state.computed += len(idx) - 1
            state.pending.append((aux, range(idx.stop - 1, idx.stop)))
        if not within and not crossing:
            return
        rows = self._ids(torch.cat(within) if within else torch.empty(0, dtype=torch.long))  # [pairs within chunks]
        ids, features = inputs.ids[rows + 1], aux[rows]
        positions, slots = inputs.positions[rows], inputs.slots[rows + 1]
        if crossing:
            first = self._ids(crossing)  # [chunks after a pending pair]
            ids, positions, slots = (torch.cat(p) for p in ((ids, inputs.ids[first]),
                                                            (positions, inputs.positions[first] - 1),
                                                            (slots, inputs.slots[first])))
            features = torch.cat([features, gather.into(features.new_empty(len(crossing), aux.shape[1]))])
        self.draft.store_kv(ids, features, positions, slots, self.kv_cache)

    def cached_tokens(self, seq: Sequence) -> int:
        state = seq.draft_state
        if state is None:
            return 0
        return seq.num_computed_tokens if state.follows else state.computed + 1

    def cache_planes(self) -> list[torch.Tensor]:
        blocks = self.block_features.shape[0]
        # [blocks, k/v, block_size, kv_heads, head_dim] and [blocks, aux_dim]
        kv = self.kv_cache[0, :, :self.scratch_slot].unflatten(1, (blocks, self.block_size)).movedim(1, 0)
        return [kv, self.block_features]

    def capture_graphs(self, shapes: list[Shape], max_bs: int, max_blocks: int) -> None:
        """Capture steady-state drafting for these shapes and batch sizes up to max_bs (CUDA, triton
        attention); max_blocks: the longest block table a sequence can have."""
        self.graphs = DraftGraphs(self, shapes, max_bs, max_blocks, self.scratch_slot)
        self.graphs.capture()

    def make_loop(self, target_graphs, kv_cache: torch.Tensor):
        if self.graphs is None:
            return None
        from .eagle3_loop import SpecLoop

        loop = SpecLoop(self, target_graphs, kv_cache)
        loop.capture()
        return loop

    # ---- drafting -----------------------------------------------------------------------------
    def settle(self, seqs: list[Sequence], within: int = 1) -> None:
        """Bring every sequence whose draft is more than `within` pairs behind the target to one pair
        behind: the pairs before its last are stored without attending (as a long catch-up stores them), so
        that a step of it fits the draft graphs (within: their pairs per sequence) or the follower."""
        for seq in seqs:
            self.state(seq)
        behind = [s for s in seqs if s.num_computed_tokens - s.draft_state.computed > within]
        if behind:
            self.store_pairs(behind, [s.num_computed_tokens - 1 for s in behind])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], shape: Shape) -> list[DraftTree]:
        for seq in seqs:
            self.state(seq)
        roots = [s.token_ids[-1] for s in seqs]
        if self.graphs is not None and self.graphs.fits(seqs, shape, settled=False):
            self.last_catch_up = sum(s.num_computed_tokens - s.draft_state.computed for s in seqs)
            self.settle(seqs, self.graphs.q)
            cands = self.graphs.run(seqs, shape)
        else:
            logits, hidden = self._catch_up(seqs, shape.steps)  # [B, draft_vocab], [B, H]
            base = torch.tensor([s.num_computed_tokens for s in seqs])  # n: the root's position
            expand = functools.partial(self._expand, seqs, base)
            if shape.topk == 1:
                cands = (self.grow_chain(logits, hidden, shape.steps, expand),)
            else:
                cands = self.grow(logits, hidden, shape, expand)
        if shape.topk == 1:  # a chain keeps every candidate, in order: its tokens need not leave the device
            return device_chains(self._ids(roots), cands[0])
        return select_trees(roots, *cands, self.candidate_depths(shape), shape.num_nodes)

    def candidate_depths(self, shape: Shape) -> torch.Tensor:
        """[C] the draft depth of each candidate `grow` returns (1 for the root's children)."""
        if shape not in self._depths:
            k = shape.topk
            self._depths[shape] = self._ids([1] * k + [d + 1 for d in range(1, shape.steps) for _ in range(k * k)])
        return self._depths[shape]

    def grow(self, logits: torch.Tensor, hidden: torch.Tensor, shape: Shape, expand
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grow candidates from each sequence's last-pair logits [B, draft_vocab] and hidden state [B, H]:
        the top-k children of the root, then per depth the top-k children of the k best nodes so far.
        expand(depth, tokens [B, K], hidden [B, K, H], ancestors [B, K, depth*K]) runs the draft on the
        nodes being expanded. Returns candidate tokens, cumulative log-probabilities and parents (-1:
        the root), each [B, C], in generation order."""
        k, batch, dev = shape.topk, logits.shape[0], logits.device
        logp = logits.float().log_softmax(-1)
        scores, draft_ids = logp.topk(k, dim=-1)  # [B, K]
        if self.synthetic is not None and k > 1:
            scores = self.synthetic.child_scores(1, k, dev).expand(batch, k)
        cand_tokens = [self.draft.to_target_ids(draft_ids)]
        cand_scores = [scores]
        cand_parents = [torch.full((batch, k), -1, dtype=torch.long, device=dev)]
        expanded = torch.arange(k, device=dev).expand(batch, k)  # candidate index of each expanded node
        h_in = hidden.unsqueeze(1).expand(batch, k, hidden.shape[-1])  # [B, K, H]
        # [B, K, K] ancestry over the nodes expanded so far
        ancestors = torch.eye(k, dtype=torch.bool, device=dev).expand(batch, k, k)
        exp_scores = scores
        for depth in range(1, shape.steps):
            tokens = torch.cat(cand_tokens, 1).gather(1, expanded)  # [B, K]
            logits, h_out = expand(depth, tokens, h_in, ancestors)
            logp = logits.float().log_softmax(-1).view(batch, k, -1)
            child_scores, child_ids = logp.topk(k, dim=-1)  # [B, K, K]
            if self.synthetic is not None:
                child_scores = self.synthetic.child_scores(depth + 1, k, dev).expand(batch, k, k)
            child_scores = (exp_scores.unsqueeze(-1) + child_scores).view(batch, k * k)
            offset = sum(t.shape[1] for t in cand_tokens)
            cand_tokens.append(self.draft.to_target_ids(child_ids.view(batch, k * k)))
            cand_scores.append(child_scores)
            cand_parents.append(expanded.repeat_interleave(k, dim=1))
            if depth == shape.steps - 1:
                break
            exp_scores, pick = child_scores.topk(k, dim=-1)  # [B, K] the next nodes to expand
            parent_slot = pick // k  # which expanded node each came from
            h_in = h_out.view(batch, k, -1).gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, h_out.shape[-1]))
            prev = ancestors.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, ancestors.shape[-1]))
            ancestors = torch.cat([prev, torch.eye(k, dtype=torch.bool, device=dev).expand(batch, k, k)], dim=2)
            expanded = offset + pick
        return torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1)

    def grow_chain(self, logits: torch.Tensor, hidden: torch.Tensor, steps: int, expand) -> torch.Tensor:
        """`grow` for a chain (topk 1), in fewer operations: each depth's draft is its parent's argmax, and a
        chain's tree mask is causal order, so `expand` gets no ancestors. Returns [B, steps] target ids."""
        batch = logits.shape[0]
        drafts = [logits.argmax(-1, keepdim=True)]  # [B, 1] draft ids
        h = hidden.unsqueeze(1)  # [B, 1, H]
        for depth in range(1, steps):
            logits, h = expand(depth, self.draft.to_target_ids(drafts[-1]), h, None)
            drafts.append(logits.argmax(-1, keepdim=True))
            h = h.view(batch, 1, -1)
        return self.draft.to_target_ids(torch.cat(drafts, 1))

    @torch.inference_mode()
    def flush(self, seqs: list[Sequence], cached_blocks: list[int]) -> None:
        bs, behind, ends = self.block_size, [], []
        for seq, cached in zip(seqs, cached_blocks):
            end = seq.num_computed_tokens // bs * bs - 1  # the pairs whose slots lie in complete blocks
            # a stop inside an accepted run (or a step that ran past the stop) computed KV for tokens
            # the request dropped: a pair needs its next token, so stop at the last one kept
            end = min(end, len(seq.token_ids) - 1)
            if seq.draft_state is None:
                continue
            state = self.state(seq)
            skip = min(cached * bs - 1, end) - state.computed  # pairs whose slots lie in cached blocks
            if skip > 0:
                state.take(skip)
            if end > state.computed:
                behind.append(seq)
                ends.append(end)
        if behind:  # only the draft KV of these blocks is wanted: no attention, no outputs
            self.store_pairs(behind, ends)

    def store_pairs(self, seqs: list[Sequence], ends: list[int]) -> None:
        """Store the draft KV of each sequence's pairs before pair ends[i], without attending (nobody reads
        their outputs), and mark them seen."""
        pairs = self._take_pairs(seqs, ends)
        self.draft.store_kv(self._ids(pairs.ids), pairs.features, self._ids(pairs.positions), self._ids(pairs.slots),
                            self.kv_cache)

    def _catch_up(self, seqs: list[Sequence], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft over every committed pair it has not seen; return the last pair's logits and
        hidden state per sequence ([B, draft_vocab], [B, H]). A catch-up longer than a verify of
        `steps` drafts could leave (after plain decoding) only stores the KV of the pairs before each
        sequence's last, which no one reads the outputs of, and runs the layer on the last pairs alone."""
        pairs = self._take_pairs(seqs)
        self.last_catch_up = len(pairs.ids)
        if max(pairs.q_lens) <= steps + 1:  # steady state: one forward, logits of the last pairs only
            meta = self._metadata(pairs.q_lens, pairs.ends, seqs)
            index = self._ids(pairs.last)
            logits, h = self.draft(self._ids(pairs.ids), pairs.features, self._ids(pairs.positions), meta, index)
            return logits, h[index]
        ids, positions, slots = (torch.tensor(x) for x in (pairs.ids, pairs.positions, pairs.slots))
        mask = torch.ones(len(pairs.ids), dtype=torch.bool)
        mask[pairs.last] = False
        before = mask.nonzero().squeeze(1)  # [pairs - B] all but each sequence's last, indexed on the host
        self.draft.store_kv(self._ids(ids[before]), pairs.features[self._ids(before)],
                            self._ids(positions[before]), self._ids(slots[before]), self.kv_cache)
        last = torch.tensor(pairs.last)
        meta = self._metadata([1] * len(seqs), pairs.ends, seqs)
        return self.draft(self._ids(ids[last]), pairs.features[self._ids(last)], self._ids(positions[last]), meta)

    def _take_pairs(self, seqs: list[Sequence], ends: Optional[list[int]] = None) -> Pairs:
        """The pairs each sequence's draft has not seen, up to pair ends[i] - 1 (default: all committed
        ones), flattened in sequence order; marks them seen."""
        bs = self.block_size
        pairs, gather = Pairs([], [], [], [], [], [], None), RowGather()
        for i, seq in enumerate(seqs):
            state = seq.draft_state
            start, end = state.computed, ends[i] if ends else seq.num_computed_tokens
            table = seq.block_table
            row = len(pairs.ids)
            for t, rows in state.take(end - start):
                gather.add(t, rows, range(row, row + len(rows)))
                row += len(rows)
            pairs.ids.extend(seq.token_ids[start + 1:end + 1])
            pairs.positions.extend(range(start, end))
            pairs.slots.extend(table[p // bs] * bs + p % bs for p in range(start + 1, end + 1))  # one slot late
            pairs.q_lens.append(end - start)
            pairs.ends.append(end)
            pairs.last.append(len(pairs.ids) - 1)
        aux = self.block_features
        pairs.features = gather.into(torch.empty(len(pairs.ids), aux.shape[1], dtype=aux.dtype, device=aux.device))
        return pairs

    def _expand(self, seqs, base, depth, tokens, h_in, ancestors):
        """Run the draft on the K nodes being expanded at this depth (scratch slots past the prefix)."""
        batch, k = tokens.shape
        masks = None if ancestors is None else [ancestors[b] for b in range(batch)]  # [K, depth*K]
        seq_lens = (base + depth * k).tolist()
        meta = self._metadata([k] * batch, seq_lens, seqs, masks)
        positions = self._ids((base + depth - 1).repeat_interleave(k))
        logits, h = self.draft(tokens.reshape(-1), h_in.reshape(batch * k, -1), positions, meta)
        return logits, h

    def _metadata(self, q_lens: list[int], seq_lens: list[int], seqs: list[Sequence], tree_masks=None):
        """Attention metadata for q_lens[i] pairs ending at pair seq_lens[i] - 1, stored one slot late."""
        meta = self.backend.metadata(q_lens, [n + 1 for n in seq_lens], [s.block_table for s in seqs],
                                     self.block_size, self.device, self.group, tree_masks, self.kv_cache)
        return meta.without_first_key()  # slot 0 holds no pair

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)
