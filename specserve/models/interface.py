"""The interface every model family implements; the engine touches a model through this alone."""
from __future__ import annotations

from typing import ClassVar, Optional, Protocol, runtime_checkable

import torch

from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import VocabParallelEmbedding
from .config import ArchConfig


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model built from `ArchConfig` (as `cls(config)`, inside
    `layers.parallel.building` so its layers are tensor-parallel shards), with its weights filled by
    `loader.load_weights` through each parameter's `weight_loader(param, tensor[, shard_id])`."""

    config: ArchConfig
    # checkpoint name part -> (our parameter name part, shard id): q/k/v into qkv_proj, gate/up into gate_up_proj
    packed_modules: ClassVar[dict]
    # can a step run inside a CUDA graph (no host reads of device values mid-forward)?
    supports_cuda_graphs: ClassVar[bool]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids, positions [num_tokens] -> final hidden [num_tokens, hidden] (normed), and the residual stream
        [num_tokens, hidden] entering each layer in aux_layers (num_layers = after the last; EAGLE-3 reads them)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] (this rank's vocabulary shard gathered: the whole vocabulary)."""
        ...

    def attention_layers(self) -> list[Attention]:
        """Every attention layer in order; the runner gives layer i the KV cache slice i."""
        ...

    def embedding(self) -> VocabParallelEmbedding:
        """The input token embedding (EAGLE-3 drafters share it, `.whole()`)."""
        ...

    def checkpoint_target(self, name: str) -> Optional[tuple[str, object]]:
        """Optional hook: (parameter name, shard id) for a checkpoint tensor name that `packed_modules` cannot
        express (one tensor per expert into stacked expert weights), or None to fall back to it. A parameter
        filled in several shards this way lists them in its `shard_ids` attribute."""
        ...
