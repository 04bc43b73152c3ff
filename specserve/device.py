"""Host-to-device copies that do not wait for the device.

A copy from ordinary (pageable) host memory makes the CUDA stream finish its queued work first, so a
step prepared while the previous one runs would wait for it. Staging through pinned memory keeps the
copy asynchronous; the pinned block is recycled by PyTorch's caching host allocator once copied.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype) on device, without a stream synchronisation on CUDA."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class RowGather:
    """Rows of several tensors copied into one, with one indexed copy per source tensor."""

    def __init__(self):
        self._groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}

    def add(self, source: torch.Tensor, rows, dst) -> None:
        """source[rows] (a range or list of row indices) goes to out[dst] (as many row indices)."""
        _, src, to = self._groups.setdefault(id(source), (source, [], []))
        src.extend(rows)
        to.extend(dst)

    def into(self, out: torch.Tensor) -> torch.Tensor:
        """Copy every added row into out; returns out. Every source row is read before out is written."""
        reads = [(to_device(to, torch.long, out.device), source[to_device(src, torch.long, source.device)])
                 for source, src, to in self._groups.values()]
        for to, rows in reads:
            out[to] = rows
        return out
