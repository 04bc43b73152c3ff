"""Verification: which draft tokens the target accepts, and the token it adds.

Glossary (after vLLM's rejection sampler):
- draft tokens: the proposer's guesses, arranged in a tree (a chain is a tree with one child per node);
- accepted tokens: drafts on the path from the root that the target agrees with;
- recovered token: after the children of a node are all rejected, a token sampled from what is left
  of the target's distribution there (greedy: the target's argmax);
- bonus token: when the path ends at a node without children, a token sampled from the target's
  distribution there;
- output tokens: accepted tokens followed by the one recovered or bonus token, so every verify emits
  at least one token.

Sampling treats each draft child as a point-mass proposal and tests the children of a node one at a
time (recursive rejection sampling): child x is accepted with probability p(x) under the target's
current distribution p; on rejection p loses x and is renormalised. The emitted token therefore has
exactly the distribution p, whatever the draft proposed. Greedy is the special case p = one-hot(argmax).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .tree import DraftTree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, starting at the root (node 0)
    tokens: list[int]  # output tokens: accepted drafts, then the recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, argmax: list[int]) -> Verdict:
    """argmax[i]: the target's most likely next token after node i."""
    node, path, tokens = 0, [0], []
    while True:
        want = argmax[node]
        tokens.append(want)
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return Verdict(path, tokens)
        path.append(child)
        node = child


def verify_sampling(tree: DraftTree, probs: torch.Tensor, generator: Optional[torch.Generator]) -> Verdict:
    """probs [N, vocab]: the target's sampling distribution after each node (temperature, top-k, top-p
    and min-p applied, as the plain sampler applies them)."""
    n = tree.size
    device = probs.device
    uniforms = torch.rand(n, device=device, generator=generator).tolist()
    noise = torch.empty(probs.shape[1], device=device).exponential_(generator=generator)
    if n > 1:
        cand = torch.tensor(tree.tokens[1:], device=device)
        parent = torch.tensor(tree.parents[1:], device=device)
        child_p = [0.0] + probs[parent, cand].tolist()  # p(token of node i | its parent)
    node, path, tokens, draw = 0, [0], [], 0
    while True:
        rejected, remaining, accepted = [], 1.0, None
        for child in tree.children(node):
            p = child_p[child] / remaining if remaining > 0 else 0.0
            if uniforms[draw % n] < p:
                accepted = child
                draw += 1
                break
            draw += 1
            rejected.append(tree.tokens[child])
            remaining -= child_p[child]
        if accepted is None:
            residual = probs[node].clone()
            if rejected:
                residual[torch.tensor(rejected, device=device)] = 0
            tokens.append(int((residual / noise).argmax()))
            return Verdict(path, tokens)
        tokens.append(tree.tokens[accepted])
        path.append(accepted)
        node = accepted


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    """The drafts from the root (excluded) to node (included), in order."""
    path = []
    while node > 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def processed_logits(tree: DraftTree, logits: torch.Tensor, params, history: tuple) -> torch.Tensor:
    """logits [N, vocab] after each node processed (`layers.logits_processors.process_one`) as a plain
    step would after the sequence's tokens and the node's path. history: (prompt token ids, output token
    ids, EOS and stop token ids)."""
    from ..layers.logits_processors import process_one

    prompt, output, stops = history
    return torch.stack([process_one(logits[i], params, prompt, output + path_tokens(tree, i), stops)
                        for i in range(tree.size)])


def verify(tree: DraftTree, logits: torch.Tensor, params, generator: Optional[torch.Generator],
           position: Optional[int] = None, history: Optional[tuple] = None) -> Verdict:
    """logits [N, vocab]: the target's logits after each node of the tree. A seeded request (params.seed)
    verifies greedily against its seeded samples: after node i the token `Sampler` draws at sequence
    index position + depth(i), where position is the index of the token after the root. A request with
    penalties, logit_bias or min_tokens (`params.processes_logits`) needs history (see `processed_logits`)."""
    from ..layers.sampler import filtered_logits, seeded_tokens

    if params.processes_logits:
        logits = processed_logits(tree, logits, params, history)

    if params.greedy:
        return verify_greedy(tree, logits.argmax(-1).tolist())
    if params.seed is not None:
        positions = torch.tensor([position + d for d in tree.depths()], device=logits.device)
        return verify_greedy(tree, seeded_tokens(logits, [params] * tree.size, positions).tolist())
    probs = filtered_logits(logits, [params] * tree.size).softmax(-1)
    return verify_sampling(tree, probs, generator)
