"""Import boundaries: `specserve bench` is a protocol client, so importing it must not import torch or the
engine; `specserve.config` is a leaf, so importing it imports neither torch nor the model code."""
from __future__ import annotations

import ast
import subprocess
import sys


def heavy_modules_after(code: str, packages: tuple[str, ...]) -> list[str]:
    """torch and the modules of `packages` that running `code` in a fresh interpreter imports."""
    report = f"\nimport sys\nprint([m for m in sys.modules if m == 'torch' or m.startswith({packages!r})])\n"
    out = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out)


def test_bench_imports_neither_torch_nor_the_engine():
    code = ("import pkgutil, importlib, specserve.bench as b\n"
            "for m in pkgutil.iter_modules(b.__path__): importlib.import_module('specserve.bench.' + m.name)\n")
    assert heavy_modules_after(code, ("specserve.engine", "specserve.models")) == []


def test_config_is_a_leaf(tmp_path):
    """Neither importing specserve.config nor resolving a config (against a described machine: the shipped
    pair's layout, CPU only) imports torch or the model code."""
    code = ("import specserve.config as c\n"
            f"folder = {str(tmp_path)!r}\n"
            "machine = c.Machine(default_model=folder, default_draft=folder, cuda_available=False,\n"
            "                    triton_available=lambda: False, max_positions=lambda path: 128)\n"
            "resolved = c.EngineConfig().resolve(machine)\n"
            "assert resolved.speculative.speculative_draft_model_path == folder, resolved\n"
            "assert (resolved.model.device, resolved.model.max_model_len) == ('cpu', 128), resolved\n")
    packages = ("specserve.models", "specserve.layers", "specserve.assets", "specserve.engine")
    assert heavy_modules_after(code, packages) == []


def test_public_names_still_import():
    from specserve import LLM, ConfigError, EngineConfig, RequestError, RequestOutput, SamplingParams  # noqa: F401
