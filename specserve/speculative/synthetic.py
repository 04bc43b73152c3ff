"""Synthetic acceptance: verification that accepts drafts at configured rates (benchmarks only).

Random weights accept nothing, so no figure of speculation at a real model size could be taken without
a real checkpoint. With `speculative_synthetic_acceptance_rates` every forward pass runs as usual; only
the accept decision is drawn: rates[i] is the unconditional probability that the first i+1 drafts are
all accepted (vLLM's `synthetic_acceptance_rates`), so the rates are non-increasing and one entry per
draft depth. A tree configuration's chain candidates (the adaptive policy's) may accept at rates of their
own (`speculative_synthetic_chain_rates`): a chain accepts less than a tree of the same drafter. The emitted
tokens are the accepted drafts and one target token (the target's argmax or sample after the last accepted
node): the text is meaningless, the step costs are real.

One draw per verify: u in [0, 1), accepted = #{i : u < rates[i]}, which gives P(accepted > i) = rates[i]
exactly. u comes from a golden-ratio (Weyl) sequence with a seeded start, so the measured per-position
rates converge as O(log n / n) instead of O(1 / sqrt(n)): a short benchmark level sees the configured
acceptance, not a lucky draw.

Trees accept along their spine (from the root, each node's first child: level order keeps the draft's
children best first) for as many drafts as a chain would with the same draw (chain_rates), then, where the
tree's draw goes further, step to the node's second child and follow first children again, or stop where
the node has no second child: a tree gains over its spine only through a side branch it has, as with a
real drafter (the controller learns that gain, speculative/acceptance.py); the configured tree rates are
what a tree branching at every depth would accept. So that the spine is the tree a drafter of these rates
would build, drafts rank their children by synthetic scores (`child_scores`): the first child of a node at
depth d has the conditional rate rates[d] / rates[d-1], the others share what is left. On random weights,
whose draft distribution is nearly flat, the tree would otherwise be broad and two levels deep.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..device import to_device
from .batch_verify import BatchVerdict, path_verdict
from .tree import first_children

GOLDEN = (math.sqrt(5) - 1) / 2


class SyntheticAcceptance:
    """Accepts drafts at configured per-position rates; see the module docstring."""

    def __init__(self, rates: tuple[float, ...], seed: int = 0, chain_rates: Optional[tuple[float, ...]] = None):
        self.rates = rates
        self.chain_rates = chain_rates or rates  # what chains accept where the configured shape is a tree
        self.draws = 0
        self._scores: dict = {}  # (rates, depth, k, device) -> child_scores, made once
        self.start = (seed * GOLDEN + 0.5) % 1.0

    def draw(self, tree: bool = False) -> tuple[int, int]:
        """How many drafts the next verify of a tree (or a chain) accepts (before its own depth limits it),
        and the depth at which a tree's path leaves its spine for a second child (-1: it does not)."""
        u = (self.start + self.draws * GOLDEN) % 1.0
        self.draws += 1
        spine = sum(1 for r in self.chain_rates if u < r)
        if not tree:
            return spine, -1
        accepted = sum(1 for r in self.rates if u < r)
        return accepted, spine if accepted > spine else -1

    def child_scores(self, depth: int, k: int, device: torch.device) -> torch.Tensor:
        """[k] log-scores of a node's children ranked best first, for draft depth `depth` (1-based)."""
        key = (self.rates, depth, k, str(device))
        if key not in self._scores:
            self._scores[key] = self._child_scores(depth, k, device)
        return self._scores[key]

    def _child_scores(self, depth: int, k: int, device) -> torch.Tensor:
        prev = self.rates[depth - 2] if depth > 1 else 1.0
        cond = self.rates[depth - 1] / prev if prev > 0 else 0.0
        rest = (1.0 - cond) / (k - 1) if k > 1 else 0.0
        scores = [math.log(max(cond, 1e-9))] + [math.log(max(rest, 1e-9)) - 1e-6 * i for i in range(1, k)]
        return torch.tensor(scores, device=device)

    def verify_batch(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, params,
                     generators, chains: bool = False, positions=None, default=None) -> BatchVerdict:
        """`verify_batch_params`' contract: tokens, parents [B, N]; logits [B, N, V]. Row b accepts the
        first draws of its spine; its last token is the target's (argmax, or a sample under params[b])."""
        from ..layers.sampler import Sampler

        # [2, B] drafts to accept, depth of the detour
        want, detour = to_device([self.draw(not chains) for _ in range(tokens.shape[0])], torch.long, tokens.device).T
        on_path, node = spine_path(parents, want, detour)
        b, dev = tokens.shape[0], tokens.device
        at = None if positions is None else to_device(positions, torch.long, dev) + on_path.sum(1) - 1  # [B]
        final = Sampler(default)(logits[torch.arange(b, device=dev), node], params, generators, at)  # [B]
        return path_verdict(tokens, on_path, final)


def spine_path(parents: torch.Tensor, want: torch.Tensor, detour: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of trees parents [B, N], the path that follows each node's first child for want[b] steps (or
    until a leaf), taking the second child instead at step detour[b] (detour [B], -1: never), and ending
    there where the node has none (a tree gains over its spine only through a side branch it has):
    on_path [B, N] bool and its last node [B]."""
    b, n = parents.shape
    dev = parents.device
    cols, child_of, first_child, later = first_children(parents)  # [B, N], [B, N], [B, N + 1], [B, N]
    second_child = torch.full((b, n + 1), n, dtype=torch.long, device=dev)  # [B, N + 1] n = none
    second_child.scatter_reduce_(1, torch.where(later, child_of, n), cols, "amin")
    second_child[:, n] = n
    node = torch.zeros(b, dtype=torch.long, device=dev)  # [B]
    on_path = cols == 0  # [B, N]
    going = torch.ones(b, dtype=torch.bool, device=dev)  # [B] not ended at a missing side branch
    for depth in range(n - 1):
        nxt = first_child.gather(1, node[:, None]).squeeze(1)  # [B]
        if detour is not None:
            side = second_child.gather(1, node[:, None]).squeeze(1)
            going = going & ((detour != depth) | (side < n))
            nxt = torch.where(detour == depth, side, nxt)
        step = going & (depth < want) & (nxt < n)
        node = torch.where(step, nxt, node)
        on_path = on_path | (step[:, None] & (cols == node[:, None]))
    return on_path, node


def chain_drawn(want: torch.Tensor, detour: torch.Tensor, n: int) -> torch.Tensor:
    """`spine_path` along chains of n nodes as drafts accepted [B], for rows with a draw (want >= 0): want,
    ending at the detour's depth (a chain has no side branch), at most n - 1."""
    return torch.where(detour >= 0, torch.minimum(want, detour), want).clamp(max=n - 1)
