"""Prompt-lookup ("n-gram") speculation: drafts copied from the request's own tokens, no draft model.

The longest suffix of a request's tokens (prompt and output so far, the uncomputed root included) between
`min_match` and `max_match` tokens long that also occurs earlier in them is looked up, and the tokens that followed
its latest earlier occurrence are the drafts of a chain (vLLM's ngram method with prompt_lookup_min / max). Where
that continuation runs into the end of the tokens it repeats with the match's period (a loop drafts its next
turn). A request whose suffix occurs nowhere earlier drafts its last token again: a chain the target rejects at
its first draft, at the cost of a verify; the adaptive controller weighs that through the acceptance it measures.

Each request keeps an index of its n-grams (`NgramIndex`, `seq.draft_state`), extended with the tokens that
arrived since its last draft, so a draft costs a dictionary lookup per window size, not a scan of the context.
Drafting reads host token lists only: no draft KV, no hidden states, no CUDA graphs (speculative steps run one at
a time, verified like any chain).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..engine.sequence import Sequence
from .proposer import Proposer
from .shapes import Shape
from .tree import DraftTree


class NgramIndex:
    """Where each n-gram of a token list (min_match <= n <= max_match) last ended, for those that end before the
    list's last token (so a token follows each)."""

    def __init__(self, min_match: int, max_match: int):
        self.sizes = range(min_match, max_match + 1)
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index after its latest occurrence
        self.indexed = 0  # n-grams ending at or before this index are in `ends`

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending at len(tokens) - 1 or before (the last token's own are left out)."""
        for end in range(max(self.indexed + 1, self.sizes.start), len(tokens)):
            for n in self.sizes:
                if n > end:
                    break
                self.ends[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def continuation(self, tokens: list[int], k: int) -> Optional[list[int]]:
        """The k tokens after the latest earlier occurrence of the longest suffix found, or None."""
        self.extend(tokens)
        for n in reversed(self.sizes):
            if n >= len(tokens):
                continue
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                period = len(tokens) - end  # > 0: the occurrence ends before the suffix does
                return [tokens[end + i % period] for i in range(k)]
        return None


class NgramProposer(Proposer):
    """Chains of prompt-lookup drafts (see the module's docstring)."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match

    def num_slots(self, shape: Shape) -> int:
        return shape.num_nodes

    def propose(self, seqs: list[Sequence], shape: Shape) -> list[DraftTree]:
        k = shape.num_nodes - 1
        trees = []
        for seq in seqs:
            index = seq.draft_state
            if not isinstance(index, NgramIndex):
                index = seq.draft_state = NgramIndex(self.min_match, self.max_match)
            tokens = seq.token_ids
            drafts = index.continuation(tokens, k) or [tokens[-1]] * k
            trees.append(DraftTree.chain(tokens[-1], drafts))
        return trees

    def observe(self, aux: Optional[torch.Tensor], committed: list[tuple[Sequence, Union[range, list[int]]]],
                inputs=None) -> None:
        """Nothing to follow: drafts come from the tokens alone."""
