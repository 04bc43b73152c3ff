"""Triton kernel launches compiled for Hopper (sm_90) on a machine without a GPU, instead of run.

`install(report)` swaps Triton's active driver for one that names an sm_90 CUDA target and turns every
`kernel[grid](...)` into `kernel.warmup(...)`: the kernel is specialised on its arguments' dtypes and alignments,
compiled through ptxas as a GPU launch would compile it, and not run (outputs stay as allocated, so the tests'
checks are switched off: `torch.testing.assert_close` here, `assert` by running Python with -O). Launches that
take a programmatic-dependent-launch mode compile with mode 3, as `triton_launch` launches them on a GPU.
At exit `report` (JSON) lists each kernel's compiles and each compile failure. `tests/test_triton_compile.py`
drives the kernel tests this way, so CI catches what only a GPU run caught before (session 51: a loop-carried
scalar that became a vector passed the interpreter and failed to compile on the H100).
"""
from __future__ import annotations

import atexit
import json
import traceback


class HopperDriver:
    """What `JITFunction.warmup` asks of Triton's driver: an sm_90 CUDA target on device 0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def install(report: str) -> None:
    """Compile for sm_90 instead of launching, from now on in this process; write `report` at exit."""
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: dict[str, int] = {}
    failures: list[dict] = []

    def compile_only(self, grid):
        def launch(*args, **options):
            options.pop("launch_pdl", None)
            if "PDL" in options:
                options["PDL"] = 3
            try:
                kernel = self.warmup(*args, grid=grid, **options)
            except Exception as e:
                chain = "".join(traceback.format_exception(e, limit=-2))  # the compiler's message is a cause
                failures.append({"kernel": self.fn.__name__, "error": f"{type(e).__name__}: {e}",
                                 "trace": chain[-4000:]})
                raise
            compiled[self.fn.__name__] = compiled.get(self.fn.__name__, 0) + 1
            return kernel
        return launch

    def write() -> None:
        with open(report, "w") as f:
            json.dump({"compiled": compiled, "failures": failures}, f, indent=1)

    driver.set_active(HopperDriver())
    JITFunction.__getitem__ = compile_only
    torch.testing.assert_close = lambda *args, **kwargs: None  # outputs are not computed (run with python -O too)
    atexit.register(write)
