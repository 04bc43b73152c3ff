"""Draft shapes: what one verify looks like, and the batch-size buckets the controller decides per."""
from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):  # a tuple: hashed and compared in C, as dict keys read every step are
    steps: int
    topk: int
    num_nodes: int

    @property
    def k(self) -> int:
        """Draft tokens verified per request (0 = plain decoding)."""
        return self.num_nodes - 1 if self.steps else 0

    @property
    def label(self) -> str:
        """plain, chain-S or tree-N (N tokens verified per request, root included)."""
        if self.steps == 0:
            return "plain"
        return f"chain-{self.steps}" if self.topk == 1 else f"tree-{self.num_nodes}"


PLAIN = Shape(0, 1, 1)


def candidate_shapes(steps: int, topk: int, num_nodes: int) -> list[Shape]:
    chains = [Shape(s, 1, s + 1) for s in range(1, steps + 1)]
    return [PLAIN] + chains + ([Shape(steps, topk, num_nodes)] if topk > 1 else [])


def bucket(batch_size: int) -> int:
    """Batch sizes are grouped by powers of two: 1, 2, 4, 8, ..."""
    return 1 << max(0, batch_size - 1).bit_length()
