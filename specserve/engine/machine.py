"""This machine as `EngineConfig.resolve` reads it (config.Machine): the default model and drafter, CUDA and
Triton, and a model folder's longest position. Everything that builds an engine from options resolves
them through `resolve_config`: the engine, the tensor-parallel workers, `specserve serve`'s early check."""
from __future__ import annotations

import torch

from ..assets import default_draft_path, default_model_path
from ..config import EngineConfig, Machine
from ..models import ArchConfig, read_config


def max_positions(folder: str) -> int:
    """The longest context the engine computes exactly for the model folder (its architecture checked:
    UnsupportedModel if unknown): max_position_embeddings, or the model's attention window where config.json
    sets a shorter `sliding_window` (Mistral, Mixtral: sliding-window attention is not implemented)."""
    cfg = read_config(folder)
    longest = ArchConfig.from_dict(cfg).max_position_embeddings
    window = cfg.get("sliding_window")
    return min(longest, window) if isinstance(window, int) and window > 0 else longest


def triton_available() -> bool:
    from ..layers import triton_attention  # imports triton: only asked on CUDA with the backend on auto

    return triton_attention.available()


def this_machine() -> Machine:
    return Machine(default_model=default_model_path(), default_draft=default_draft_path(),
                   cuda_available=torch.cuda.is_available(), triton_available=triton_available,
                   max_positions=max_positions)


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config.resolve` against this machine."""
    return config.resolve(this_machine())
