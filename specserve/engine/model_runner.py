"""The model runner owns the model, the KV cache tensors and the sampler, and runs one step."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import EngineConfig
from ..layers.attention import AttentionMetadata, build_metadata
from ..layers.sampler import Sampler, token_logprobs
from ..models import ArchConfig, load_model
from .sequence import Sequence, TokenLogprob

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute `num_tokens` tokens starting at its computed prefix."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence's known tokens, so a new token is sampled?"""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class StepInputs:
    ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [num_sampling] flat index of the last token of each sampling sequence
    sampling: list[Sequence] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ArchConfig):
        self.config = config
        self.arch = arch
        self.device = torch.device(config.model.device)
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.kv_cache: Optional[torch.Tensor] = None
        self.num_blocks = 0
        self.sampler = Sampler()
        torch.manual_seed(config.model.seed)  # unseeded requests draw from the global generator
        self.model = load_model(config.model.model, self.dtype, self.device, config.model.load_format,
                                config.model.seed)
        self.num_blocks = self._kv_blocks()
        layers = self.model.attention_layers()
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        # [layers, k/v, slots, kv_heads, head_dim]
        self.kv_cache = torch.zeros(len(layers), 2, self.num_blocks * self.block_size, kv_heads, head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, attn in enumerate(layers):
            attn.kv_cache = self.kv_cache[i]

    def _kv_blocks(self) -> int:
        c = self.config
        if c.cache.num_kv_blocks is not None:
            return c.cache.num_kv_blocks
        layers = self.model.attention_layers()
        per_block = 2 * len(layers) * self.block_size * layers[0].num_kv_heads * layers[0].head_dim
        per_block *= torch.tensor([], dtype=self.dtype).element_size()
        if c.cache.kv_cache_gb is not None:
            budget = c.cache.kv_cache_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.85 * free
        else:
            budget = 2**30
        useful = c.scheduler.max_num_seqs * -(-c.model.max_model_len // self.block_size) + 1
        return max(1, min(int(budget // per_block), useful))

    # ---- one step -----------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        ids, positions, q_lens, seq_lens, tables, logits_index, sampling = [], [], [], [], [], [], []
        offset = 0
        for item in batch:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            offset += n
            if item.samples:
                logits_index.append(offset - 1)
                sampling.append(seq)
        meta = build_metadata(q_lens, seq_lens, tables, self.block_size, self.device)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return StepInputs(as_tensor(ids), as_tensor(positions), meta, as_tensor(logits_index), sampling)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> list[tuple[int, Optional[TokenLogprob]]]:
        """Run the batch; return (token, logprob) for each sequence that samples, in batch order."""
        inputs = self.prepare(batch)
        hidden, _ = self.model(inputs.ids, inputs.positions, inputs.meta)
        if not inputs.sampling:
            return []
        logits = self.model.compute_logits(hidden[inputs.logits_index]).float()  # [num_sampling, vocab]
        params = [s.params for s in inputs.sampling]
        tokens = self.sampler(logits, params, [s.generator for s in inputs.sampling])
        logprobs = self._logprobs(logits, tokens, inputs.sampling)
        return list(zip(tokens.tolist(), logprobs))

    def _logprobs(self, logits, tokens, seqs: list[Sequence]) -> list[Optional[TokenLogprob]]:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return [None] * len(seqs)
        num_top = max(w or 0 for w in wanted)
        chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
        chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
        return [None if w is None else TokenLogprob(chosen[i], list(zip(top_ids[i][:w], top_lp[i][:w])))
                for i, w in enumerate(wanted)]
