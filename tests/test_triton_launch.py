"""Programmatic dependent launch (layers/triton_launch): a kernel launched early must wait before it touches
memory, so every kernel that takes PDL waits on its first line, and every launch goes through launch_kernel."""
import ast
import pathlib
from types import SimpleNamespace

import pytest
import torch

from specserve.layers import triton_launch

LAYERS = pathlib.Path(triton_launch.__file__).parent
MODULES = sorted(p for p in LAYERS.glob("triton_*.py") if p.name != "triton_launch.py")


def _kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    jitted = {}
    for node in ast.walk(tree):
        jit = isinstance(node, ast.FunctionDef) and any(ast.unparse(d).startswith("triton.jit")
                                                         for d in node.decorator_list)
        if jit:
            jitted[node.name] = node
    return jitted


def _launches(tree: ast.Module) -> list[ast.Call]:
    """Calls of the form launch_kernel(kernel, grid, ...)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "launch_kernel"]


def _direct_launches(tree: ast.Module, names) -> list[ast.Call]:
    """Calls of the form kernel[grid](...), which would bypass launch_kernel."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names]


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_every_launched_kernel_waits_first_and_every_launch_goes_through_launch_kernel(module):
    tree = ast.parse(module.read_text())
    kernels = _kernels(tree)
    assert not _direct_launches(tree, kernels), f"{module.name}: a kernel launched without launch_kernel"
    for call in _launches(tree):
        name = ast.unparse(call.args[0])
        fn = kernels[name]
        assert "PDL" in [a.arg for a in fn.args.args], f"{module.name}: {name} takes no PDL"
        first = fn.body[0]
        assert ast.unparse(first) == "wait_for_previous(PDL)", f"{module.name}: {name} starts with {ast.unparse(first)}"


def test_the_modules_launch_kernels_at_all():
    """The structural test above would pass vacuously if no launch were found."""
    assert sum(len(_launches(ast.parse(p.read_text()))) for p in MODULES) >= 15


class _Kernel:
    """Stands in for a Triton kernel: kernel[grid](*args, **options) returns what it was given."""

    def __getitem__(self, grid):
        return lambda *args, **options: (grid, args, options)


def test_cpu_tensors_launch_without_it():
    x = torch.zeros(1)
    assert triton_launch.launch_kernel(_Kernel(), (3,), 7, x, BLOCK=4) == ((3,), (7, x), {"BLOCK": 4, "PDL": 0})


def test_resident_programs_worked_examples():
    """CUDA's occupancy rules on an H100 / H200 multiprocessor: 64K registers, 2,048 threads, 228 KiB shared."""
    h200 = SimpleNamespace(max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)
    programs = triton_launch.resident_programs
    assert programs(128, 32, 24 * 1024, h200) == 9  # shared: 228 KiB / 25 KiB
    assert programs(128, 32, 0, h200) == 16  # threads: 2,048 / 128
    assert programs(128, 255, 0, h200) == 2  # registers: 255 -> 256 a thread, 8,192 a warp, 8 warps
    assert programs(128, 168, 0, h200) == 3  # 168 a thread -> 5,376 a warp (21 x 256): 12 warps
    assert programs(32, 16, 0, h200) == 32  # at most 32 programs
    assert programs(256, 64, 96 * 1024, h200) == 2  # 97 KiB each
