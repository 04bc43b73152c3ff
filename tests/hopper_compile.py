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
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_TESTS = ("tests/test_triton_kernels.py", "tests/test_triton_moe.py")
SHARDS = 2  # child processes: CI's machine has two cores
# each child's process group (its ptxas runs included), not a session: a new session is a new scheduler autogroup on
# Linux, which gets an equal share of the CPU whatever its nice value (Python 3.10 has no process_group: no group)
GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {}


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


class CompileRun:
    """The compile check's child pytests: SHARDS of them side by side, each compiling its share of KERNEL_TESTS
    (`--compile-shard`). They run at the lowest CPU priority (nice 19), so that, started when the suite's tests
    are collected (conftest), they take only the CPU time the other tests leave idle (servers starting, clients
    waiting) and leave those tests' timings alone. `results` waits for them; `close` ends any still running."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="hopper-compile-")
        self.children: list[tuple[str, str, subprocess.Popen]] = []  # (report, log, child)
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        for i in range(SHARDS):
            report, log = (os.path.join(self.dir, f"compile{i}.{ext}") for ext in ("json", "log"))
            command = [*nice, sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--assert=plain",
                       "--compile-for-hopper", report, "--compile-shard", f"{i}/{SHARDS}", *KERNEL_TESTS]
            with open(log, "w") as out:
                child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, **GROUP)
            self.children.append((report, log, child))

    def results(self, timeout: float) -> tuple[set[str], list[dict]]:
        """The kernels compiled and the compile failures of all children, once they have exited."""
        compiled, failures = set(), []
        for report, log, child in self.children:
            child.wait(timeout=timeout)
            if not os.path.exists(report):
                with open(log) as f:
                    raise AssertionError(f"the child pytest wrote no report:\n{f.read()[-4000:]}")
            with open(report) as f:
                got = json.load(f)
            compiled.update(got["compiled"])
            failures += got["failures"]
        return compiled, failures

    def close(self) -> None:
        for _, _, child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL) if GROUP else child.kill()
                child.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
