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
