"""Every Triton kernel compiles for Hopper (sm_90) on this CPU machine, as a GPU run would compile it.

The kernel tests run in child pytests with `--compile-for-hopper` (tests/hopper_compile.py): each launch is
specialised on its real arguments and compiled through ptxas for sm_90, nothing runs, and the tests' own checks
are off (python -O, plain asserts). The children start when the suite is collected and compile at the lowest CPU
priority while the other tests run (`CompileRun`); this test waits for them. Their reports are the oracle: no
compile may fail, and every kernel in specserve.layers must have been compiled at least once. Without it a kernel
that the interpreter accepts can still fail on the GPU (session 51: a loop-carried scalar that became a vector).
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest

from .conftest import COMPILE_CHECK, compile_check_runs
from .hopper_compile import KERNEL_TESTS


def triton_kernels() -> set[str]:
    """Names of the launched Triton kernels in specserve.layers: JIT functions that read their program id (the
    rest are helpers inlined into them)."""
    from triton.runtime.jit import JITFunction

    import specserve.layers as layers

    names = set()
    for info in pkgutil.iter_modules(layers.__path__):
        module = importlib.import_module(f"specserve.layers.{info.name}")
        names.update(v.fn.__name__ for v in vars(module).values()
                     if isinstance(v, JITFunction) and "program_id" in v.src)
    return names


@pytest.mark.skipif(not compile_check_runs(),
                    reason="a CPU run with Triton installed (on CUDA the kernel tests compile and run them)")
def test_every_triton_kernel_compiles_for_hopper():
    compiled, failures = COMPILE_CHECK["run"].results(timeout=1200)  # started at collection (conftest)
    assert not failures, "kernels that do not compile for sm_90 (the compiler's own output: python -O -m pytest " \
        "--assert=plain --compile-for-hopper report.json <test file>):\n" + "\n\n".join(
            f"{f['kernel']}: {f['error']}\n{f['trace']}" for f in failures)
    missing = triton_kernels() - compiled
    assert not missing, f"kernels no test in {KERNEL_TESTS} launches: {sorted(missing)}"
