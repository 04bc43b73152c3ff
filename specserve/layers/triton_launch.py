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
- 4, as 3 but a kernel whose whole grid the multiprocessors hold at once (`resident_programs`, from the compiled
  kernel's registers and shared memory) takes 1: the next kernel's waiting programs then take no room its own
  programs still need. Qwen3-30B-A3B +4.6% / +3.8% / +0.4% at batch 1 / 2 / 8, but the 8B shape -1.2% / -2.3% /
  -1.8% at batch 1 / 8 / 16 (256 keys) and -3% at batch 16, 4k keys; not the default (session 35). By a count of
  programs alone (up to 16 a multiprocessor) the 8B shape at batch 16 lost 17%.
(H200, `python benchmarks/gpu_decode.py --pdl M`, docs/performance.md sessions 33 and 35.)
"""
from __future__ import annotations

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no kernel is launched
    triton = None
    wait_for_previous = let_next_launch = None

MODE = 3  # 0: off; the next kernel launches 1: after the wait, 2: at exit, 3: at let_next_launch, 4: 1 or 3
_RESIDENT: dict = {}  # (kernel, its keyword arguments) -> programs a multiprocessor holds at once


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


@functools.cache
def _properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


def sm_count(device) -> int:
    """Multiprocessors of a CUDA device; 132 (an H100 / H200) elsewhere."""
    device = torch.device(device)
    return _properties(device).multi_processor_count if device.type == "cuda" else 132


def resident_programs(threads: int, registers: int, shared: int, props) -> int:
    """Programs of `threads` threads, `registers` registers a thread and `shared` bytes of shared memory that one
    multiprocessor holds at once, by CUDA's occupancy rules (registers allocated 256 a warp, 1 KiB of shared memory
    reserved a program, at most 32 programs); props: torch.cuda.get_device_properties of the device."""
    warps = -(-threads // 32)
    warp_registers = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // warp_registers // warps  # 64K since Kepler
    by_threads = props.max_threads_per_multi_processor // threads
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32
    return min(32, by_registers, by_threads, by_shared)


def launch_kernel(kernel, grid: tuple[int, ...], *args, **options):
    """kernel[grid](*args, **options) with its `PDL` argument: programmatic dependent launch where the first tensor
    argument's device has it (MODE); in mode 4 the early launch (mode 1) for a grid the multiprocessors hold all at
    once, known from the kernel's registers and shared memory once it has been compiled, else mode 3."""
    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    if not (MODE and triton is not None and device.type == "cuda" and _supported(device)):
        return kernel[grid](*args, **options, PDL=0)
    if MODE != 4:
        return kernel[grid](*args, **options, PDL=MODE, launch_pdl=True)
    key = (kernel, tuple(options.items()))
    resident = _RESIDENT.get(key)
    early = resident is not None and math.prod(grid) <= resident * sm_count(device)
    compiled = kernel[grid](*args, **options, PDL=1 if early else 3, launch_pdl=True)
    if resident is None:
        _RESIDENT[key] = resident_programs(compiled.metadata.num_warps * 32, compiled.n_regs,
                                           compiled.metadata.shared, _properties(device))
    return compiled


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
