"""Every Triton kernel compiles for Hopper (sm_90) on this CPU machine, as a GPU run would compile it.

The kernel tests run in a child pytest with `--compile-for-hopper` (tests/hopper_compile.py): each launch is
specialised on its real arguments and compiled through ptxas for sm_90, nothing runs, and the tests' own checks
are off (python -O, plain asserts). The child's report is the oracle: no compile may fail, and every kernel in
specserve.layers must have been compiled at least once. Without it a kernel that the interpreter accepts can
still fail on the GPU (session 51: a loop-carried scalar that became a vector).
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

from .conftest import COMPILE_ONLY, DEVICE, INTERPRET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_TESTS = ("tests/test_triton_kernels.py", "tests/test_triton_moe.py")
SHARDS = 2  # child processes: CI's machine has two cores


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


def _triton():
    from specserve.layers.triton_ops import triton

    return triton


@pytest.mark.skipif(_triton() is None or DEVICE["name"] != "cpu" or INTERPRET or COMPILE_ONLY["report"] is not None,
                    reason="a CPU run with Triton installed (on CUDA the kernel tests compile and run them)")
def test_every_triton_kernel_compiles_for_hopper(tmp_path):
    children = []  # SHARDS child pytests side by side, each with a share of the tests (compiles are single-threaded)
    for i in range(SHARDS):
        report = tmp_path / f"compile{i}.json"
        command = [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--assert=plain",
                   "--compile-for-hopper", str(report), "--compile-shard", f"{i}/{SHARDS}", *KERNEL_TESTS]
        children.append((report, subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True)))
    compiled, failures = set(), []
    for report, child in children:
        output = child.communicate(timeout=1200)[0]
        assert report.exists(), f"the child pytest wrote no report:\n{output[-4000:]}"
        got = json.loads(report.read_text())
        compiled.update(got["compiled"])
        failures += got["failures"]
    assert not failures, "kernels that do not compile for sm_90 (the compiler's own output: python -O -m pytest " \
        "--assert=plain --compile-for-hopper report.json <test file>):\n" + "\n\n".join(
            f"{f['kernel']}: {f['error']}\n{f['trace']}" for f in failures)
    missing = triton_kernels() - compiled
    assert not missing, f"kernels no test in {KERNEL_TESTS} launches: {sorted(missing)}"
