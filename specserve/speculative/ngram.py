"""Prompt-lookup ("n-gram") speculation: drafts copied from the request's own tokens, no draft model.

The longest suffix of a request's tokens (prompt and output so far, the uncomputed root included) between
`min_match` and `max_match` tokens long that also occurs earlier in them is looked up, and the tokens that followed
its latest earlier occurrence are the drafts of a chain (vLLM's ngram method with prompt_lookup_min / max). Where
that continuation runs into the end of the tokens it repeats with the match's period (a loop drafts its next
turn). A request whose suffix occurs nowhere earlier does not draft (`drafts`): in a speculative step it decodes
its one token beside the requests that verify drafts, where a draft of its last token again would cost a verify
the target rejects (none of 976 such drafts was accepted in a greedy replay of 48 held-out outputs). Only a
step that must draft for every row (start-up calibration, synthetic acceptance) gives it that chain.

With `speculative_eagle_topk` > 1 a tree shape drafts a tree instead (in the spirit of SGLang's trie-based n-gram
drafts): the continuations of several earlier occurrences, the longest matches first, merged into a trie whose
best nodes are kept (`lookup_tree`). Where the text went on differently after the same words, the verify tries
each way; the adaptive controller prices the tree against the chains as it does for EAGLE-3.

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
from .ngram_history import History
from .proposer import Proposer
from .shapes import Shape
from .tree import DraftTree

RECENT = 64  # a tree's filler guesses come from the request's last RECENT tokens
FEW = 16  # up to this many earlier occurrences of the last token are extended in Python, more in numpy


class PromptLookup:
    """A request's tokens as an array (grown as they arrive), searched for the latest earlier occurrence of its
    longest suffix: the occurrences of its last token first (one vectorized comparison over the context), then
    how far back each keeps matching, up to max_match tokens (8 bytes a token, microseconds a lookup at 4k)."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self.tokens = np.empty(256, dtype=np.int64)  # [capacity], the first `size` entries filled
        self.size = 0
        self.memo: tuple = (None, [])  # the proposer's last lookup for this request (drafts() then propose()):
        # (its key, what it found)

    def _sync(self, tokens: list[int]) -> np.ndarray:
        """The array of tokens (which only ever grow)."""
        if len(tokens) > self.tokens.size:
            grown = np.empty(max(2 * self.tokens.size, len(tokens)), dtype=np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[self.size:len(tokens)] = tokens[self.size:]
        self.size = len(tokens)
        return self.tokens[:self.size]

    def _matches(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every earlier occurrence of the suffix: where each ends ([C], the index after its last token, <= L - 1)
        and how many tokens of the suffix it matches backwards ([C], 1 to max_match)."""
        a = self._sync(tokens)  # [L]
        ends = np.flatnonzero(a[:-1] == a[-1]) + 1  # [C] where an occurrence of the last token ends
        most = min(self.max_match, len(tokens) - 1)  # tokens a match may span
        if ends.size <= FEW:  # a few candidates: compared in Python, cheaper than numpy's calls
            length = np.array([self._span(tokens, end, most) for end in ends.tolist()], dtype=np.int64)
        else:
            back = np.arange(1, most)  # [most - 1]
            before = ends[:, None] - 1 - back  # [C, most - 1] the tokens before each occurrence's last
            same = (before >= 0) & (a[np.maximum(before, 0)] == a[-1 - back])  # [C, most - 1]
            length = 1 + np.cumprod(same, axis=1).sum(axis=1)  # [C] tokens matched backwards from each
        return ends, length

    @staticmethod
    def _span(tokens: list[int], end: int, most: int) -> int:
        """How many tokens before index `end` match the suffix of tokens, up to most."""
        n = 1
        while n < most and end - 1 - n >= 0 and tokens[end - 1 - n] == tokens[-1 - n]:
            n += 1
        return n

    def continuation(self, tokens: list[int], k: int) -> Optional[list[int]]:
        """The k tokens after the latest earlier occurrence of the longest suffix of tokens (min_match to max_match
        long) found, or None."""
        found = self.continuations(tokens, k, 1)
        return found[0][1] if found else None

    def continuations(self, tokens: list[int], k: int, limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` earlier occurrences of a suffix of min_match to max_match tokens, the longest first and the
        latest first among equals: (tokens matched, the k tokens after it)."""
        ends, length = self._matches(tokens)
        keep = np.flatnonzero(length >= self.min_match)
        order = keep[np.lexsort((-ends[keep], -length[keep]))][:limit]
        return [(int(length[i]), wrapped(tokens, int(ends[i]), k)) for i in order]


def wrapped(tokens: list[int], end: int, k: int) -> list[int]:
    """The k tokens from index `end` on, repeating tokens[end:] (a loop's next turn) where they run out."""
    period = len(tokens) - end  # > 0: the occurrence ends before the suffix does
    return [tokens[end + i % period] for i in range(k)]


def lookup_tree(root: int, found: list[list[int]], shape: Shape, recent: list[int]) -> DraftTree:
    """A tree of shape.num_nodes nodes from the continuations `found`, best first (see `continuations`): their
    trie, of which the best nodes are kept while they stay connected, at most shape.topk children a node. A
    node ranks as the best continuation through it; the kept nodes come in level order, each node's children
    best first, so the spine is the best continuation. Nodes short of num_nodes are filled with distinct
    tokens of `recent` (latest first) as the root's last children: guesses a verify can still accept."""
    children: list[dict[int, int]] = [{}]  # per trie node, token -> child node
    token, rank = [root], [-1]  # rank: the index in `found` of the best continuation through the node
    for r, drafts in enumerate(found):
        node = 0
        for t in drafts:
            if t not in children[node]:
                children[node][t] = len(token)
                children.append({})
                token.append(t), rank.append(r)
            node = children[node][t]

    def ranked(node: int) -> list[int]:
        return sorted(children[node].values(), key=rank.__getitem__)

    kept, frontier = {0}, ranked(0)[:shape.topk]
    while frontier and len(kept) < shape.num_nodes:
        node = min(frontier, key=rank.__getitem__)
        frontier.remove(node)
        kept.add(node)
        frontier += ranked(node)[:shape.topk]
    used = {token[c] for c in children[0].values() if c in kept}
    guesses = (t for t in dict.fromkeys(recent[::-1] + list(range(2 * shape.num_nodes))) if t not in used)
    fillers = list(range(len(token), len(token) + shape.num_nodes - len(kept)))  # the root's last children
    token += [next(guesses) for _ in fillers]
    order, parents, index = [0], [-1], {0: 0}
    for node in order:  # grows while read: breadth first
        trie = [c for c in ranked(node) if c in kept] if node < len(children) else []  # a filler has none
        for child in trie + (fillers if node == 0 else []):
            index[child] = len(order)
            order.append(child)
            parents.append(index[node])
    return DraftTree([token[n] for n in order], parents)


class NgramProposer(Proposer):
    """Chains (or trees) of prompt-lookup drafts (see the module's docstring), from the request's own tokens and,
    with a `History`, from finished requests' (for requests with no cache salt: a salted request, or one on a LoRA
    adapter, neither reads nor adds to it, as it shares no cached KV either)."""

    def __init__(self, min_match: int, max_match: int, history: Optional[History] = None):
        self.min_match, self.max_match = min_match, max_match
        self.history = history

    def num_slots(self, shape: Shape) -> int:
        return shape.num_nodes

    def _found(self, seq: Sequence, shape: Shape) -> list[tuple[int, list[int]]]:
        """The continuations a draft of this shape starts from, ranked (see `PromptLookup.continuations`): the
        request's own, and the history's where they match longer (the request's first among equals)."""
        if not isinstance(seq.draft_state, PromptLookup):
            seq.draft_state = PromptLookup(self.min_match, self.max_match)
        lookup, tokens = seq.draft_state, seq.token_ids
        key = (len(tokens), shape)
        if lookup.memo[0] != key:
            chain = shape.topk == 1
            k = shape.num_nodes - 1 if chain else shape.steps  # a chain's drafts, a tree's depth
            limit = 1 if chain else 2 * (shape.num_nodes - 1)
            found = lookup.continuations(tokens, k, limit)
            if self.history is not None and seq.cache_salt is None and (not found or found[0][0] < self.max_match):
                shared = self.history.continuations(tokens, k, limit)
                found = sorted(found + shared, key=lambda f: -f[0])[:limit]  # stable: the request's first
            lookup.memo = (key, found)
        return lookup.memo[1]

    def drafts(self, seq: Sequence, shape: Shape) -> bool:
        """Only a sequence whose suffix occurred before (in it or in the history) drafts."""
        return bool(self._found(seq, shape))

    def propose(self, seqs: list[Sequence], shape: Shape) -> list[DraftTree]:
        k = shape.num_nodes - 1
        trees = []
        for seq in seqs:
            found, root = self._found(seq, shape), seq.token_ids[-1]
            if shape.topk == 1:
                trees.append(DraftTree.chain(root, found[0][1] if found else [root] * k))
            else:
                trees.append(lookup_tree(root, [f[1] for f in found], shape, seq.token_ids[-RECENT:]))
        return trees

    def observe(self, aux: Optional[torch.Tensor], committed: list[tuple[Sequence, Union[range, list[int]]]],
                inputs=None) -> None:
        """Nothing to follow: drafts come from the tokens alone."""

    def info(self) -> dict:
        history = self.history
        return {"history_tokens": min(history.written, history.capacity) if history else 0,
                "history_capacity": history.capacity if history else 0}

    def retire(self, seqs: list[Sequence]) -> None:
        """Finished requests' tokens join the history (those of requests with no cache salt)."""
        if self.history is not None:
            for seq in seqs:
                if seq.cache_salt is None:
                    self.history.add(seq.token_ids)
