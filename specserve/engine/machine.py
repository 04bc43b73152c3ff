"""This machine as `EngineConfig.resolve` reads it (config.Machine): the default model and drafter, CUDA and
Triton, and a model folder's longest position. Everything that builds an engine from options resolves
them through `resolve_config`: the engine, the tensor-parallel workers, `specserve serve`'s early check."""
from __future__ import annotations

import torch

from ..assets import default_draft_path, default_model_path
from ..config import EngineConfig, Machine
from ..models import ArchConfig, read_config


def max_positions(folder: str) -> int:
    """The model folder's max_position_embeddings (its architecture checked: UnsupportedModel if unknown)."""
    return ArchConfig.from_dict(read_config(folder)).max_position_embeddings


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
