"""Which class runs which checkpoint: the registry keyed by config.json's `architectures`.

A model family is one module under `specserve/models/` with a class implementing `CausalLM` (see
interface.py), plus one line in MODELS. Modules are imported on first use, so this file imports no model
code and config.py can read the per-architecture flags from it.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple


class Family(NamedTuple):
    module: str  # under specserve.models
    cls: str  # the CausalLM class in that module
    qkv_bias: bool = False  # q/k/v projections carry a bias unless config.json's attention_bias says otherwise
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)


MODELS: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Family("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Family("llama", "LlamaForCausalLM", qkv_bias=True),
    "Qwen3ForCausalLM": Family("llama", "LlamaForCausalLM", qk_norm=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True),
    "MixtralForCausalLM": Family("mixtral", "MixtralForCausalLM"),
}


def model_class(architecture: str) -> type:
    """The CausalLM class registered for `architecture` (a key of MODELS)."""
    family = MODELS[architecture]
    return getattr(importlib.import_module(f"{__package__}.{family.module}"), family.cls)
