"""CUDA graphs of the target's steps.

One graph per (batch size, tokens per sequence): tokens per sequence is 1 for plain decoding and the
node count of each speculative shape the controller may pick, so every k has its graphs. A step whose
sequences all compute the same number of tokens (no prefill chunk) and whose batch fits is replayed
from the smallest captured batch size that holds it; padding rows write their KV to a scratch slot
that no block owns and attend to nothing. Inputs are copied into static buffers before each replay.

Mixed graphs, one per token count of MIXED_TOKENS (key (0, tokens)), take the steps with prompt chunks: rows
of any query lengths packed one after another, causal within each row (prompt chunks, decode tokens and the
chains a speculative step verifies beside a prompt) or masked by a verified tree's ancestors (its rows' tree
bits and lengths set with the step); logits rows past max_bs from the graph's hidden states, `mixed_outputs`;
replayed from the smallest token count that holds the step; the attention backend's
tiles over the rows are refilled before each replay (`AttentionBackend.mixed_tiles`). Eagerly, such a step
costs one host launch per kernel, which on a small model is most of the step (session 38: on the H200 the
shipped pair's speculative steps that took a prompt ran eagerly at ~6.6 ms, and chain-3 read 0.49x plain at
C = 10).

With LoRA room reserved (layers/lora.py), each graph has a twin keyed (..., ADAPTERS) whose layers add the
adapters' deltas, each token's slot read from a static buffer: steps with adapter rows replay it, the others
keep the graph without (and its fused few-row path).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..device import to_device
from ..layers import cublaslt, lora, triton_ops
from ..layers.attention import AttentionBackend, new_token_slots, padded_tables

log = logging.getLogger(__name__)

ADAPTERS = "lora"  # the last element of the key of a graph that adds LoRA adapters

# token counts of the mixed graphs (each at most the step's token budget): above 128 tokens a step may be bound by
# its GEMMs rather than its launches, so padding stays under a quarter of its tokens there
MIXED_TOKENS = (32, 64, 128) + tuple(range(160, 513, 32))


def mixed_token_counts(most: int) -> tuple[int, ...]:
    """The mixed graphs' token counts for steps of at most `most` tokens (MIXED_TOKENS capped; none for 0)."""
    return tuple(sorted({min(t, most) for t in MIXED_TOKENS} - {0}))


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


