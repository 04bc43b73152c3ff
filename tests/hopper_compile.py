"""Triton kernel launches compiled for Hopper (sm_90) on a machine without a GPU, instead of run.

`install(report)` swaps Triton's active driver for one that names an sm_90 CUDA target and turns every
`kernel[grid](...)` into `kernel.warmup(...)`: the kernel is specialised on its arguments' dtypes and alignments,
compiled through ptxas as a GPU launch would compile it, and not run (outputs stay as allocated, so the tests'
checks are switched off: `torch.testing.assert_close` here, `assert` by running Python with -O). Launches that
take a programmatic-dependent-launch mode compile with mode 3, as `triton_launch` launches them on a GPU.
A launch compiles once per kernel, constexpr values, tensor dtypes and launch options (`variant`); launches that
differ only in Triton's integer and alignment specialisations reuse it, which keeps CI's cold compile short.
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


def variant(kernel, args: tuple, options: dict) -> tuple:
    """What a compile for sm_90 is checked once for: the kernel, its constexpr values, its tensors' dtypes and its
    launch options (not the divisibility and alignment Triton also specialises on)."""
    import torch

    bound = kernel.signature.bind(*args, **{k: v for k, v in options.items() if k in kernel.signature.parameters})
    params = {p.name: p for p in kernel.params}
    key = []
    for name, value in bound.arguments.items():
        if params[name].is_constexpr:
            key.append((name, repr(value)))
        elif isinstance(value, torch.Tensor):
            key.append((name, str(value.dtype)))
        else:
            key.append((name, type(value).__name__))
    rest = sorted((k, repr(v)) for k, v in options.items() if k not in kernel.signature.parameters)
    return kernel.fn.__name__, tuple(key), tuple(rest)


def install(report: str) -> None:
    """Compile for sm_90 instead of launching, from now on in this process; write `report` at exit."""
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: dict[str, int] = {}
    failures: list[dict] = []
    done: dict[tuple, object] = {}  # variant -> its compiled kernel

    def compile_only(self, grid):
        def launch(*args, **options):
            options.pop("launch_pdl", None)
            if "PDL" in options:
                options["PDL"] = 3
            key = variant(self, args, options)
            if key in done:
                return done[key]
            try:
                kernel = self.warmup(*args, grid=grid, **options)
            except Exception as e:
                chain = "".join(traceback.format_exception(e, limit=-2))  # the compiler's message is a cause
                failures.append({"kernel": self.fn.__name__, "error": f"{type(e).__name__}: {e}",
                                 "trace": chain[-4000:]})
                raise
            compiled[self.fn.__name__] = compiled.get(self.fn.__name__, 0) + 1
            done[key] = kernel
            return kernel
        return launch

    def write() -> None:
        with open(report, "w") as f:
            json.dump({"compiled": compiled, "failures": failures}, f, indent=1)

    driver.set_active(HopperDriver())
    JITFunction.__getitem__ = compile_only
    torch.testing.assert_close = lambda *args, **kwargs: None  # outputs are not computed (run with python -O too)
    atexit.register(write)
