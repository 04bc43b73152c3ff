"""`specserve bench` is a protocol client: importing it must not import torch or the engine."""
from __future__ import annotations

import subprocess
import sys


def test_bench_imports_neither_torch_nor_the_engine():
    code = ("import sys, pkgutil, importlib, specserve.bench as b\n"
            "for m in pkgutil.iter_modules(b.__path__): importlib.import_module('specserve.bench.' + m.name)\n"
            "heavy = [m for m in sys.modules\n"
            "         if m == 'torch' or m.startswith(('specserve.engine', 'specserve.models'))]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_public_names_still_import():
    from specserve import LLM, ConfigError, EngineConfig, RequestError, RequestOutput, SamplingParams  # noqa: F401
