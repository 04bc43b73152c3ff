"""Programmatic dependent launch (layers/triton_launch): a kernel launched early must wait before it touches
memory, so every kernel that takes PDL waits on its first line, and every launch passes it."""
import ast
import pathlib

import pytest
import torch

from specserve.layers import triton_launch

LAYERS = pathlib.Path(triton_launch.__file__).parent
MODULES = sorted(p for p in LAYERS.glob("triton_*.py") if p.name != "triton_launch.py")


def _kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    jitted = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
            jitted[node.name] = node
    return jitted


def _launches(tree: ast.Module, names) -> list[ast.Call]:
    """Calls of the form kernel[grid](...)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names]


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_every_launched_kernel_waits_first_and_every_launch_passes_pdl(module):
    tree = ast.parse(module.read_text())
    kernels = _kernels(tree)
    launches = _launches(tree, kernels)
    launched = {call.func.value.id for call in launches}
    for name in launched:
        fn = kernels[name]
        assert "PDL" in [a.arg for a in fn.args.args], f"{module.name}: {name} takes no PDL"
        first = fn.body[0]
        assert ast.unparse(first) == "wait_for_previous(PDL)", f"{module.name}: {name} starts with {ast.unparse(first)}"
    for call in launches:
        assert any(k.arg is None and ast.unparse(k.value).startswith("pdl(") for k in call.keywords), (
            f"{module.name}: a launch of {call.func.value.id} without **pdl(...)")


def test_the_modules_launch_kernels_at_all():
    """The structural test above would pass vacuously if no launch were found."""
    found = sum(len(_launches(tree, _kernels(tree))) for tree in (ast.parse(p.read_text()) for p in MODULES))
    assert found >= 15


def test_cpu_tensors_launch_without_it():
    assert triton_launch.pdl(torch.zeros(1)) == {"PDL": 0}
