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

from array import array

import numpy as np

SEPARATOR = -1  # after each request's tokens in the ring


class History:
    def __init__(self, capacity: int, max_match: int, buckets: int = 1 << 16, ways: int = 8):
        """capacity: tokens kept (separators included); max_match: the longest suffix compared."""
        self.capacity, self.max_match, self.buckets, self.ways = capacity, max_match, buckets, ways
        # Python arrays for a lookup's few reads (an item of one costs far less than one of numpy's), numpy views
        # of the same memory for an addition's many writes
        self.ring = array("q", [SEPARATOR]) * capacity  # [capacity] the token at position p % capacity
        self.table = array("q", [-1]) * (buckets * ways)  # [buckets * ways] positions just past a pair (-1: none)
        self._ring, self._table = np.frombuffer(self.ring, dtype=np.int64), np.frombuffer(self.table, dtype=np.int64)
        self.written = 0  # positions written so far: the ring holds [written - capacity, written)

    def _row(self, first, second):
        """The table row of a pair of tokens (ints or arrays of them)."""
        return (first * 1_000_003 + second) % self.buckets

    def add(self, tokens: list[int]) -> None:
        """Keep a finished request's tokens (the latest `capacity` - 1 of them when it has more)."""
        ids = np.asarray(tokens[-(self.capacity - 1):] + [SEPARATOR], dtype=np.int64)  # [n]
        positions = self.written + np.arange(ids.size)  # [n]
        self._ring[positions % self.capacity] = ids
        ends = positions[2:-1]  # just past each pair of the request's tokens (the last pair ends at the separator)
        self._table[self._row(ids[:-3], ids[1:-2]) * self.ways + ends % self.ways] = ends
        self.written += ids.size

    def continuations(self, tokens: list[int], k: int, limit: int) -> list[tuple[int, list[int]]]:
        """Up to `limit` earlier occurrences of a suffix of 2 to max_match of tokens, the longest first and the
        latest first among equals: (tokens matched, the k tokens after it)."""
        if len(tokens) < 2 or not self.written:
            return []
        ring, cap, first, last = self.ring, self.capacity, tokens[-2], tokens[-1]
        oldest = max(0, self.written - cap)
        start = self._row(first, last) * self.ways
        found = []
        for end in self.table[start:start + self.ways]:
            if end - 2 < oldest or end + k > self.written or ring[(end - 1) % cap] != last \
                    or ring[(end - 2) % cap] != first:
                continue
            after = [ring[(end + i) % cap] for i in range(k)]
            if SEPARATOR in after:  # its request ends sooner
                continue
            length = 2
            while length < min(self.max_match, len(tokens)) and end - 1 - length >= oldest \
                    and ring[(end - 1 - length) % cap] == tokens[-1 - length]:
                length += 1
            found.append((length, end, after))
        found.sort(key=lambda f: (-f[0], -f[1]))
        return [(length, after) for length, _, after in found[:limit]]
