"""The model runner owns the model, the KV cache tensors and the sampler, and runs one step.

Under tensor parallelism every rank has one on its shard; rank 0 sends each call that touches the model
or the KV cache to the other ranks first (`_everywhere`), as plain inputs each rank turns into tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..config import ConfigError, EngineConfig
from ..device import to_device
from ..layers import cublaslt, lora
from ..layers.attention import attention_backend
from ..layers.logits_processors import process_logits
from ..layers.parallel import WHOLE, building
from ..layers.sampler import Sampler, ranked_token_logprobs, token_logprobs
from ..models import ArchConfig, fill_weights, load_model
from ..models.lora import clear as clear_lora
from ..models.lora import load_adapter
from ..models.lora import reserve as reserve_lora
from .cuda_graph import GraphRunner, StepInputs, mixed_token_counts, resolve_ids
from .distributed import Ranks
from .sequence import ScheduledSeq, Sequence, TokenLogprob

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_SHARE = 0.85  # of the GPU memory left after the weights; the rest for activations and CUDA graphs
PROMPT_ROWS = 256  # prompt rows whose logits are made at once (`ModelRunner.prompt_logprobs`)


def kv_budget(free: int, total: int, utilization: Optional[float]) -> float:
    """Bytes for the KV pool of a GPU with `free` of its `total` bytes free once the weights are loaded: KV_SHARE of
    the free memory, or with utilization (vLLM's gpu_memory_utilization) KV_SHARE of what the engine's share of
    the whole GPU leaves after all that is on it already (its weights, other processes). ConfigError where that
    share is already used up."""
    if utilization is None:
        return KV_SHARE * free
    room = utilization * total - (total - free)
    if room <= 0:
        raise ConfigError(f"gpu_memory_utilization {utilization} gives this engine {utilization * total / 2**30:.1f} "
                          f"GiB of the GPU's {total / 2**30:.1f}, and {(total - free) / 2**30:.1f} GiB are in use "
                          f"with its weights loaded: raise it")
    return KV_SHARE * room


@dataclass
class StepTensors:
    """A step's inputs on the device, for a proposer that reads the step's aux beside them."""

    ids: torch.Tensor  # [num_tokens] the step's tokens (placeholders resolved)
    positions: torch.Tensor  # [num_tokens]
    slots: torch.Tensor  # [num_tokens] each token's KV cache slot
    chunk_pairs_stored: bool = False  # the step's graph stored the draft pairs within its prompt chunks


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_rows, vocab] in the model's dtype: a row per sampling sequence, per node of a draft
    rows: list[range]  # per batch item, its logits rows (empty when it does not sample)
    aux: Optional[torch.Tensor]  # [num_tokens, aux_dim] auxiliary hidden states, when asked for
    token_offsets: list[int]  # per batch item, the flat index of its first token
    inputs: Optional[StepTensors] = None  # beside aux when the step ran eagerly
    prompt_logprobs: Optional[dict[int, list[TokenLogprob]]] = None  # per batch index: its prompt tokens' logprobs


class StepResult(NamedTuple):
    """What one step of the model returns (`ModelRunner.run`)."""

    logits: torch.Tensor  # [len(logit_index), vocab] in the model's dtype
    aux: Optional[torch.Tensor]  # [num_tokens, aux_dim], None without aux layers
    inputs: Optional[StepTensors]  # its inputs on the device, beside aux when it ran eagerly
    prompt: Optional[tuple[torch.Tensor, ...]] = None  # `ModelRunner.prompt_logprobs`


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ArchConfig, ranks: Optional[Ranks] = None):
        """`ranks`: this rank's tensor-parallel group; rank 0 passes none and starts the group itself when
        tensor_parallel_size > 1 (and closes it again if anything below fails)."""
        if ranks is None and config.parallel.tensor_parallel_size > 1:
            ranks = Ranks.start(config)
        self.config = config
        self.arch = arch
        self.ranks = ranks
        self.device = ranks.device if ranks else torch.device(config.model.device)
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.kv_cache: Optional[torch.Tensor] = None
        self.num_blocks = 0
        self.draft_embedding = None  # rank 0 with speculation: the target's embedding, whole (EAGLE-3 reads it)
        self.graphs: Optional[GraphRunner] = None
        self.pending_tokens: Optional[torch.Tensor] = None  # [rows] the in-flight step's sampled tokens
        self.follower = None  # rank 0 with speculation: the proposer's work in plain-decode graphs (a Follower)
        self.backend = attention_backend(config.execution.attention_backend)
        if self.device.type == "cuda":
            cublaslt.TUNE_ROWS = config.execution.gemm_tuning_rows or None
        # unseeded sampling draws from the engine's own generator, seeded by the model seed (not torch's global one)
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        self.sampler = Sampler(self.generator)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config, ranks = self.config, self.ranks
        with building(ranks.tp if ranks else WHOLE):
            self.model = load_model(config.model.model, self.dtype, self.device, config.model.load_format,
                                    config.model.seed)
        if config.lora.enabled:
            reserve_lora(self.model, config.lora.max_loras, config.lora.max_lora_rank)
        for slot, folder in enumerate(config.lora.modules.values(), start=1):
            load_adapter(self.model, folder, slot, config.lora.max_lora_rank)
        self.num_blocks = ranks.min(self._kv_blocks()) if ranks else self._kv_blocks()
        if config.speculative.enabled:  # the draft head runs on rank 0 alone
            embedding = self.model.embedding().whole()
            self.draft_embedding = embedding if not ranks or ranks.rank == 0 else None
        layers = self.model.attention_layers()
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        self.group = layers[0].num_heads // kv_heads
        self.scratch_slot = self.num_blocks * self.block_size  # padding rows of graph replays write here
        # [layers, k/v, slots + scratch, kv_heads, head_dim]
        self.kv_cache = torch.zeros(len(layers), 2, self.scratch_slot + 1, kv_heads, head_dim,
                                    dtype=self.dtype, device=self.device)

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
            torch.cuda.empty_cache()  # what the allocator holds unused is free memory here
            budget = kv_budget(*torch.cuda.mem_get_info(self.device), c.cache.gpu_memory_utilization)
        else:
            budget = 2**30
        useful = c.scheduler.max_num_seqs * -(-c.model.max_model_len // self.block_size) + 1
        return max(1, min(int(budget // per_block), useful))

    # ---- CUDA graphs -------------------------------------------------------------------------
    def capture_graphs(self, aux_layers: tuple[int, ...], tokens_per_seq: list[int], follower=None) -> None:
        """Capture decode/verify graphs on every rank, in step (CUDA with the triton backend, unless
        enforce_eager); under tensor parallelism the graphs hold the ranks' collectives. follower: what
        the plain-decode graphs run for the proposer (a Follower, speculative/proposer.py; rank 0's)."""
        self.follower = follower
        ex = self.config.execution
        if self.device.type != "cuda" or ex.enforce_eager or not self.backend.graphs:
            return
        if not self.model.supports_cuda_graphs:
            log.warning("no CUDA graphs: %s runs eagerly (%s)", type(self.model).__name__,
                        "its forward reads device values on the host")
            return
        self._everywhere("capture", aux_layers, tokens_per_seq)

    def _own_aux(self, aux_layers: tuple[int, ...]) -> tuple[int, ...]:
        """The auxiliary layers this rank outputs: all on rank 0 (the draft is rank 0's), none elsewhere."""
        return aux_layers if not self.ranks or self.ranks.rank == 0 else ()

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, folder: str, load_format: str, fallback: tuple[str, str]) -> Optional[str]:
        """Load folder's weights into the model in place on every rank (CUDA graphs keep reading the same
        tensors); when they do not load, the weights of fallback (folder, load_format) are loaded back and the
        error's message is returned (None: loaded)."""
        return self._everywhere("_reload", folder, load_format, fallback)

    def _reload(self, folder: str, load_format: str, fallback: tuple[str, str]) -> Optional[str]:
        error = None
        try:
            fill_weights(self.model, folder, load_format, self.config.model.seed)
        except (OSError, ValueError) as e:  # WeightError is a ValueError
            error = str(e)
            fill_weights(self.model, *fallback, self.config.model.seed)
        if self.config.speculative.enabled:  # a collective: every rank gathers, rank 0 keeps a copy under TP
            whole = self.model.embedding().whole()
            if self.draft_embedding is not None and self.draft_embedding is not whole:
                self.draft_embedding.weight.data.copy_(whole.weight)
        return error

    # ---- LoRA adapters ----------------------------------------------------------------------
    def load_adapter(self, folder: str, slot: int) -> None:
        """Load the adapter in folder as `slot` here, then (it loaded) on the other ranks."""
        self._add_adapter(folder, slot)
        if self.ranks is not None:
            self.ranks.send(("_add_adapter", (folder, slot)))

    def _add_adapter(self, folder: str, slot: int) -> None:
        load_adapter(self.model, folder, slot, self.config.lora.max_lora_rank)

    def unload_adapter(self, slot: int) -> None:
        self._everywhere("_drop_adapter", slot)

    def _drop_adapter(self, slot: int) -> None:
        clear_lora(self.model, slot)

    def capture(self, aux_layers: tuple[int, ...], tokens_per_seq: list[int]) -> None:
        ex = self.config.execution
        aux_layers = self._own_aux(aux_layers)
        max_blocks = -(-(self.config.model.max_model_len + max(tokens_per_seq)) // self.block_size) + 1
        follow = self.follower if aux_layers else None
        cap = min(self.config.scheduler.max_num_batched_tokens, ex.cuda_graph_max_tokens)
        self.graphs = GraphRunner(self.model, self.backend, self.kv_cache, self.block_size, ex.cuda_graph_max_bs,
                                  max_blocks, tokens_per_seq, aux_layers, self.group, self.scratch_slot, self.device,
                                  follow, self.config.scheduler.max_num_seqs,
                                  mixed_tokens=mixed_token_counts(cap),
                                  lora_slots=self.config.lora.max_loras if self.config.lora.enabled else 0)
        self.graphs.capture()

    # ---- one step -----------------------------------------------------------------------------
    @property
    def failure(self) -> Optional[str]:
        """Why the tensor-parallel group broke (a rank exited), or None."""
        return self.ranks.failure if self.ranks else None

    def close(self) -> None:
        """End the other ranks (tensor parallelism); nothing to do on one device."""
        if self.ranks is not None:
            self.ranks.close()

    def _everywhere(self, method: str, *args):
        """Run self.method(*args) here, after sending the call to every other rank."""
        if self.ranks is not None:
            self.ranks.send((method, args))
        return getattr(self, method)(*args)

    def prepare(self, batch: list[ScheduledSeq]
                ) -> tuple[StepInputs, list[range], list[int], Optional[torch.Tensor]]:
        """Flatten a batch into step inputs, each item's logits rows, each item's first token index and the
        draft tokens [B, N] on the device that the inputs' placeholders -1-i refer to (flat index i)."""
        step = StepInputs([], [], [], [], [], [], [], [])
        rows, offsets, drafts = [], [], None
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            offsets.append(len(step.ids))
            first = len(step.logit_index)
            tree = item.draft
            if tree is not None:
                if tree.tokens is None and self.ranks is None:  # drafted on this device: placeholders
                    drafts = tree.batch
                    step.ids.extend(range(-1 - tree.row * n, -1 - (tree.row + 1) * n, -1))
                else:
                    step.ids.extend(tree.host_tokens())
                step.positions.extend(start + d for d in tree.depths())
                step.trees.append(None if tree.is_chain else tree.ancestor_mask())
                step.logit_index.extend(range(len(step.ids) - n, len(step.ids)))
                rows.append(range(first, first + n))
            else:
                known = seq.token_ids[start:start + n]
                step.ids.extend(known)
                if len(known) < n:  # the token the in-flight step is sampling: resolved on the device
                    step.ids.append(-1 - seq.pending_row)
                step.positions.extend(range(start, start + n))
                step.trees.append(None)
                rows.append(range(first, first + 1) if item.samples else range(0))
                if item.samples:
                    step.logit_index.append(len(step.ids) - 1)
            if seq.params.prompt_logprobs is not None:
                self._prompt_rows(step, i, seq, start, n, offsets[-1])
            step.q_lens.append(n)
            step.loras.append(seq.lora)
            step.req_indices.append(seq.req_index)
            step.seq_lens.append(start + n)
            step.block_tables.append(seq.block_table)
        if not any(step.loras):
            step.loras = []
        return step, rows, offsets, drafts

    @staticmethod
    def _prompt_rows(step: StepInputs, index: int, seq: Sequence, start: int, n: int, offset: int) -> None:
        """Batch item `index`: the rows of seq's tokens start..start+n-1 (from flat index offset) whose logits
        give a prompt token seq has no logprob for yet (position p's give token p + 1's)."""
        positions = range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1))
        if positions:
            step.prompt_rows.extend(offset + p - start for p in positions)
            step.prompt_targets.extend(seq.token_ids[p + 1] for p in positions)
            step.prompt_items.append((index, len(positions)))
            step.prompt_top = max(step.prompt_top, seq.params.prompt_logprobs)

    def forward(self, batch: list[ScheduledSeq], aux_layers: tuple[int, ...] = (),
                publish: bool = False) -> ForwardOutput:
        """The model on a batch. publish: the engine will hand this step's sampled tokens (one per
        sampling item) to `publish` without reading them, and the next step's inputs may refer to them."""
        step, rows, offsets, drafts = self.prepare(batch)
        sampled = sum(1 for item in batch if item.samples) if publish else 0
        if self.graphs is not None and self.graphs.follow is not None:
            key = self.graphs.graph_for(step)
            if key is not None and key[0] > 0 and key[1] == 1:  # a plain-decode graph (not a mixed one)
                self.follower.before_step([item.seq for item in batch])
        if drafts is not None:  # no step is in flight: the placeholders are draft tokens
            self.pending_tokens = drafts.view(-1)
        try:
            result = self._everywhere("run", step, aux_layers, sampled)
        finally:
            if drafts is not None:
                self.pending_tokens = None
        prompt = self._host_prompt_logprobs(step, batch, result.prompt) if result.prompt is not None else None
        return ForwardOutput(result.logits, rows, result.aux, offsets, result.inputs, prompt)

    @staticmethod
    def _host_prompt_logprobs(step: StepInputs, batch: list[ScheduledSeq], prompt
                              ) -> dict[int, list[TokenLogprob]]:
        """Per batch item with prompt rows, the TokenLogprob of each (`prompt_logprobs`' tensors)."""
        chosen, top_ids, top_lp, ranks = (t.tolist() for t in prompt)
        out, row = {}, 0
        for index, count in step.prompt_items:
            k = batch[index].seq.params.prompt_logprobs
            out[index] = [TokenLogprob(chosen[r], list(zip(top_ids[r][:k], top_lp[r][:k])), ranks[r])
                          for r in range(row, row + count)]
            row += count
        return out

    @torch.inference_mode()
    def run(self, step: StepInputs, aux_layers: tuple[int, ...], sampled: int = 0) -> StepResult:
        """The model on one step: logits [len(logit_index), vocab] in the model's dtype (`Sampler` and
        `filtered_logits` compute in fp32 what needs it), the auxiliary hidden states
        [num_tokens, aux_dim] (None without aux_layers) and, beside them when the step ran eagerly, its
        inputs on the device; the prompt rows' logprobs when it has any; from a CUDA graph when one fits.
        Ranks other than 0 then receive the `sampled` tokens rank 0 publishes for this step."""
        out = self._model_step(step, aux_layers)
        if sampled and self.ranks is not None and self.ranks.rank != 0:
            self.pending_tokens = self.ranks.tp.broadcast(torch.empty(sampled, dtype=torch.long, device=self.device))
        return out

    def release(self, tokens: torch.Tensor) -> None:
        """These tokens were read on the host: the next step's inputs no longer refer to them."""
        if self.pending_tokens is tokens:
            self.pending_tokens = None

    def publish(self, tokens: Optional[torch.Tensor]) -> None:
        """Rank 0: tokens [rows] sampled on the device from the latest forward(publish=True) become the
        pending tokens the next step's placeholders read, here and (broadcast) on every other rank."""
        self.pending_tokens = tokens
        if tokens is not None and self.ranks is not None:
            self.ranks.tp.broadcast(tokens)

    def _model_step(self, step: StepInputs, aux_layers: tuple[int, ...]) -> StepResult:
        key = self.graphs.graph_for(step) if self.graphs is not None else None
        if key is not None:
            logits, aux, inputs = self.graphs.replay(key, step, self.pending_tokens)
            return StepResult(logits, aux, StepTensors(*inputs) if inputs is not None else None)
        trees = step.trees if any(t is not None for t in step.trees) else None
        meta = self.backend.metadata(step.q_lens, step.seq_lens, step.block_tables, self.block_size, self.device,
                                     self.group, trees, self.kv_cache)
        aux_layers = self._own_aux(aux_layers)
        ids, positions = resolve_ids(self._ids(step.ids), self.pending_tokens), self._ids(step.positions)
        adapters = lora.batch_of(step.loras, step.q_lens, self.config.lora.max_loras, self.device)
        with lora.applied(adapters):
            hidden, aux = self.model(ids, positions, meta, aux_layers)
        logits = self.model.compute_logits(hidden[self._ids(step.logit_index)])
        prompt = self.prompt_logprobs(hidden, step) if step.prompt_rows else None
        if not aux:
            return StepResult(logits, None, None, prompt)
        return StepResult(logits, torch.cat(aux, dim=-1), StepTensors(ids, positions, meta.slot_mapping), prompt)

    def prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, H]: per prompt row, the logprob of its target token, the top step.prompt_top
        (ids, logprobs) and the target's rank: [R], [R, top], [R, top], [R]. The logits are made PROMPT_ROWS
        rows at a time: a long prompt's at once would not fit (4,096 x 128K fp32 is 2 GB)."""
        rows, targets = self._ids(step.prompt_rows), self._ids(step.prompt_targets)
        parts = [ranked_token_logprobs(self.model.compute_logits(hidden[rows[i:i + PROMPT_ROWS]]),
                                       targets[i:i + PROMPT_ROWS], step.prompt_top)
                 for i in range(0, len(rows), PROMPT_ROWS)]
        return tuple(torch.cat(p) for p in zip(*parts))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, Optional[TokenLogprob]]]:
        """One token per row of logits [len(seqs), vocab], with its logprob when the request asked."""
        tokens, logits = self.sample_on_device(logits, seqs)
        return list(zip(tokens.tolist(), self.logprobs(logits, tokens, seqs)))

    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [len(seqs)] on the device, one per row of logits [len(seqs), vocab], each at sequence index
        seq.num_tokens (what seeded sampling is keyed by); and the logits they were drawn from (processed for
        requests with penalties, logit_bias or min_tokens: logprobs are taken from these)."""
        logits = process_logits(logits, seqs, self.pending_tokens)
        tokens = self.sampler(logits, [s.params for s in seqs], None, [s.num_tokens for s in seqs])
        return tokens, logits

    def logprobs(self, logits, tokens, seqs: list[Sequence]) -> list[Optional[TokenLogprob]]:
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return [None] * len(seqs)
        num_top = max(w or 0 for w in wanted)
        chosen, top_ids, top_lp = token_logprobs(logits, tokens, num_top)
        chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
        return [None if w is None else TokenLogprob(chosen[i], list(zip(top_ids[i][:w], top_lp[i][:w])))
                for i, w in enumerate(wanted)]

    def move_kv(self, moves: list[tuple[Sequence, list[int], "range | list[int]"]]) -> None:
        """Copy the KV of each (seq, token indices src, token indices dst) from src to dst, in every layer,
        all in one copy (tree compaction after a verify)."""
        bs = self.block_size
        src = [seq.block_table[i // bs] * bs + i % bs for seq, s, _ in moves for i in s]
        dst = [seq.block_table[i // bs] * bs + i % bs for seq, _, d in moves for i in d]
        self._everywhere("copy_slots", src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        s, d = self._ids(src), self._ids(dst)
        self.kv_cache[:, :, d] = self.kv_cache[:, :, s]

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)
