"""specserve: LLM serving built around speculative decoding that never loses to plain decoding.

The public names load on first use, so `import specserve.bench` (a protocol client) does not import
torch or the engine."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": ".llm",
    "SamplingParams": ".sampling_params",
    "StructuredOutputsParams": ".sampling_params",
    "EngineConfig": ".config",
    "ConfigError": ".config",
    "RequestError": ".engine.outputs",
    "RequestOutput": ".engine.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
