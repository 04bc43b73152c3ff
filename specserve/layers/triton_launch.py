"""Programmatic dependent launch for every Triton kernel of the engine (Hopper and newer GPUs).

A kernel launched with it may start while the kernel ahead of it in the stream is still running. Its programs
wait at their first line (`wait_for_previous`) until that kernel has finished and its writes are visible, so no
kernel reads what the one ahead has not finished writing, nor writes what it still reads. What is saved is
each launch's start-up, which a one-row decode step pays a few hundred times. The CUDA graphs capture the
launches with these dependencies.

When the next kernel may launch is the kernel's choice (`MODE`):
- 1, as soon as the wait ends: Qwen3-30B-A3B at batch 1 +11%, but the 8B shape -3% at batch 1 and -9% at 16.
  The likely cause (not measured apart): a kernel of several waves (the 8B gate/up GEMV: 3,584 programs) then
  shares its multiprocessors with the next kernel's programs, which sit waiting.
- 3 (the default), after the main loop (`let_next_launch`, placed in the kernels that stream weights or keys),
  else when the programs exit: every program of the kernel has started by then. 30B-A3B +5% at batch 1, the 8B
  shape +2% / +1% at batch 1 / 16, none of these slower (30B-A3B at batch 8: 0%).
- 2, at exit only: 30B-A3B +2% at batch 1, the 8B shape within 0.5%.
(H200, `python benchmarks/gpu_decode.py --pdl M`, docs/performance.md session 33.)
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernel is launched
    triton = None
    wait_for_previous = let_next_launch = None

MODE = 3  # 0: off; the next kernel launches 1: after the wait, 2: at exit, 3: at let_next_launch


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def pdl(x: torch.Tensor) -> dict:
    """The launch options of a kernel whose tensors live where x does: `PDL` for `wait_for_previous`, and the
    launch attribute where the device has it."""
    if MODE and triton is not None and x.is_cuda and _supported(x.device):
        return {"PDL": MODE, "launch_pdl": True}
    return {"PDL": 0}


if triton is not None:
    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """The first line of every kernel: wait for the kernel ahead (mode 1: then let the next one launch)."""
        if PDL > 0:
            tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def let_next_launch(PDL: tl.constexpr):
        """After a kernel's main loop (mode 3): the next kernel may launch once every program has come here."""
        if PDL == 3:
            tl.extra.cuda.gdc_launch_dependents()
