"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, free-block accounting.

The block manager owns no tensors; the model runner's KV tensors are indexed by the block ids it hands
out. A sequence's slot for token i is `block_table[i // block_size] * block_size + i % block_size`.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the cache holds seq's computed tokens plus num_new_tokens more."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Reserve slots for num_new_tokens tokens after seq's computed ones."""
        needed = self.new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"{seq.request_id} needs {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep slots for the first num_tokens tokens only; release the blocks past them."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released twice"
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
