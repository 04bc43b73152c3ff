"""Greedy EAGLE-3 chains with the host one step behind: speculative steps in the overlap pipeline.

In steady state a greedy chain step needs nothing from the host. Its draft catches up on what the previous
verify accepted (tokens and target features already on the device), drafts the chain, the target verifies
it, and the verdict becomes the next step's draft inputs. One CUDA graph per (batch size, chain shape) runs
all of it on the static buffers of the draft graphs (`DraftGraphs`) and the target's (`GraphRunner`) and
leaves each row's accept length and output tokens for the host, which copies them without waiting.

The engine launches step N+1 before it reads step N's result, with KV reserved for the most step N can
accept; while it applies step N (stop checks, outputs) the device runs step N+1. Anything that changes the
batch (a request finishes, arrives or is aborted, the controller switches shape, the KV pool runs short)
drains the pipeline: the last step's result is read and `hand_back` leaves every sequence's draft state as
the synchronous path would. Verification is `verify_greedy_chains`' (synthetic acceptance: the host's draws
of each step, as `SyntheticAcceptance.verify_batch` accepts along a chain).
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
from ..layers.triton_attention import padded_tables
from .batch_verify import path_verdict, verify_greedy_chains
from .controller import Shape
from .eagle3_proposer import DraftState

if TYPE_CHECKING:
    from .eagle3_proposer import Eagle3Proposer

log = logging.getLogger(__name__)


@dataclass
class ChainFlight:
    """A launched chain step whose result the host has not read."""

    seqs: list[Sequence]  # its rows, in order
    shape: Shape
    host: torch.Tensor  # [rows, N + 1] pinned: accept length, then the output tokens (-1 past them)
    event: torch.cuda.Event  # recorded after the copy to `host`
    started: float  # perf_counter when its step began

    def read(self) -> list[tuple[int, list[int]]]:
        """Per row: drafts accepted, and the tokens the step emits (the accepted drafts, then the target's)."""
        self.event.synchronize()
        return [(r[0], r[1:r[0] + 2]) for r in self.host[:len(self.seqs)].tolist()]


def plain_greedy(seq: Sequence) -> bool:
    """Does seq verify by argmax alone (greedy, no logits processing, grammar or logprobs)?"""
    p = seq.params
    return p.greedy and p.logprobs is None and not p.processes_logits and not p.guided


class ChainLoop:
    def __init__(self, proposer: "Eagle3Proposer", target: GraphRunner):
        """proposer: its draft graphs are captured; target: the target's captured graphs (same scratch slot)."""
        draft = proposer.graphs
        assert draft.scratch_slot == target.scratch_slot, "the draft and the target pad into one scratch slot"
        self.proposer, self.draft, self.target = proposer, draft, target
        self.shapes = [s for s in draft.shapes if s.topk == 1 and s.num_nodes in target.sizes]
        self.sizes = {s: [b for b in draft.sizes if b in target.sizes[s.num_nodes]] for s in self.shapes}
        dev, max_bs = draft.ids.device, draft.live.shape[0]
        most = max((s.num_nodes for s in self.shapes), default=1)
        self.want = torch.full((max_bs,), -1, dtype=torch.long, device=dev)  # [B] synthetic draws; -1: verify
        self.result = torch.zeros(max_bs, most + 1, dtype=torch.long, device=dev)  # [B, N + 1] for the host
        self.host = [torch.empty(max_bs, most + 1, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self._flip = 0
        self._drawn = False  # the latest launch verified by synthetic draws
        self.graphs: dict[tuple[int, Shape], torch.cuda.CUDAGraph] = {}
        self.launches = 0
        self.tables_version: list[int] = []  # block table lengths as last copied to the device

    # ---- what the graph runs ---------------------------------------------------------------------
    def _run(self, bs: int, shape: Shape) -> None:
        d, t, n = self.draft, self.target, shape.num_nodes
        dev = d.ids.device
        drafts = d._run(bs, shape)[0]  # [bs, steps] the chain
        q_lens, ends, live = d.q_lens[:bs].long(), d.ends[:bs], d.live[:bs]
        root = d.ids[:bs * d.q].view(bs, d.q).gather(1, q_lens[:, None] - 1)  # [bs, 1] the last pair's token
        tokens = torch.cat([root, drafts], 1)  # [bs, n]
        pos = ends[:, None] + torch.arange(n, device=dev)  # [bs, n]
        t.ids[:bs * n].copy_(tokens.view(-1))
        t.positions[:bs * n].copy_(pos.view(-1))
        t.slots[:bs * n].copy_(d._slots(bs, pos, torch.ones_like(pos, dtype=torch.bool)))
        t.seq_lens[:bs].copy_(torch.where(live, ends + n, 0))
        width = min(t.block_tables.shape[1], d.tables.shape[1])
        t.block_tables[:bs, :width].copy_(d.tables[:bs, :width])
        t.tree_bits[:bs * n].zero_()
        t.tree_lens[:bs].zero_()
        logits, aux = t._run(bs, n)  # [bs * n, vocab], [bs * n, aux_dim]
        argmax = logits.view(bs, n, -1).argmax(-1)  # [bs, n]
        matched = verify_greedy_chains(tokens, logits.view(bs, n, -1), argmax).accept_len  # [bs]
        want = self.want[:bs]
        accept = torch.where(want >= 0, want.clamp(max=n - 1), matched)  # [bs]
        kept = torch.arange(n, device=dev) <= accept[:, None]  # [bs, n] the root and the accepted drafts
        verdict = path_verdict(tokens, kept, argmax.gather(1, accept[:, None]).squeeze(1))
        self._advance(bs, n, pos, kept, verdict.out_tokens, aux)
        self.result[:bs, 0].copy_(accept)
        self.result[:bs, 1:n + 1].copy_(verdict.out_tokens)

    def _advance(self, bs: int, n: int, pos: torch.Tensor, kept: torch.Tensor, out: torch.Tensor,
                 aux: torch.Tensor) -> None:
        """The verdict becomes the next step's draft inputs: pairs (features at the kept positions, the
        token after each) and the new root position; the features of kept positions that end a block go
        to the proposer's block features (as `Eagle3Proposer.observe`)."""
        d, p = self.draft, self.proposer
        live = d.live[:bs]
        page, count = p.block_size, kept.sum(1)  # [bs] pairs to catch up on next
        d.ids[:bs * d.q].view(bs, d.q)[:, :n].copy_(torch.where(kept, out, 0))
        d.features[:bs * d.q].view(bs, d.q, -1)[:, :n].copy_(aux.view(bs, n, -1))
        ends_block = kept & (pos % page == page - 1) & live[:, None]  # [bs, n]
        blocks = torch.where(ends_block, d.tables[:bs].long().gather(1, pos // page), p.block_features.shape[0])
        p.all_block_features[blocks.view(-1)] = aux
        d.q_lens[:bs].copy_(torch.where(live, count, 1))
        d.ends[:bs].add_(torch.where(live, count, 0))

    # ---- capture and launch -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> float:
        start = time.perf_counter()
        keys = [(bs, s) for s in self.shapes for bs in reversed(self.sizes[s])]
        self.draft.live.zero_()
        self.graphs, _ = capture_all(keys, self._run)
        torch.cuda.synchronize(self.want.device)
        seconds = time.perf_counter() - start
        log.info("captured %d chain-step CUDA graphs in %.1f s", len(self.graphs), seconds)
        return seconds

    def fits(self, seqs: list[Sequence], shape: Shape) -> bool:
        """Can these sequences run a chain step of this shape here (a captured batch size, plain greedy)?"""
        return shape in self.sizes and len(seqs) <= self.sizes[shape][-1] and all(map(plain_greedy, seqs))

    @torch.inference_mode()
    def start(self, seqs: list[Sequence], shape: Shape, started: float, draws: Optional[list[int]]) -> ChainFlight:
        """The first step of a run: draft inputs from the sequences' draft state (each has one uncomputed
        token, its root). draws: synthetic acceptance's drafts to accept per row."""
        self.proposer.settle(seqs, self.draft.q)
        self.draft.fill(seqs)
        self.tables_version = [len(s.block_table) for s in seqs]
        return self._launch(seqs, shape, started, draws)

    @torch.inference_mode()
    def launch(self, flight: ChainFlight, started: float, draws: Optional[list[int]]) -> ChainFlight:
        """The next step of the same rows, before flight's result is read (the block tables have grown to
        hold it: see `reserve`)."""
        seqs = flight.seqs
        lengths = [len(s.block_table) for s in seqs]
        if lengths != self.tables_version:
            tables = padded_tables([s.block_table for s in seqs])  # [rows, width]
            self.draft.tables[:len(seqs), :tables.shape[1]].copy_(to_device(tables, torch.int32, self.want.device))
            self.tables_version = lengths
        return self._launch(seqs, flight.shape, started, draws)

    def _launch(self, seqs: list[Sequence], shape: Shape, started: float, draws: Optional[list[int]]) -> ChainFlight:
        bs = next(b for b in self.sizes[shape] if b >= len(seqs))
        if draws is not None:
            self.want[:len(draws)].copy_(to_device(draws, torch.long, self.want.device))
        elif self._drawn:
            self.want.fill_(-1)
        self._drawn = draws is not None
        self.graphs[(bs, shape)].replay()
        self.launches += 1
        self._flip = 1 - self._flip
        host = self.host[self._flip]
        host[:bs].copy_(self.result[:bs], non_blocking=True)
        self.events[self._flip].record()
        return ChainFlight(seqs, shape, host, self.events[self._flip], started)

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
