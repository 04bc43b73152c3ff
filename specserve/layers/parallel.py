"""Tensor-parallel state: this process's rank and the collectives the layers use.

At world size 1 every collective is the identity, so single-device runs pay nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's x along the last dimension."""
    world = tp_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total` (which must divide evenly)."""
    rank = tp_rank() if rank is None else rank
    world = tp_size() if world is None else world
    if total % world:
        raise ValueError(f"dimension {total} does not divide over {world} tensor-parallel ranks")
    size = total // world
    return rank * size, (rank + 1) * size
