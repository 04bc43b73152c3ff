"""Tensor-parallel state: which shard a layer holds and the group its collectives run over.

A layer reads the state current when it is built (`building(tp)` around a model's construction) and
keeps it, so its weight loaders and forward use the same rank and group; a model built outside
`building` (the draft head, every single-device run) is whole and its collectives are the identity.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` ranks, and the torch.distributed backend (gloo or NCCL) that
    joins them; size 1 needs no group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite x on every rank with rank src's x, in place."""
        if self.size > 1:
            options = torch.distributed.BroadcastOptions()
            options.rootRank = src
            self.group.broadcast([x], options).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` (which must divide evenly)."""
        if total % self.size:
            raise ValueError(f"dimension {total} does not divide over {self.size} tensor-parallel ranks")
        size = total // self.size
        return self.rank * size, (self.rank + 1) * size


WHOLE = TensorParallel()
_current = WHOLE


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Layers constructed inside this block are shards of `tp`."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


def current() -> TensorParallel:
    """The state a layer being constructed now belongs to."""
    return _current
