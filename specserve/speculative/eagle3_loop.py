"""EAGLE-3 speculation with the host one step behind: speculative steps in the overlap pipeline.

In steady state a speculative step needs nothing from the host. Its draft catches up on what the
previous verify accepted (tokens and target features already on the device), drafts a chain or grows
candidates and keeps the best as a tree (`device_trees`), the target verifies it (tree attention from
ancestor bits built on the device), the accepted branch's KV moves into place, and the verdict becomes the
next step's draft inputs. One CUDA graph per (batch size, shape, mode) runs all of it on the static buffers
of the draft graphs (`DraftGraphs`) and the target's (`GraphRunner`) and leaves each row's accept length and
output tokens for the host, which copies them without waiting.

The engine launches step N+1 before it reads step N's result, with KV reserved for the most step N can
accept; while it applies step N (stop checks, outputs) the device runs step N+1. Anything that changes the
batch (a request finishes, arrives or is aborted, the controller switches shape, the KV pool runs short)
drains the pipeline: the last step's result is read and `hand_back` leaves every sequence's draft state as
the synchronous path would.

A run's mode says how its rows verify (`run_mode`): GREEDY rows by argmax alone (`chain_verdict`,
`tree_accepted`); runs whose rows sample (by temperature: SAMPLED; also top-k, top-p, min-p or a seed:
FILTERED) by `verify_chains` and `verify_nodes` against `filter_logits`' distribution, each row's parameters
in a device buffer set when the run starts and its random numbers from the loop's generator, registered with
the graphs so each replay draws afresh. A seeded row verifies as the step path verifies it: greedily, against
its Gumbel-max sample after each node at the index that token takes (`seeded_argmax`), so its text is plain
decoding's. Rows that want logprobs, logits processing, a grammar or an adapter take the engine's step path.
Synthetic acceptance: the host's draws of each step, along each tree's spine as
`SyntheticAcceptance.verify_batch`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..device import to_device
from ..engine.cuda_graph import GraphRunner, capture_all
from ..engine.sequence import Sequence
from ..layers.attention import padded_tables
from ..layers.sampler import filter_logits, gumbel_tokens, seed_values
from .batch_verify import (
    chain_accept_len,
    chain_verdict,
    path_end,
    path_verdict,
    tree_accepted,
    verify_chains,
    verify_nodes,
)
from .eagle3_proposer import DraftState
from .shapes import Shape
from .synthetic import chain_drawn, spine_path
from .tree import device_trees, spine_counts

if TYPE_CHECKING:
    from .eagle3_proposer import Eagle3Proposer

log = logging.getLogger(__name__)


@dataclass
class LoopFlight:
    """A launched speculative step whose result the host has not read."""

    seqs: list[Sequence]  # its rows, in order
    shape: Shape
    host: torch.Tensor  # [rows, N + 3] pinned: accept length, spine accepted, spine length, the output tokens
    event: torch.cuda.Event  # recorded after the copy to `host`
    mode: str  # how its rows verify (`run_mode`)

    def read(self) -> list[tuple[int, list[int], tuple[int, int]]]:
        """Per row: drafts accepted, the tokens the step emits (the accepted drafts, then the target's), and
        (drafts of the tree's spine accepted, the spine's length) (`DraftTree.spine`)."""
        self.event.synchronize()
        return [(r[0], r[3:r[0] + 4], (r[1], r[2])) for r in self.host[:len(self.seqs)].tolist()]


GREEDY, SAMPLED, FILTERED = "greedy", "sampled", "filtered"
LOOP_SEED = 0x5EED100B  # the loop's generator: the model seed xor this (a stream apart from the sampler's)


def loops(seq: Sequence) -> bool:
    """May seq verify inside the loop: no logprobs, logits processing or grammar, on the base model (a LoRA
    adapter's steps take the engine's step path)?"""
    p = seq.params
    return p.logprobs is None and not p.processes_logits and not p.guided and not seq.lora


def run_mode(seqs: list[Sequence]) -> Optional[str]:
    """How a run of these sequences verifies: GREEDY (every row by argmax), SAMPLED (some rows sample by
    temperature alone), FILTERED (some row also filters by top-k, top-p or min-p, or is seeded); None: one
    cannot loop."""
    if not all(map(loops, seqs)):
        return None
    sampling = [s.params for s in seqs if not s.params.greedy]
    if not sampling:
        return GREEDY
    filtered = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 or p.seed is not None for p in sampling)
    return FILTERED if filtered else SAMPLED


def row_params(params: list, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On the host, for params [<= rows] (the rows past them greedy): [6, rows] per row its temperature (1:
    greedy), top_k (0: off), top_p, min_p, whether it is greedy and whether it is seeded (1 / 0); and [rows]
    int64 its seed (0: none)."""
    greedy = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    values = [greedy if p.greedy else [p.temperature, max(p.top_k, 0), p.top_p, p.min_p, 0.0, float(p.seed is not None)]
              for p in params]
    seeds = [0 if p.greedy else s for p, s in zip(params, seed_values(params))]
    return torch.tensor(values + [greedy] * (rows - len(values))).T, torch.tensor(seeds + [0] * (rows - len(seeds)))


def filtered_rows(logits: torch.Tensor, params: torch.Tensor, mode: str) -> torch.Tensor:
    """[bs * n, vocab] fp32: the logits sampling rows draw from after each node (-inf outside the filters), for
    logits [bs, n, vocab] and the rows' parameters [6, bs] (`row_params`); a SAMPLED run's rows only scaled by
    temperature, a FILTERED run's also filtered by top-k, top-p and min-p (rows without one pass its no-op value:
    `filter_logits`)."""
    bs, n, vocab = logits.shape
    temps, top_k, top_p, min_p = params[:4].repeat_interleave(n, 1)  # each [bs * n]
    filters = ()
    if mode == FILTERED:
        top_k = top_k.long()
        filters = (torch.where((top_k > 0) & (top_k < vocab), top_k, vocab), top_p, min_p)
    return filter_logits(logits.view(bs * n, vocab), temps, *filters)


def seeded_argmax(filtered: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  argmax: torch.Tensor) -> torch.Tensor:
    """[bs, n]: argmax [bs, n] with each seeded row's tokens replaced by its seeded samples (`gumbel_tokens`) from
    filtered [bs * n, vocab] (`filtered_rows`); params [6, bs] (`row_params`), seeds [bs] int64, positions [bs * n]
    int64: the sequence index of the token after each node."""
    bs, n = argmax.shape
    seeded = params[5] > 0  # [bs]
    drawn = gumbel_tokens(filtered, seeds.repeat_interleave(n), positions, seeded.repeat_interleave(n))  # [bs * n]
    return torch.where(seeded[:, None], drawn.view(bs, n), argmax)


class SpecLoop:
    def __init__(self, proposer: "Eagle3Proposer", target: GraphRunner, kv_cache: torch.Tensor):
        """proposer: its draft graphs are captured; target: the target's captured graphs (same scratch slot);
        kv_cache: the target's [layers, k/v, slots + scratch, kv_heads, head_dim] (accepted branches move)."""
        draft = proposer.graphs
        assert draft.scratch_slot == target.scratch_slot, "the draft and the target pad into one scratch slot"
        self.proposer, self.draft, self.target, self.kv_cache = proposer, draft, target, kv_cache
        self.shapes = [s for s in draft.shapes if s.num_nodes in target.sizes]
        self.sizes = {s: [b for b in draft.sizes if b in target.sizes[s.num_nodes]] for s in self.shapes}
        self.modes = {s: (GREEDY, SAMPLED, FILTERED) for s in self.shapes}
        dev, max_bs = draft.ids.device, draft.live.shape[0]
        # [6, B] per row of a sampling run: temperature (1: greedy), top_k (0: off), top_p, min_p, greedy, seeded
        # (1 / 0), and [B] its seed
        self.row_params = torch.zeros(6, max_bs, device=dev)
        self.seeds = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.generator = torch.Generator(device=dev).manual_seed(proposer.seed ^ LOOP_SEED)
        most = max((s.num_nodes for s in self.shapes), default=1)
        # trees may come with synthetic draws (their graphs then walk spines); chains take draws whenever they come
        # (start-up calibration's chains accepting none or all)
        self.synthetic = proposer.synthetic is not None
        # [2, B] synthetic draws: drafts to accept (-1: verify) and the depth of a tree's detour (-1: none)
        self.want = torch.full((2, max_bs), -1, dtype=torch.long, device=dev)
        self.result = torch.zeros(max_bs, most + 3, dtype=torch.long, device=dev)  # [B, N + 3] for the host
        self.host = [torch.empty(max_bs, most + 3, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self._flip = 0
        self._drawn = False  # the latest launch verified by synthetic draws
        self.graphs: dict[tuple[int, Shape], torch.cuda.CUDAGraph] = {}
        self.launches = 0
        self.tables_version: list[int] = []  # block table lengths as last copied to the device

    # ---- what the graph runs ---------------------------------------------------------------------
    def _run(self, bs: int, shape: Shape, mode: str) -> None:
        d, t, n = self.draft, self.target, shape.num_nodes
        tokens, parents, depths, bits = self._draft(bs, shape)  # each [bs, n]; bits None for chains
        ends, live = d.ends[:bs], d.live[:bs]
        slot_pos = ends[:, None] + d.const.arange(n)  # [bs, n] node i's KV sits at position ends + i
        t.ids[:bs * n].copy_(tokens.view(-1))
        t.positions[:bs * n].copy_((ends[:, None] + depths).view(-1))
        t.slots[:bs * n].copy_(d._slots(bs, slot_pos))
        t.seq_lens[:bs].copy_(torch.where(live, ends + n, 0))
        width = min(t.block_tables.shape[1], d.tables.shape[1])
        t.block_tables[:bs, :width].copy_(d.tables[:bs, :width])
        if bits is None:
            t.tree_bits[:bs * n].zero_()
            t.tree_lens[:bs].zero_()
        else:
            t.tree_bits[:bs * n].copy_(bits.view(-1))
            t.tree_lens[:bs].copy_(torch.where(live, n, 0))
        logits, aux = t._run(bs, n)  # [bs * n, vocab], [bs * n, aux_dim]
        if bits is None:
            verdict = self._verify_chains(tokens, logits.view(bs, n, -1), mode)
        else:
            on_path, final = self._verify(tokens, parents, bits, logits.view(bs, n, -1), mode)
            verdict = path_verdict(tokens, on_path, final)
            self._move_kv(bs, slot_pos, verdict.path)
        self._advance(bs, n, verdict, aux, bits is None)
        self.result[:bs, 0].copy_(verdict.accept_len)
        if bits is None:  # a chain is its own spine
            self.result[:bs, 1].copy_(verdict.accept_len)
            self.result[:bs, 2].fill_(n - 1)
        else:
            self.result[:bs, 1:3].copy_(spine_counts(parents, bits, on_path))
        self.result[:bs, 3:n + 3].copy_(verdict.out_tokens)

    def _draft(self, bs: int, shape: Shape):
        """The step's trees: tokens, parents (-1 at the root), depths [bs, n] and, for trees, each node's
        ancestor bits [bs, n] (None for chains)."""
        d, n = self.draft, shape.num_nodes
        cands = d._run(bs, shape)
        q_lens = d.q_lens[:bs].long()
        root = d.ids[:bs * d.q].view(bs, d.q).gather(1, q_lens[:, None] - 1)  # [bs, 1] the last pair's token
        nodes = d.const.arange(n).expand(bs, n)
        if shape.topk == 1:
            return torch.cat([root, cands[0]], 1), d.const.arange(-1, n - 1).expand(bs, n), nodes, None
        drafts, parents, depths, mask = device_trees(*cands, self.proposer.candidate_depths(shape), n)
        first = torch.zeros_like(root)
        return (torch.cat([root, drafts], 1), torch.cat([first - 1, parents], 1), torch.cat([first, depths], 1),
                self.proposer.backend.tree_bitmask(mask))

    def _verify(self, tokens: torch.Tensor, parents: torch.Tensor, bits: torch.Tensor, logits: torch.Tensor,
                mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification of trees tokens, parents, ancestor bits [bs, n] against logits [bs, n, vocab] (with
        synthetic acceptance, rows with a draw accept along their spine, then the target's argmax): the
        accepted nodes [bs, n] and the target's token after the last of them [bs]. Sampling rows by
        `verify_nodes` (see the module's docstring)."""
        bs, n = tokens.shape
        argmax = logits.argmax(-1)  # [bs, n]
        if mode == GREEDY:
            on_path = tree_accepted(tokens, parents, bits, argmax)  # [bs, n]
            final = None
        else:
            greedy, probs, uniforms, noise, targets = self._sampling(logits, mode, argmax)
            on_path, final = verify_nodes(tokens, parents, logits, greedy, probs, uniforms, noise, targets)
        if self.synthetic:
            want, detour = self.want[0, :bs], self.want[1, :bs]
            drawn = want >= 0  # [bs]
            on_path = torch.where(drawn[:, None], spine_path(parents, want, detour)[0], on_path)
            if final is not None:
                final = torch.where(drawn, path_end(on_path, argmax, self.draft.const.arange(n)), final)
        return on_path, path_end(on_path, argmax, self.draft.const.arange(n)) if final is None else final

    def _sampling(self, logits: torch.Tensor, mode: str, argmax: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a sampling run's rows verify with: which rows verify greedily [bs] (greedy and seeded rows), the
        target's distributions after each node [bs, n, vocab] (`filtered_rows`' softmax), uniforms [bs, n] and Exp(1)
        noise [bs, vocab] from the loop's generator, and the token a greedy row takes after each node [bs, n]
        (argmax [bs, n], a seeded row's samples in a FILTERED run: `seeded_argmax`)."""
        bs, n, vocab = logits.shape
        params = self.row_params[:, :bs]
        filtered = filtered_rows(logits, params, mode)  # [bs * n, vocab]
        if mode == FILTERED:  # the token after node i sits at sequence index position(i) + 1
            argmax = seeded_argmax(filtered, params, self.seeds[:bs], self.target.positions[:bs * n] + 1, argmax)
        uniforms = torch.rand(bs, n, device=logits.device, generator=self.generator)
        noise = torch.empty(bs, vocab, device=logits.device).exponential_(generator=self.generator)
        return (params[4] > 0) | (params[5] > 0), filtered.softmax(-1).view(bs, n, vocab), uniforms, noise, argmax

    def _verify_chains(self, tokens: torch.Tensor, logits: torch.Tensor, mode: str):
        """`_verify` for chains tokens [bs, n] against logits [bs, n, vocab], as their verdict (rows with a
        synthetic draw accept `chain_drawn`'s drafts); sampling rows by `verify_chains` (see the module's
        docstring)."""
        bs, n = tokens.shape
        argmax = logits.argmax(-1)  # [bs, n]
        want, detour = self.want[0, :bs], self.want[1, :bs]
        drawn = torch.where(want >= 0, chain_drawn(want, detour, n), -1)  # [bs]
        if mode == GREEDY:
            return chain_verdict(tokens, argmax, torch.where(want >= 0, drawn, chain_accept_len(tokens, argmax)))
        return verify_chains(tokens, logits, *self._sampling(logits, mode, argmax), drawn)

    def _move_kv(self, bs: int, slot_pos: torch.Tensor, path: torch.Tensor) -> None:
        """Move the target KV of each accepted tree branch to the positions after the prefix (all layers, one
        copy); everything else copies the scratch slot onto itself."""
        d = self.draft
        nodes = d.const.arange(path.shape[1])
        moves = (path >= 0) & (path != nodes) & d.live[:bs, None]  # [bs, n]
        ends = d.ends[:bs, None]
        src = d._slots(bs, ends + path.clamp(min=0), moves)  # [bs * n]
        dst = d._slots(bs, slot_pos, moves)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _advance(self, bs: int, n: int, verdict, aux: torch.Tensor, chain: bool) -> None:
        """The verdict becomes the next step's draft inputs: pairs (features at the accepted nodes, the token
        after each) and the new root position; the features of committed positions that end a block go to
        the proposer's block features (as `Eagle3Proposer.observe`). chain: the path is the leading nodes."""
        d, p = self.draft, self.proposer
        live = d.live[:bs]
        page, count = p.block_size, verdict.accept_len + 1  # [bs] pairs to catch up on next
        kept = d.const.arange(n) <= verdict.accept_len[:, None]  # [bs, n]
        features = aux.view(bs, n, -1)  # [bs, n, aux_dim] in path order (past the path: not kept)
        if not chain:
            features = features.gather(1, verdict.path.clamp(min=0)[:, :, None].expand(bs, n, aux.shape[1]))
        m = min(n, d.q)  # a path holds at most steps + 1 = Q nodes
        d.ids[:bs * d.q].view(bs, d.q)[:, :m].copy_(torch.where(kept, verdict.out_tokens, 0)[:, :m])
        d.features[:bs * d.q].view(bs, d.q, -1)[:, :m].copy_(features[:, :m])
        pos = d.ends[:bs, None] + d.const.arange(n)  # [bs, n] committed positions
        ends_block = kept & (pos % page == page - 1) & live[:, None]
        blocks = torch.where(ends_block, d.tables[:bs].long().gather(1, pos // page), p.block_features.shape[0])
        p.all_block_features[blocks.view(-1)] = features.reshape(bs * n, -1)
        d.q_lens[:bs].copy_(torch.where(live, count, 1))
        d.ends[:bs].add_(torch.where(live, count, 0))

    # ---- capture and launch -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        keys = [(bs, s, m) for s in self.shapes for m in self.modes[s] for bs in reversed(self.sizes[s])]
        self.draft.live.zero_()
        self.graphs, _ = capture_all(keys, self._run, generators=(self.generator,))
        torch.cuda.synchronize(self.want.device)
        seconds = time.perf_counter() - start
        log.info("captured %d speculative-step CUDA graphs in %.1f s", len(self.graphs), seconds)
        return seconds

    def runs(self, shape: Shape, rows: int, mode: str) -> bool:
        """Can a run of this many rows and this mode go on with a step of this shape (a graph of it holds them)?"""
        return shape in self.sizes and mode in self.modes[shape] and rows <= self.sizes[shape][-1]

    @torch.inference_mode()
    def start(self, seqs: list[Sequence], shape: Shape, mode: str, draws: Optional[list[tuple[int, int]]]
              ) -> LoopFlight:
        """The first step of a run (`runs` holds it): draft inputs from the sequences' draft state (each has one
        uncomputed token, its root). mode: theirs (`run_mode`); draws: synthetic acceptance's drafts to accept per
        row."""
        self.proposer.settle(seqs, self.draft.q)
        self.draft.fill(seqs)
        self.tables_version = [len(s.block_table) for s in seqs]
        if mode != GREEDY:
            self._set_rows([s.params for s in seqs])
        return self._launch(seqs, shape, draws, mode)

    def _set_rows(self, params: list) -> None:
        """A sampling run's per-row parameters into `row_params` and `seeds` (padding rows greedy)."""
        rows, seeds = row_params(params, self.row_params.shape[1])
        self.row_params.copy_(rows)
        self.seeds.copy_(seeds)

    @torch.inference_mode()
    def launch(self, flight: LoopFlight, shape: Shape, draws: Optional[list[tuple[int, int]]]) -> LoopFlight:
        """The next step of the same rows, of any shape the loop runs (the draft inputs do not depend on it),
        before flight's result is read (the engine has grown the block tables to hold the most flight can
        accept plus this step's slots)."""
        seqs = flight.seqs
        lengths = [len(s.block_table) for s in seqs]
        if lengths != self.tables_version:
            tables = padded_tables([s.block_table for s in seqs])  # [rows, width]
            self.draft.tables[:len(seqs), :tables.shape[1]].copy_(to_device(tables, torch.int32, self.want.device))
            self.tables_version = lengths
        return self._launch(seqs, shape, draws, flight.mode)

    def _launch(self, seqs: list[Sequence], shape: Shape, draws: Optional[list[tuple[int, int]]], mode: str
                ) -> LoopFlight:
        bs = next(b for b in self.sizes[shape] if b >= len(seqs))
        if draws is not None:
            assert self.synthetic or shape.topk == 1, "a tree's draws need a loop captured with synthetic acceptance"
            self.want[:, :len(draws)].copy_(to_device(draws, torch.long, self.want.device).T)
        elif self._drawn:
            self.want.fill_(-1)
        self._drawn = draws is not None
        self.graphs[(bs, shape, mode)].replay()
        self.launches += 1
        self._flip = 1 - self._flip
        host = self.host[self._flip]
        host[:bs].copy_(self.result[:bs], non_blocking=True)
        self.events[self._flip].record()
        return LoopFlight(seqs, shape, host, self.events[self._flip], mode)

    def hand_back(self, seqs: list[Sequence], accepted: list[Optional[int]]) -> None:
        """The run ends after its last step was read: each sequence's draft state as the synchronous path
        leaves it. accepted[i]: what the last step accepted for seqs[i], or None for a sequence that finished
        in an earlier step (the later steps' catch-up covered its kept pairs)."""
        features = self.draft.features.clone()  # [B * Q, aux_dim]: the next catch-up's pairs
        q = self.draft.q
        for b, (seq, a) in enumerate(zip(seqs, accepted)):
            if a is None:
                seq.draft_state = DraftState(computed=seq.num_computed_tokens)
            else:
                seq.draft_state = DraftState(seq.num_computed_tokens - a - 1, [(features, range(b * q, b * q + a + 1))])
