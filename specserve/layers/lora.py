"""LoRA adapters on the linear layers: y = x W^T + scale * (x A^T) B^T for the rows of the requests that use
an adapter.

Every adapter has a slot (1, 2, ...; 0 is the base model). A layer an adapter targets keeps, per slot, one A and
one B (`LoRAWeights`): for a fused projection (q/k/v, gate/up) A stacks the targeted parts' A matrices and B
places each part's B in its rows, so one pair of products serves the whole layer. Under tensor parallelism the
matrices are sharded as the layer's weight is: B by rows in a column-parallel layer (A whole), A by columns in a
row-parallel one (B whole, the delta added before the all-reduce, which sums it as it sums the products).

The model runner states which rows use which slot for the duration of a forward (`applied`); layers read it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], the adapter's scale included


@dataclass
class LoRABatch:
    """The rows of a step that use each adapter: (slot, a mask [num_tokens, 1], true on its rows; None: every
    row)."""

    groups: list[tuple[int, Optional[torch.Tensor]]]


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


def add_lora(loras: dict[int, LoRAWeights], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [n, out] (x [n, in] through the layer's weight) plus, on each adapter's rows, its delta. Every row goes
    through each adapter of the step and a mask keeps its own (the rank-r middle is what is masked): a gather
    and a scatter of the rows cost more than the products they save at decode sizes (session 44)."""
    if _active is None or not loras:
        return y
    for slot, mask in _active.groups:
        w = loras.get(slot)
        if w is None:
            continue
        h = x @ w.a.T  # [n, rank]
        y = y + (h if mask is None else torch.where(mask, h, 0)) @ w.b.T  # (a where: no NaN from other rows)
    return y


def batch_of(slots: list[int], q_lens: list[int], device: torch.device) -> Optional[LoRABatch]:
    """The LoRABatch of a step whose sequences use these slots (0: none) for q_lens tokens each; None when none
    uses an adapter."""
    if not any(slots):
        return None
    if len(set(slots)) == 1:
        return LoRABatch([(slots[0], None)])
    per_token = torch.tensor(slots).repeat_interleave(torch.tensor(q_lens))  # [num_tokens]
    groups = [(slot, (per_token == slot).unsqueeze(1).to(device)) for slot in sorted(set(slots) - {0})]
    return LoRABatch(groups)
