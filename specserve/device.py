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


class Constants:
    """Read-only device tensors made once: code captured in a CUDA graph replays each torch.arange or
    torch.full it calls as a kernel, where a tensor made before the capture (in its warm-up run) costs nothing.
    Never write into one."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._made: dict[tuple, torch.Tensor] = {}

    def arange(self, start: int, end: int | None = None, step: int = 1, dtype: torch.dtype = torch.long
               ) -> torch.Tensor:
        """torch.arange(start, end, step) (or torch.arange(start) without end)."""
        start, end = (0, start) if end is None else (start, end)
        return self._get(("arange", start, end, step, dtype), lambda: torch.arange(start, end, step, dtype=dtype,
                                                                                   device=self.device))

    def full(self, size: tuple[int, ...], value, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self._get(("full", tuple(size), value, dtype), lambda: torch.full(size, value, dtype=dtype,
                                                                                 device=self.device))

    def _get(self, key: tuple, make) -> torch.Tensor:
        if key not in self._made:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"constant {key} first asked for inside a CUDA graph capture: make it in the "
                                   "warm-up run (a captured fill would only run at replay)")
            self._made[key] = make()
        return self._made[key]
