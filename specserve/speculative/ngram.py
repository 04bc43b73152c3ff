"""Prompt-lookup ("n-gram") speculation: drafts copied from the request's own tokens, no draft model.

The longest suffix of a request's tokens (prompt and output so far, the uncomputed root included) between
`min_match` and `max_match` tokens long that also occurs earlier in them is looked up, and the tokens that followed
its latest earlier occurrence are the drafts of a chain (vLLM's ngram method with prompt_lookup_min / max). Where
that continuation runs into the end of the tokens it repeats with the match's period (a loop drafts its next
turn). A request whose suffix occurs nowhere earlier drafts its last token again: a chain the target rejects at
its first draft, at the cost of a verify; the adaptive controller weighs that through the acceptance it measures.

Each request keeps its tokens as an array (`PromptLookup`, `seq.draft_state`), extended with those that arrived
since its last draft; a lookup compares the last token with every earlier one at once, then extends the matches
backwards. Drafting reads host token lists only: no draft KV, no hidden states, no CUDA graphs (speculative steps
run one at a time, verified like any chain).
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from ..engine.sequence import Sequence
from .proposer import Proposer
from .shapes import Shape
from .tree import DraftTree


class PromptLookup:
    """A request's tokens as an array (grown as they arrive), searched for the latest earlier occurrence of its
    longest suffix: the occurrences of its last token first (one vectorized comparison over the context), then
    how far back each keeps matching, up to max_match tokens (8 bytes a token, microseconds a lookup at 4k)."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self.tokens = np.empty(256, dtype=np.int64)  # [capacity], the first `size` entries filled
        self.size = 0

    def _sync(self, tokens: list[int]) -> np.ndarray:
        """The array of tokens (which only ever grow)."""
        if len(tokens) > self.tokens.size:
            grown = np.empty(max(2 * self.tokens.size, len(tokens)), dtype=np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:len(tokens)] = tokens[self.size:]
        self.size = len(tokens)
        return self.tokens[:self.size]

    def continuation(self, tokens: list[int], k: int) -> Optional[list[int]]:
        """The k tokens after the latest earlier occurrence of the longest suffix of tokens (min_match to max_match
        long) found, or None."""
        a = self._sync(tokens)  # [L]
        last = len(a) - 1
        ends = np.flatnonzero(a[:-1] == a[-1]) + 1  # [C] where an occurrence of the last token ends (<= L - 1)
        if not ends.size:
            return None
        length = np.ones(ends.size, dtype=np.int64)  # [C] tokens matched backwards from each
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_match, last)):
            before = ends - 1 - back  # [C] the token `back` places before each occurrence's last
            alive &= (before >= 0) & (a[np.maximum(before, 0)] == a[last - back])
            length += alive
        best = int(length.max())
        if best < self.min_match:
            return None
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest
        period = len(a) - end  # > 0: the occurrence ends before the suffix does
        return [tokens[end + i % period] for i in range(k)]


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
            lookup = seq.draft_state
            if not isinstance(lookup, PromptLookup):
                lookup = seq.draft_state = PromptLookup(self.min_match, self.max_match)
            tokens = seq.token_ids
            drafts = lookup.continuation(tokens, k) or [tokens[-1]] * k
            trees.append(DraftTree.chain(tokens[-1], drafts))
        return trees

    def observe(self, aux: Optional[torch.Tensor], committed: list[tuple[Sequence, Union[range, list[int]]]],
                inputs=None) -> None:
        """Nothing to follow: drafts come from the tokens alone."""
