"""LoRA adapters on the linear layers: y = x W^T + scale * (x A^T) B^T for the rows of the requests that use
an adapter.

Every adapter has a slot (1 .. max_loras; 0 is the base model). A layer that adapters may target holds a
`LoRAStack`, allocated once with room for every slot at the largest rank, so loading an adapter writes into it
and moves nothing: CUDA graphs captured over the stack serve whatever is loaded later. For a fused projection
(q/k/v, gate/up) a slot's A stacks the targeted parts' A matrices and its B places each part's B in its rows, so
one pair of products serves the whole layer. Under tensor parallelism the matrices are sharded as the layer's
weight is: B by rows in a column-parallel layer (A whole), A by columns in a row-parallel one (B whole, the delta
added before the all-reduce, which sums it as it sums the products).

A step's rows go through every slot at once (two products of width slots x rank) and a mask keeps each row's
own slot: the shapes are the step's alone, which a graph needs, and at decode sizes a gather and a scatter of
the rows cost more than the products they save (session 44). The model runner states which rows use which slot
for the duration of a forward (`applied`); layers read it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch


class LoRAStack:
    """A layer's adapters, a region per slot at fixed addresses; unused regions are zero."""

    def __init__(self, slots: int, width: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device):
        """width: a slot's rank room (the largest rank times the layer's fused parts)."""
        self.slots, self.width = slots, width
        self.a = torch.zeros(slots * width, in_features, dtype=dtype, device=device)  # [slots * width, in]
        self.bt = torch.zeros(slots * width, out_features, dtype=dtype, device=device)  # [slots * width, out]: B^T

    def region(self, slot: int) -> slice:
        return slice((slot - 1) * self.width, slot * self.width)

    def put(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter matrices a [rank, in] and b [out, rank] (its scale included) as `slot`."""
        rank = a.shape[0]
        if rank > self.width:
            raise ValueError(f"rank {rank} does not fit the {self.width} reserved per adapter (max_lora_rank)")
        self.clear(slot)
        start = self.region(slot).start
        self.a[start:start + rank] = a
        self.bt[start:start + rank] = b.T

    def clear(self, slot: int) -> None:
        self.a[self.region(slot)].zero_()
        self.bt[self.region(slot)].zero_()

    def delta(self, x: torch.Tensor, batch: "LoRABatch", y: torch.Tensor) -> torch.Tensor:
        """y [n, out] plus each row's adapter delta, x [n, in]."""
        if batch.single is not None:  # every row on one adapter: its region alone
            region = self.region(batch.single)
            return torch.addmm(y, x @ self.a[region].T, self.bt[region])
        n = x.shape[0]
        h = (x @ self.a.T).view(n, self.slots, self.width)  # [n, slots, width]
        h = torch.where(batch.mask.unsqueeze(-1), h, 0)  # (a where: no NaN from other slots' rows)
        return torch.addmm(y, h.view(n, -1), self.bt)


@dataclass
class LoRABatch:
    """Which adapter slot each row of a forward uses: mask [num_tokens, slots], true at its slot (none: base);
    single: the slot of every row, when they share one (eager steps: the layers compute that slot alone)."""

    mask: Optional[torch.Tensor]
    single: Optional[int] = None


_active: Optional[LoRABatch] = None


@contextlib.contextmanager
def applied(batch: Optional[LoRABatch]) -> Iterator[None]:
    """Layers add the adapters of `batch` to their outputs inside this block (None: none)."""
    global _active
    previous, _active = _active, batch
    try:
        yield
    finally:
        _active = previous


def active() -> bool:
    """Whether the forward running now has rows that use an adapter."""
    return _active is not None


def add_lora(stack: Optional[LoRAStack], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [n, out] (x [n, in] through the layer's weight) plus, on each adapter's rows, its delta."""
    if _active is None or stack is None:
        return y
    return stack.delta(x, _active, y)


def slot_mask(token_slots: torch.Tensor, slots: int) -> torch.Tensor:
    """token_slots [n] (0: base) as the mask [n, slots] of `LoRABatch`."""
    return token_slots.unsqueeze(1) == torch.arange(1, slots + 1, device=token_slots.device)


def token_slots(slots: list[int], q_lens: list[int]) -> np.ndarray:
    """Per token of a step, the slot of its sequence: slots and q_lens per sequence."""
    return np.repeat(np.asarray(slots, dtype=np.int64), q_lens)


def batch_of(slots: list[int], q_lens: list[int], max_slots: int, device: torch.device) -> Optional[LoRABatch]:
    """The LoRABatch of a step whose sequences use these slots (0: none) for q_lens tokens each; None when none
    uses an adapter."""
    if not any(slots):
        return None
    if len(set(slots)) == 1:
        return LoRABatch(None, slots[0])
    return LoRABatch(slot_mask(torch.from_numpy(token_slots(slots, q_lens)).to(device), max_slots))
