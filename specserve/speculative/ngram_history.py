"""What finished requests said, for prompt lookups across requests (NGRAM's shared history).

The tokens of finished requests (prompt and output, each followed by a separator) are kept in a ring of the
latest `capacity` tokens. Where each pair of consecutive tokens occurred is indexed in a table of `buckets`
rows (a pair's hash picks the row) and `ways` columns (an occurrence's position picks the column): a newer
occurrence overwrites the one `ways` positions before it in its row, so a row keeps recent occurrences of its
pairs, and a lookup checks the candidates' tokens, as two pairs may share a row. Lookups start from the last two
tokens of a request and extend each candidate backwards like `PromptLookup`; a continuation stops at the end
of the request it came from (a candidate with fewer than k tokens after it is dropped).
"""
from __future__ import annotations

import numpy as np

SEPARATOR = -1  # after each request's tokens in the ring


class History:
    def __init__(self, capacity: int, max_match: int, buckets: int = 1 << 16, ways: int = 8):
        """capacity: tokens kept (separators included); max_match: the longest suffix compared."""
        self.capacity, self.max_match, self.ways = capacity, max_match, ways
        self.ring = np.full(capacity, SEPARATOR, dtype=np.int64)  # [capacity] token at position p % capacity
        self.written = 0  # positions written so far: the ring holds [written - capacity, written)
        # [buckets, ways] positions just past a pair's occurrence (-1: none)
        self.table = np.full((buckets, ways), -1, dtype=np.int64)

    def _rows(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        return (first * 1_000_003 + second) % self.table.shape[0]

    def add(self, tokens: list[int]) -> None:
        """Keep a finished request's tokens (the latest `capacity` - 1 of them when it has more)."""
        ids = np.asarray(tokens[-(self.capacity - 1):] + [SEPARATOR], dtype=np.int64)  # [n]
        positions = self.written + np.arange(ids.size)  # [n]
        self.ring[positions % self.capacity] = ids
        ends = positions[2:-1]  # just past each pair of the request's tokens (the last pair ends at the separator)
        self.table[self._rows(ids[:-3], ids[1:-2]), ends % self.ways] = ends
        self.written += ids.size

    def continuations(self, tokens: list[int], k: int, limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` earlier occurrences of a suffix of 2 to max_match of tokens, the longest first and the
        latest first among equals: (tokens matched, the k tokens after it)."""
        if len(tokens) < 2 or not self.written:
            return []
        oldest = max(0, self.written - self.capacity)
        ends = self.table[self._rows(np.int64(tokens[-2]), np.int64(tokens[-1]))]  # [ways]
        ends = ends[(ends - 2 >= oldest) & (ends + k <= self.written)]
        ring, cap = self.ring, self.capacity
        ends = ends[(ring[(ends - 1) % cap] == tokens[-1]) & (ring[(ends - 2) % cap] == tokens[-2])]
        after = ring[(ends[:, None] + np.arange(k)) % cap]  # [C, k]
        keep = (after != SEPARATOR).all(1)
        ends, after = ends[keep], after[keep]
        length = np.full(ends.size, 2, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(2, min(self.max_match, len(tokens))):
            before = ends - 1 - back
            alive &= (before >= oldest) & (ring[before % cap] == tokens[-1 - back])
            length += alive
        order = np.lexsort((-ends, -length))[:limit]
        return [(int(length[i]), after[i].tolist()) for i in order]