@contextlib.contextmanager
def capturing():
    """Around a series of graph captures: collect garbage first and none during them. A collection inside
    a capture can free pinned host memory of an earlier engine (a staging copy, a host buffer), and the
    host allocator's event calls on a capturing stream invalidate the capture."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_all(keys: list[tuple], run, generators: tuple = ()) -> tuple[dict, dict]:
    """One graph per key of run(*key), sharing one memory pool, each captured after a warm-up run
    (kernels compiled, allocator settled); returns the graphs and their static outputs by key. generators:
    CUDA generators run draws from, registered with every graph (each replay draws new numbers)."""
    graphs, outputs, pool = {}, {}, None
    with capturing():
        for key in keys:
            with cublaslt.tuning():
                run(*key)
            graph = torch.cuda.CUDAGraph()
            for generator in generators:
                graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs[key] = run(*key)
            pool = graph.pool() if pool is None else pool
            graphs[key] = graph
    return graphs, outputs


@dataclass
class StepInputs:
    """A step flattened: the tokens of every scheduled sequence, in batch order."""

    ids: list[int]
    positions: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    trees: list  # per sequence: [q, q] ancestor mask or None (causal)
    logit_index: list[int]
    req_indices: list[int]  # per sequence: its request index (Sequence.req_index)
    # prompt logprobs (SamplingParams.prompt_logprobs; such a step runs eagerly): the rows whose next prompt
    # token's logprob is wanted, those tokens, (batch index, rows) of the sequences they belong to in order,
    # and the most alternatives any of them asks for
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_items: list[tuple[int, int]] = field(default_factory=list)
    prompt_top: int = 0
    loras: list[int] = field(default_factory=list)  # per sequence: its LoRA adapter slot (empty: none uses one)


def resolve_ids(ids: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
    """ids with each placeholder -1-r replaced by pending[r] (overlap scheduling: tokens sampled on the device
    by the step before, not yet read on the host)."""
    if pending is None:
        return ids
    return torch.where(ids >= 0, ids, pending[(-1 - ids).clamp(min=0)])


def chunk_pair_slots(step: StepInputs, slots: list[int], scratch: int) -> list[int]:
    """Per token r of a step, the KV slot of the draft pair (its features, token r + 1) that a mixed graph stores
    (`DraftFollower.store_chunk_pairs`): token r + 1's slot where both lie in one prompt chunk, the scratch slot
    elsewhere (a row's last token, decode tokens, and the chains a step verifies, whose tokens may be rejected)."""
    out = [scratch] * len(slots)
    sampled = set(step.logit_index)
    start = 0
    for q in step.q_lens:
        end = start + q
        if q > 1 and end - 2 not in sampled:  # a prompt chunk: a verified chain samples every token
            out[start:end - 1] = slots[start + 1:end]
        start = end
    return out


def packed_inputs(step: StepInputs, block_size: int, bs: int, pad_index: int | None) -> tuple[np.ndarray, int]:
    """A decode step's inputs as `triton_ops.fill_step` reads them, int64: ids, positions and new-token slots [n]
    each, the request index of each of bs rows (with pad_index for rows past the step's; none for None),
    seq_lens and tree lengths [bs] each (0 past the step's rows) and block tables [real, width] zero-padded;
    and width."""
    real, n = len(step.q_lens), len(step.ids)
    width = max(1, max(len(t) for t in step.block_tables))
    extra = bs if pad_index is not None else 0
    packed = np.zeros(3 * n + extra + 2 * bs + real * width, dtype=np.int64)
    packed[:n] = step.ids
    packed[n:2 * n] = step.positions
    packed[2 * n:3 * n] = new_token_slots(step.q_lens, step.seq_lens, step.block_tables, block_size)
    at = 3 * n
    if pad_index is not None:
        packed[at:at + bs] = step.req_indices + [pad_index] * (bs - real)
        at += bs
    packed[at:at + real] = step.seq_lens
    packed[at + bs:at + bs + real] = [t.shape[1] if t is not None else 0 for t in step.trees]
    at += 2 * bs
    for r, table in enumerate(step.block_tables):
        packed[at + r * width:at + r * width + len(table)] = table
    return packed, width


class GraphRunner:
    def __init__(self, model, backend: AttentionBackend, kv_cache: torch.Tensor, block_size: int, max_bs: int,
                 max_blocks: int, tokens_per_seq: list[int], aux_layers: tuple[int, ...], group: int,
                 scratch_slot: int, device: torch.device, follow=None, pad_index: int = 0,
                 max_graph_tokens: int = 2048, mixed_tokens: tuple[int, ...] = (), lora_slots: int = 0):
        """backend: an attention backend with `graphs` (its `static_metadata` over the buffers below);
        mixed_tokens: the token counts of the mixed graphs (none: steps with prompt chunks run eagerly);
        lora_slots: the model's LoRA slots (layers/lora.py); when nonzero every graph has a twin, keyed
        (..., ADAPTERS), that adds each row's adapter (`lora_tokens`: each token's slot) for the steps that use one;
        follow: a Follower (speculative/proposer.py) that the plain-decode graphs (one token per sequence)
        run, beside the model on a second stream and after it on their auxiliary hidden states, which they
        then do not output; pad_index: the request index its padding rows get; kv_cache: the model's
        [layers, k/v, slots + scratch, kv_heads, head_dim]."""
        self.model, self.backend, self.kv_cache, self.block_size = model, backend, kv_cache, block_size
        self.aux_layers, self.group = aux_layers, group
        self.follow, self.pad_index = follow, pad_index
        self.side = torch.cuda.Stream(device) if follow is not None else None
        self.scratch_slot, self.device = scratch_slot, device
        sizes = capture_sizes(max_bs)
        most = max(max_graph_tokens, max_bs)
        self.sizes = {q: [b for b in sizes if b * q <= most] for q in sorted(set(tokens_per_seq))}
        self.mixed_tokens = tuple(sorted(mixed_tokens))
        most_tokens = max([b * q for q, bs in self.sizes.items() for b in bs] + list(self.mixed_tokens))
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(most_tokens, **i64)
        self.positions = torch.zeros(most_tokens, **i64)
        self.slots = torch.full((most_tokens,), scratch_slot, **i64)
        # mixed graphs with a follower: per token r, the slot of the draft pair (aux[r], ids[r + 1]) it stores
        self.pair_slots = torch.full((most_tokens,), scratch_slot, **i64)
        self.tree_bits = torch.zeros(most_tokens, **i64)
        # row max_bs: the mixed graphs' padding row, whose seq_lens and q_lens stay 0
        self.block_tables = torch.zeros(max_bs + 1, max_blocks, **i32)
        self.seq_lens = torch.zeros(max_bs + 1, **i32)
        self.tree_lens = torch.zeros(max_bs + 1, **i32)
        self.req_indices = torch.full((max_bs,), pad_index, **i64)  # follow's rows
        self.q_lens = {q: torch.full((max_bs,), q, **i32) for q in self.sizes}
        self.max_bs = max_bs
        self.mixed = backend.mixed_tiles(max(self.mixed_tokens), max_bs, group, device) if self.mixed_tokens else None
        self.mixed_q_lens = torch.zeros(max_bs + 1, **i32)
        # mixed graphs: each sampling row's token (the graph computes the logits of the first min(tokens, max_bs))
        self.logit_rows = torch.zeros(max(self.mixed_tokens, default=0) + max_bs, **i64)
        self.lora_slots = lora_slots
        self.lora_tokens = torch.zeros(most_tokens, **i64)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # decode graphs: (logits, aux); mixed graphs: (logits, aux, hidden) (`mixed_outputs`)
        self.outputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0
        self.mixed_replays = 0
        self.adapter_replays = 0

    # ---- capture ------------------------------------------------------------------------------
    def _meta(self, bs: int, q: int):
        n = bs * q
        return self.backend.static_metadata(self.slots[:n], self.block_tables[:bs], self.seq_lens[:bs],
                                            self.q_lens[q][:bs], self.tree_bits[:n], self.tree_lens[:bs], q,
                                            self.group, self.block_size, self.kv_cache)

    def _mixed_meta(self, tokens: int):
        return self.backend.static_metadata(self.slots[:tokens], self.block_tables, self.seq_lens, self.mixed_q_lens,
                                            self.tree_bits[:tokens], self.tree_lens, tokens, self.group,
                                            self.block_size, self.kv_cache, tiles=self.mixed.view(tokens))

    def _run(self, bs: int, q: int, adapters: bool = False):
        if adapters:
            rows = self.lora_tokens[:q if bs == 0 else bs * q]
            with lora.applied(lora.LoRABatch(lora.slot_mask(rows, self.lora_slots))):
                return self._run(bs, q)
        if bs == 0:  # a mixed graph of q tokens
            hidden, aux = self.model(self.ids[:q], self.positions[:q], self._mixed_meta(q), self.aux_layers)
            aux = torch.cat(aux, dim=-1) if aux else None  # [q, aux_dim]
            if aux is not None and self.follow is not None:
                self.follow.store_chunk_pairs(self.ids[1:q], aux[:q - 1], self.positions[:q - 1],
                                              self.pair_slots[:q - 1])
            rows = min(q, self.max_bs)  # a step of q tokens samples at most q rows
            return self.model.compute_logits(hidden[self.logit_rows[:rows]]), aux, hidden
        n = bs * q
        follows = q == 1 and self.follow is not None
        if follows:  # the draft's share that needs no output of the model runs beside it
            main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self.follow.store_previous(self.ids[:bs], self.positions[:bs], self.slots[:bs], self.req_indices[:bs])
        hidden, aux = self.model(self.ids[:n], self.positions[:n], self._meta(bs, q), self.aux_layers)
        aux = torch.cat(aux, dim=-1) if aux else None  # [n, aux_dim]
        if follows:
            main.wait_stream(self.side)
            self.follow.keep(aux, self.positions[:bs], self.block_tables[:bs], self.req_indices[:bs])
            aux = None
        return self.model.compute_logits(hidden), aux

    @torch.inference_mode()
    def capture(self) -> float:
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        empty = torch.zeros(1, dtype=torch.long, device=self.device)
        triton_ops.fill_step(empty, empty, self.ids, self.positions, self.slots, self.tree_bits, self.req_indices,
                             self.seq_lens[:0], self.tree_lens[:0], self.block_tables, 0, 0, 0, 1,
                             self.scratch_slot)  # compiled here, not in the first step
        self.seq_lens.zero_()
        keys = [(bs, q) for q, sizes in self.sizes.items() for bs in reversed(sizes)]
        keys += [(0, tokens) for tokens in reversed(self.mixed_tokens)]
        if self.lora_slots:
            keys += [(*key, ADAPTERS) for key in keys]
        self.graphs, self.outputs = capture_all(keys, self._run)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info("captured %d CUDA graphs in %.1f s (%.0f MiB)", len(self.graphs), self.capture_seconds,
                 self.capture_bytes / 2**20)
        return self.capture_seconds

    # ---- replay -------------------------------------------------------------------------------
    def graph_for(self, step: StepInputs) -> tuple | None:
        """The key of the graph that replays this step: (batch size, tokens per sequence), or (0, tokens) for a
        mixed graph, with ADAPTERS after them when rows use LoRA adapters; None: it runs eagerly (steps with
        prompt-logprob rows, or adapters without their graphs)."""
        if step.prompt_rows or (step.loras and not self.lora_slots):
            return None
        key = self._plain_for(step) or self._mixed_for(step)
        return (*key, ADAPTERS) if key is not None and step.loras else key

    def _plain_for(self, step: StepInputs) -> tuple[int, int] | None:
        q = step.q_lens[0]
        if q in self.sizes and all(n == q for n in step.q_lens) and len(step.logit_index) == len(step.ids):
            fits = [b for b in self.sizes[q] if b >= len(step.q_lens)]
            if fits:
                return fits[0], q
        return None

    def _mixed_for(self, step: StepInputs) -> tuple[int, int] | None:
        fits = [t for t in self.mixed_tokens if t >= len(step.ids)]
        if not fits or len(step.q_lens) > self.max_bs:
            return None
        return 0, fits[0]

    def _fill_adapters(self, step: StepInputs, tokens: int) -> None:
        """Each of the graph's `tokens` rows' adapter slot (0 past the step's)."""
        slots = np.zeros(tokens, dtype=np.int64)
        slots[:len(step.ids)] = lora.token_slots(step.loras, step.q_lens)
        self.lora_tokens[:tokens].copy_(to_device(torch.from_numpy(slots), torch.long, self.device))

    @torch.inference_mode()
    def replay(self, key: tuple, step: StepInputs, pending: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """Fill the static inputs from step (pending: the tokens still on the device that its placeholder ids
        -1-r refer to, row r) and replay: the logits, the auxiliary hidden states and, beside them after a mixed
        graph, the step's (ids, positions, slots). A decode graph's inputs travel as one copy and one launch
        (`triton_ops.fill_step`), where they took 3 copies and 10-16 small kernels (session 37)."""
        bs, q = key[:2]
        if len(key) > 2:
            self._fill_adapters(step, q if bs == 0 else bs * q)
            self.adapter_replays += 1
        if bs == 0:
            return self._replay_mixed(key, step, pending)
        real, n = len(step.q_lens), len(step.ids)
        follows = q == 1 and self.follow is not None
        trees = any(t is not None for t in step.trees)
        packed, width = packed_inputs(step, self.block_size, bs, self.pad_index if follows else None)
        triton_ops.fill_step(to_device(torch.from_numpy(packed), torch.long, self.device), pending, self.ids,
                             self.positions, self.slots, None if trees else self.tree_bits,
                             self.req_indices[:bs] if follows else None, self.seq_lens[:bs], self.tree_lens[:bs],
                             self.block_tables, n, bs * q, real, width, self.scratch_slot)
        if trees:
            self.tree_bits[:n].copy_(self.backend.tree_bits(step.trees, step.q_lens, self.device))
        self.graphs[key].replay()
        self.replays += 1
        logits, aux = self.outputs[key]
        # the proposer keeps aux rows past this step and the next replay overwrites the static output
        return logits[:n], (aux[:n].clone() if aux is not None else None), None

    def _replay_mixed(self, key: tuple, step: StepInputs, pending) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                         tuple | None]:
        self.fill_mixed(key[1], step, pending)
        self.graphs[key].replay()
        self.replays += 1
        self.mixed_replays += 1
        return self.mixed_outputs(step, *self.outputs[key])

    def fill_mixed(self, tokens: int, step: StepInputs, pending: torch.Tensor | None = None) -> None:
        """Set a step into the static inputs of the mixed graph of `tokens` tokens (pending: as `replay`)."""
        real, n, rows = len(step.q_lens), len(step.ids), len(step.logit_index)
        slots = new_token_slots(step.q_lens, step.seq_lens, step.block_tables, self.block_size)
        tables = padded_tables(step.block_tables)  # [real, width]
        logit_rows = step.logit_index + [0] * max(0, min(tokens, self.max_bs) - rows)
        pairs = chunk_pair_slots(step, slots, self.scratch_slot) if self.follow is not None else []
        longs = to_device(step.ids + step.positions + slots + pairs + logit_rows, torch.long,
                          self.device)  # [3n (+ n) + rows]
        tree_lens = [t.shape[1] if t is not None else 0 for t in step.trees]
        ints = to_device([step.seq_lens, step.q_lens, tree_lens], torch.int32, self.device)  # [3, real]
        self.ids[:n].copy_(resolve_ids(longs[:n], pending))
        self.positions[:n].copy_(longs[n:2 * n])
        self.slots[:n].copy_(longs[2 * n:3 * n])
        self.slots[n:tokens].fill_(self.scratch_slot)
        if pairs:
            self.pair_slots[:n].copy_(longs[3 * n:4 * n])
            self.pair_slots[n:tokens].fill_(self.scratch_slot)
        self.logit_rows[:len(logit_rows)].copy_(longs[3 * n + len(pairs):])
        self.block_tables[:real, :tables.shape[1]].copy_(to_device(tables, torch.int32, self.device))
        self.seq_lens[:real].copy_(ints[0])
        self.mixed_q_lens[:real].copy_(ints[1])
        self.tree_lens[:real].copy_(ints[2])
        if any(tree_lens):  # verified trees' ancestor masks (other rows: causal)
            self.tree_bits[:n].copy_(self.backend.tree_bits(step.trees, step.q_lens, self.device))
        self.mixed.fill(step.q_lens, tokens)

    def mixed_outputs(self, step: StepInputs, logits: torch.Tensor, aux: torch.Tensor | None, hidden: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """A mixed graph's outputs cut to the step: its logits rows, aux rows and `StepTensors`' fields (ids,
        positions, slots, whether the graph stored the prompt chunks' draft pairs). A step
        sampling more rows than the graph computes logits for (the chains a speculative step verifies beside a
        prompt) takes them from the graph's hidden states [tokens, H], eagerly: two launches."""
        n, rows = len(step.ids), len(step.logit_index)
        if rows > logits.shape[0]:
            logits = self.model.compute_logits(hidden[self.logit_rows[:rows]])  # [rows, vocab]
        if aux is None:
            return logits[:rows], None, None
        return logits[:rows], aux[:n].clone(), (self.ids[:n].clone(), self.positions[:n].clone(),
                                                self.slots[:n].clone(), self.follow is not None)
