"""Vocabulary-parallel embedding and LM head; plain lookups and matmuls at world size 1."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import copy_checked, linear
from .parallel import WHOLE, building, current


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary (padded to divide evenly)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.tp = current()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param, loaded, shard_id=None):
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding: expected shape ({self.vocab_size}, {param.shape[1]}), "
                             f"checkpoint has {tuple(loaded.shape)}")
        rows = loaded[self.start:self.start + self.shard]
        param.data.zero_()
        copy_checked(param.data.narrow(0, 0, rows.shape[0]), rows, "embedding")

    def whole(self) -> "VocabParallelEmbedding":
        """An unsharded copy, for a module that runs on one rank alone (the EAGLE-3 draft head). A collective:
        every rank calls it (ranks other than 0 may drop the result)."""
        if self.tp.size == 1:
            return self
        full = self.tp.all_gather(self.weight.data, dim=0)[:self.vocab_size]  # [vocab, hidden]
        with building(WHOLE):
            copy = VocabParallelEmbedding(self.vocab_size, 0)
        copy.weight = nn.Parameter(full, requires_grad=False)
        return copy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (each rank computes its slice, then gather)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        logits = linear(hidden, self.weight)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size]
