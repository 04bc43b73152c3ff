"""The engine loop: admit requests, schedule a step, run it, apply the results, report outputs."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from ..config import ConfigError, EngineConfig
from ..device import to_device
from ..models import ArchConfig, GenerationDefaults, WeightError, read_config
from ..sampling_params import SamplingParams
from ..speculative.batch_verify import process_drafts
from ..speculative.decoder import LoopFlight, SpecDecoder
from ..speculative.shapes import PLAIN, Shape
from .block_manager import make_block_manager
from .detokenizer import IncrementalDetokenizer
from .model_runner import ForwardOutput, ModelRunner
from .outputs import EngineBusy, Prompt, RequestError, RequestOutput
from .scheduler import Scheduler
from .sequence import RequestOptions, ScheduledSeq, Sequence
from .stats import EngineStats, SpecStats

log = logging.getLogger(__name__)

@dataclass
class InFlight:
    """A plain step launched on the device whose sampled tokens the host has not read yet."""

    seqs: list[Sequence]  # the sequences that sample, in row order
    tokens: Optional[torch.Tensor]  # [len(seqs)] on the device
    logprobs: list  # per sequence: TokenLogprob or None
    host: Optional[torch.Tensor] = None  # [len(seqs)] pinned on CUDA
    event: Optional[torch.cuda.Event] = None  # recorded after the copy to `host`
    decoding: bool = False  # every item decoded (no prefill)
    alone: bool = False  # launched with no step in flight: the device was idle when it started
    batch_size: int = 0
    started: float = 0.0  # perf_counter when its step began

    def start_copy(self, buffer: torch.Tensor, event: Optional[torch.cuda.Event]) -> None:
        """Copy the tokens into buffer (a slice of a preallocated host buffer) without waiting."""
        self.host = buffer[:len(self.seqs)]
        self.host.copy_(self.tokens, non_blocking=event is not None)
        self.event = event
        if event is not None:
            event.record()

    def host_tokens(self) -> list[int]:
        if self.tokens is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class LoadedLoRA(NamedTuple):
    """A LoRA adapter the engine serves: its slot in the layers, its folder, which load it is (ever increasing:
    an adapter loaded again under a name is another load)."""

    slot: int
    folder: str
    load: int


def load_tokenizer(folder: str, chat_template: Optional[str] = None):
    """The folder's Hugging Face tokenizer, or None when it has none (token-id prompts only); chat_template (a
    template or a file holding one) replaces its own."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model")):
        if chat_template is not None:
            raise ConfigError(f"chat_template given, but {folder!r} has no tokenizer to render it with")
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        elif "{" not in chat_template:
            raise ConfigError(f"chat_template {chat_template!r} is neither a file nor a Jinja template")
        tokenizer.chat_template = chat_template
    return tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from .machine import resolve_config

        self.config = config = resolve_config(config)
        self.arch = ArchConfig.from_dict(read_config(config.model.model))
        self.tokenizer = load_tokenizer(config.model.tokenizer, config.model.chat_template)
        self.generation = GenerationDefaults.read(config.model.generation_config)
        if self.generation.sampling:
            log.info("sampling defaults from generation_config.json (a request's own values win): %s",
                     self.generation.sampling)
        self.eos_token_ids = set(self.arch.eos_token_ids) | set(self.generation.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner = ModelRunner(config, self.arch)  # under tensor parallelism: starts the other ranks
        spec_stats = SpecStats()
        try:
            if self.runner.num_blocks * config.cache.block_size < config.model.max_model_len:
                raise ValueError(f"the KV cache holds {self.runner.num_blocks * config.cache.block_size} tokens, "
                                 f"fewer than max_model_len {config.model.max_model_len}: raise num_kv_blocks, "
                                 f"kv_cache_gb or gpu_memory_utilization, or lower max_model_len")
            tokens = self.runner.num_blocks * config.cache.block_size
            log.info("KV cache: %d blocks of %d = %d tokens, %.1f GiB: %.1f sequences of max_model_len %d",
                     self.runner.num_blocks, config.cache.block_size, tokens, self.runner.kv_cache.nbytes / 2**30,
                     tokens / config.model.max_model_len, config.model.max_model_len)
            self.spec = SpecDecoder(config, self.arch, self.runner, spec_stats) \
                if config.speculative.enabled else None
            self.blocks = make_block_manager(config.cache, self.runner, self.spec.proposer if self.spec else None)
            shapes = self.spec.shapes if self.spec is not None else [PLAIN]
            self.runner.capture_graphs(self.aux_layers, sorted({s.num_nodes for s in shapes}),
                                       self.spec.make_follower() if self.spec is not None else None)
            if self.spec is not None and self.runner.graphs is not None:
                self.spec.capture_graphs(config.execution.cuda_graph_max_bs)
            self._init_state(config, spec_stats)
            if self.spec is not None:
                self.spec.calibrate(self)  # needs the engine whole: it runs steps
        except BaseException:
            self.runner.close()
            raise

    def _init_state(self, config: EngineConfig, spec_stats: SpecStats) -> None:
        """The scheduler, the overlap pipeline's buffers, the request table and the counters."""
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.shape: Shape = PLAIN
        self.overlap = not config.execution.disable_overlap_schedule
        self.inflight: Optional[InFlight] = None
        self.flight: Optional[LoopFlight] = None  # a looped speculative step in flight (overlap)
        self.flight_done: list[Sequence] = []  # finished during the run: released when it drains
        self.run_opened = 0.0  # seconds the step that began the run of looped steps in flight took
        self.run_times: dict[Shape, list] = {}  # per shape: [steps, seconds, tokens] of the run (`_loop_drain`)
        on_cuda = self.runner.device.type == "cuda"
        rows = config.scheduler.max_num_seqs
        self.host_buffers = [torch.empty(rows, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self.copy_events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self._flip = 0
        self.requests: dict[str, Sequence] = {}
        self._lora_loads = itertools.count()
        self.loras = {name: LoadedLoRA(slot, folder, next(self._lora_loads))  # the adapters served, by name
                      for slot, (name, folder) in enumerate(config.lora.modules.items(), start=1)}
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # the order requests were added in
        self.weights = (config.model.model, config.model.load_format)  # where the served weights came from
        self.stats = EngineStats(spec=spec_stats, prefix_cache=self.blocks.stats)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose input hidden states each step outputs (for the proposer)."""
        return self.spec.aux_layers if self.spec is not None else ()

    # ---- requests -----------------------------------------------------------------------------
    def default_params(self, **options) -> SamplingParams:
        """SamplingParams with these options, the model's sampling defaults (generation_config.json) for the
        others it names, SamplingParams' own for the rest."""
        return SamplingParams(**{**self.generation.sampling, **options})

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model folder has no tokenizer: pass token ids, not text")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise RequestError("a prompt is a string or a list of token ids")
        return list(prompt)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, options: RequestOptions = RequestOptions()) -> Sequence:
        """Validate and queue a request (options: its adapter and priority). Raises RequestError (or ValueError
        for params) before any work."""
        slot = self.check_options(options)
        params = params or self.default_params()
        params.validate()
        params.update_from_tokenizer(self.tokenizer)
        params.check_token_ids(self.arch.vocab_size)
        params.check_logprobs(self.max_logprobs)
        ids = self.tokenize(prompt)
        self.check_prompt(ids)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens) \
            if self.tokenizer is not None else None
        # a seed needs no generator: seeded tokens are keyed by (seed, position) (layers/sampler.py)
        seq = Sequence(request_id, ids, params, self.eos_token_ids, self.config.model.max_model_len, detok, slot,
                       self._salt(options), options.priority, next(self._arrivals))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _salt(self, options: RequestOptions) -> Optional[bytes]:
        """What a request's prefix-cache hashes start from: its adapter (this load of it: an adapter loaded again
        under a name shares nothing with the one before) and its cache salt; None: neither."""
        if options.lora is None and options.cache_salt is None:
            return None
        adapter = self.loras.get(options.lora)
        return json.dumps([options.lora, adapter and adapter.load, options.cache_salt]).encode()

    def load_lora(self, name: str, folder: str) -> None:
        """Serve the PEFT adapter in `folder` as `name` from now on (on every rank). RequestError for a name in
        use; LoRAError for an adapter that cannot load (nothing changes then)."""
        lora = self.config.lora
        if not lora.enabled:
            raise RequestError("LoRA is off: start the engine with enable_lora (--enable-lora) to load adapters")
        if name in self.loras:
            raise RequestError(f"a LoRA adapter named {name!r} is loaded already")
        if len(self.loras) >= lora.max_loras:
            raise RequestError(f"{len(self.loras)} LoRA adapters are loaded, as many as max_loras: unload one first "
                               f"(or start with a larger --max-loras)")
        slot = min(set(range(1, len(self.loras) + 2)) - {a.slot for a in self.loras.values()})
        self.runner.load_adapter(folder, slot)
        self.loras[name] = LoadedLoRA(slot, folder, next(self._lora_loads))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`. RequestError when no such adapter is loaded, or requests still use it."""
        slot = self.check_options(RequestOptions(lora=name))
        users = sum(1 for seq in self.requests.values() if seq.lora == slot)
        if users:
            raise RequestError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        del self.loras[name]
        self.runner.unload_adapter(slot)

    def update_weights(self, folder: str, load_format: str = "safetensors") -> None:
        """Serve the weights in `folder` from now on (SGLang's update_weights_from_disk): a checkpoint of the same
        architecture and shapes, loaded in place on every rank, so CUDA graphs stay valid; the prefix cache is
        emptied (its KV came from the old weights); a drafter stays as it is. RequestError while requests hold KV
        blocks, or for a folder whose config.json differs; WeightError when its tensors do not load (the weights
        served before are loaded back first)."""
        self._check_idle("update the weights")
        try:
            arch = ArchConfig.from_dict(read_config(folder)) if load_format != "dummy" else self.arch
        except (OSError, ValueError) as e:
            raise RequestError(f"cannot read {folder!r}: {e}") from None
        differ = [f for f in self.arch.__dataclass_fields__ if f != "raw" and getattr(arch, f) != getattr(self.arch, f)]
        if differ:
            raise RequestError(f"{folder!r} is not the served model's architecture and shapes: {', '.join(differ)} "
                               f"differ")
        error = self.runner.update_weights(folder, load_format, self.weights)
        self.blocks.reset()
        if error is not None:
            raise WeightError(f"{folder!r} did not load ({error}); the weights from {self.weights[0]!r} are back")
        self.weights = (folder, load_format)
        log.info("serving the weights of %s", folder)

    def _check_idle(self, what: str) -> None:
        holders = sum(1 for seq in self.requests.values() if seq.block_table)
        if holders:
            raise EngineBusy(f"{holders} request(s) hold KV blocks: {what} when none runs")

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the device and in the host tier (vLLM's reset_prefix_cache). RequestError
        while requests hold KV blocks: cached blocks they share cannot be forgotten under them."""
        self._check_idle("reset the prefix cache")
        if not self.blocks.reset():
            raise RequestError("cached KV blocks are still in use: reset the prefix cache when no request runs")

    def check_options(self, options: RequestOptions) -> int:
        """The slot of the request's adapter (0: none). RequestError for an adapter this engine does not serve,
        or a priority without the priority scheduling policy."""
        if options.priority and self.config.scheduler.scheduling_policy != "priority":
            raise RequestError(f"priority {options.priority} needs scheduling_policy 'priority' (this engine "
                               f"schedules {self.config.scheduler.scheduling_policy})")
        if options.lora is None:
            return 0
        if options.lora not in self.loras:
            served = ", ".join(self.loras) or "none"
            raise RequestError(f"unknown LoRA adapter {options.lora!r} (this engine serves: {served})")
        return self.loras[options.lora].slot

    @property
    def max_logprobs(self) -> int:
        """The most top log-probabilities a request may ask for a token (config max_logprobs; -1: the vocabulary)."""
        limit = self.config.model.max_logprobs
        return self.arch.vocab_size if limit == -1 else limit

    def check_prompt(self, ids: list[int]) -> None:
        """Raise RequestError if a tokenized prompt cannot be served (empty, too long, unknown token ids)."""
        max_len = self.config.model.max_model_len
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= max_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len is {max_len} "
                               f"(prompt plus at least one generated token)")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.arch.vocab_size})")

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """End a request now (its KV freed); its last output, finished with reason "abort", or None for a request
        this engine does not have or that had finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.finished:
            return None
        seq.finish("abort")
        self.scheduler.finish(seq)
        return RequestOutput.of(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None or self.flight is not None

    def close(self) -> None:
        """End the other tensor-parallel ranks (they also end when this process exits)."""
        self.runner.close()

    # ---- one step -----------------------------------------------------------------------------
    def _decode_shape(self, seq: Sequence) -> tuple[int, int]:
        """(tokens computed, KV slots needed) for a decoding sequence this step."""
        shape = self.shape
        if (shape.steps == 0 or seq.num_tokens + self.spec.num_slots(shape) > self.config.model.max_model_len
                or not self.spec.drafts(seq, shape)):
            return 1, 1
        return shape.num_nodes, self.spec.num_slots(shape)

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs it completed. With overlap on, a plain step (and a looped
        speculative step in a run of them) returns the outputs of the step before it, whose host work ran while this
        one was on the device."""
        entered = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.step_seconds += time.perf_counter() - entered

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.spec is not None:
            self.shape = self.spec.choose(max(1, len(self.scheduler.running)), self.scheduler.prompt_tokens_pending,
                                            self.scheduler.running)
        outputs, released = [], False
        if self.flight is not None:
            if self._loop_continues():
                return self._loop_step(start)
            released = bool(self.flight_done)
            outputs = self._loop_drain(start)
            start = time.perf_counter()  # the drained step's device time belongs to that step
        if self.overlap and self.shape.steps == 0:
            return outputs + self._step_overlapped(start)
        if self.inflight is not None:
            outputs += self._drain()
        released = released or any(o.finished for o in outputs)
        if self.shape.steps and released and self.scheduler.prefill_pending():
            # the drained step freed a slot that a prompt takes in this one
            self.shape = self.spec.choose(max(1, len(self.scheduler.running)), self.scheduler.prompt_tokens_pending,
                                            self.scheduler.running)
        start = time.perf_counter()  # the drained step's device time belongs to that step
        emitted = self.stats.num_generation_tokens
        batch = self.scheduler.schedule(self._decode_shape)
        if not batch:
            return outputs
        speculating = [item for item in batch if item.num_tokens > 1 and item.seq.num_uncomputed_tokens == 1]
        if self.shape.steps:
            self.spec.record_declined(self.shape, sum(map(self._declined, batch)))
        if self._loop_starts(batch, speculating):
            self.flight = self.spec.start_loop([item.seq for item in batch], self.shape)
            self.run_opened, self.run_times = time.perf_counter() - start, {}
            self.stats.num_steps += 1
            self.stats.spec.last_k = self.shape.k
            return outputs
        if speculating:
            for item, tree in zip(speculating, self.spec.draft([item.seq for item in speculating], self.shape)):
                item.draft = tree
        t0 = time.perf_counter()
        out = self.runner.forward(batch, self.aux_layers)
        if speculating:
            self.stats.spec.verify_time_s += time.perf_counter() - t0
        self.stats.num_steps += 1
        self.stats.spec.last_k = self.shape.k if speculating else 0
        outputs += self._apply(batch, out)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self._decoding_only(batch):
            self.spec.record_step(len(batch), self.shape, time.perf_counter() - start, len(speculating),
                                  self.stats.num_generation_tokens - emitted)
        return outputs

    def _declined(self, item: ScheduledSeq) -> bool:
        """Did this decoding item of a speculative step decline to draft (`SpecDecoder.drafts`)?"""
        return (item.num_tokens == 1 and item.seq.num_uncomputed_tokens == 1
                and not self.spec.drafts(item.seq, self.shape))

    # ---- overlap: plain steps launch before the previous one's results are read --------------
    def _step_overlapped(self, start: float) -> list[RequestOutput]:
        batch = self.scheduler.schedule(self._decode_shape)
        previous, self.inflight = self.inflight, None
        if batch:
            out = self.runner.forward(batch, self.aux_layers, publish=True)
            self.stats.num_steps += 1
            self.stats.spec.last_k = 0
            self.inflight = self._launch_sampling(batch, out, alone=previous is None, started=start)
        outputs = self._resolve(previous) if previous is not None else []
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if batch and self.inflight.decoding and previous is not None and previous.decoding:
            # launch to launch, the wait for the previous decode step included: one decode step's time
            self.spec.record_step(len(batch), PLAIN, time.perf_counter() - start)
        return outputs

    # ---- overlap: looped speculative steps launch before the previous one's verdicts are read ------------
    def _loop_starts(self, batch: list[ScheduledSeq], speculating: list[ScheduledSeq]) -> bool:
        """Does this step start a run of looped steps: every running sequence drafts and the run's graphs fit?"""
        return (self.overlap and bool(speculating) and len(speculating) == len(batch) == len(self.scheduler.running)
                and self.spec.loop_fits([item.seq for item in batch], self.shape))

    def _loop_continues(self) -> bool:
        """May the next speculative step launch before the one in flight is read: the same rows, a shape the
        loop runs (it may differ from the one in flight), no prompt waiting, and KV for the most the step in
        flight can accept plus the next step's slots?"""
        flight = self.flight
        if (self.shape.steps == 0 or self.flight_done or self.scheduler.running != flight.seqs
                or self.scheduler.prefill_pending() or not self.spec.loop_runs(self.shape, flight)):
            return False
        n, slots = flight.shape.num_nodes, self.spec.num_slots(self.shape)
        if any(seq.num_tokens + n + slots > self.config.model.max_model_len for seq in flight.seqs):
            return False
        if sum(self.blocks.new_blocks_needed(seq, n + slots) for seq in flight.seqs) > self.blocks.num_free_blocks:
            return False
        for seq in flight.seqs:
            self.blocks.append(seq, n + slots)
        return True

    def _loop_step(self, start: float) -> list[RequestOutput]:
        flight = self.flight
        self.flight = self.spec.continue_loop(flight, self.shape)
        self.stats.num_steps += 1
        self.stats.spec.last_k = self.shape.k
        emitted = self.stats.num_generation_tokens
        outputs, _ = self._loop_resolve(flight)
        # launch to launch, the wait for the step before included: one speculative step's time
        self._run_step(flight.shape, time.perf_counter() - start, self.stats.num_generation_tokens - emitted)
        return outputs

    def _run_step(self, shape: Shape, seconds: float, tokens: int) -> None:
        cell = self.run_times.setdefault(shape, [0, 0.0, 0])
        cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + seconds, cell[2] + tokens

    def _record_run(self, batch_size: int) -> None:
        """Time a drained run's steps for the controller: per shape, its steps at their mean. The step that
        began the run (host work, the draft catching up after a prompt) and the wait for its last belong
        to no launch-to-launch interval; they are counted as its last step's, so a draft whose runs every
        arriving prompt cuts short is priced as it runs, not as an unbroken run would be."""
        for shape, (steps, seconds, tokens) in self.run_times.items():
            for _ in range(steps):
                self.spec.record_step(batch_size, shape, seconds / steps, batch_size, tokens / steps, looped=True)
        self.run_times = {}

    def _loop_resolve(self, flight: LoopFlight) -> tuple[list[RequestOutput], list[Optional[int]]]:
        """Read a looped step's verdicts and apply them; per row, the drafts it accepted (None for a
        sequence that had finished before it)."""
        outputs, accepted, spines = [], [], []
        for seq, (a, tokens, spine) in zip(flight.seqs, flight.read()):
            if seq.finished:  # finished in an earlier step of the run, or aborted: this row is dropped
                accepted.append(None)
                continue
            accepted.append(a)
            spines.append(spine)
            seq.num_computed_tokens += a + 1
            self.stats.num_generation_tokens += seq.append_tokens(tokens)
            outputs.append(self._output(seq))
            if seq.finished:
                self.flight_done.append(seq)
        if outputs:
            self.spec.record_accepted(flight.shape, [a for a in accepted if a is not None], spines, looped=True)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return outputs, accepted

    def _loop_drain(self, start: float) -> list[RequestOutput]:
        """End the run: read its last step, hand the draft state back, trim the KV reserved past
        each sequence's tokens and release the sequences that finished (start: when this step began)."""
        flight, self.flight = self.flight, None
        emitted = self.stats.num_generation_tokens
        outputs, accepted = self._loop_resolve(flight)
        self.spec.end_loop(flight.seqs, accepted)
        for seq in flight.seqs:
            if not seq.finished:
                self.blocks.truncate(seq, seq.num_tokens)
        done, self.flight_done = self.flight_done, []
        self._finish(done)
        self._run_step(flight.shape, self.run_opened + time.perf_counter() - start,
                       self.stats.num_generation_tokens - emitted)
        self._record_run(len(flight.seqs))
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Resolve the step in flight before a step that cannot overlap it. A plain step that ran alone
        (a probe between speculative steps) is timed here, launch to tokens on the host."""
        flight = self.inflight
        outputs = self._resolve(flight)
        if flight.decoding and flight.alone:
            self.spec.record_step(flight.batch_size, PLAIN, time.perf_counter() - flight.started)
        return outputs

    def _launch_sampling(self, batch: list[ScheduledSeq], out: ForwardOutput, alone: bool,
                         started: float) -> "InFlight":
        """Commit the batch's KV, sample on the device and start copying the tokens to the host. `alone`:
        no step was in flight when this one launched; `started`: perf_counter when its step began."""
        sampling = [i for i, item in enumerate(batch) if item.samples]
        seqs = [batch[i].seq for i in sampling]
        tokens, logprobs = None, []
        if seqs:
            logits = self._sampling_logits(out, sampling)
            tokens, logits = self.runner.sample_on_device(logits, seqs)
            logprobs = self.runner.logprobs(logits, tokens, seqs)  # syncs only when a request asked
        committed = []
        for i, item in enumerate(batch):
            self._count_prompt(item, out, i)
            committed.append(self._commit(item.seq, range(item.num_tokens), out, i))
        self._observe(out, committed)
        for row, seq in enumerate(seqs):
            seq.num_pending += 1
            seq.pending_row = row
        self.runner.publish(tokens)
        flight = InFlight(seqs, tokens, logprobs, decoding=self._decoding_only(batch), alone=alone,
                          batch_size=len(batch), started=started)
        if seqs:
            self._flip = 1 - self._flip  # two host buffers: one being read, one being filled
            flight.start_copy(self.host_buffers[self._flip], self.copy_events[self._flip])
        return flight

    def _resolve(self, flight: "InFlight") -> list[RequestOutput]:
        """Read an in-flight step's tokens and apply them: stop checks, outputs, releases."""
        if self.inflight is flight:
            self.inflight = None
        self.runner.release(flight.tokens)
        outputs, finished = [], []
        for seq, token, logprob in zip(flight.seqs, flight.host_tokens(), flight.logprobs):
            seq.num_pending -= 1
            if seq.finished:  # stopped (or aborted) while this step ran: its token is dropped
                continue
            self.stats.num_generation_tokens += seq.append_tokens([token], [logprob] if logprob else None)
            outputs.append(self._output(seq))
            if seq.finished:
                finished.append(seq)
        self._finish(finished)
        return outputs

    def _decoding_only(self, batch: list[ScheduledSeq]) -> bool:
        return self.spec is not None and all(
            item.seq.num_computed_tokens > item.seq.num_prompt_tokens or item.draft is not None for item in batch)

    @staticmethod
    def _sampling_logits(out: ForwardOutput, items: list[int]) -> torch.Tensor:
        """[rows, vocab]: the logits rows of these batch items, in order (a view when contiguous): one
        per sampling item, one per node of a draft."""
        rows = [r for i in items for r in out.rows[i]]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return out.logits[rows[0]:rows[0] + len(rows)]
        return out.logits[to_device(rows, torch.long, out.logits.device)]

    def _apply(self, batch: list[ScheduledSeq], out: ForwardOutput) -> list[RequestOutput]:
        plain = [i for i, item in enumerate(batch) if item.draft is None and item.samples]
        sampled = dict(zip(plain, self.runner.sample(self._sampling_logits(out, plain),
                                                     [batch[i].seq for i in plain]))) if plain else {}
        drafted = [i for i, item in enumerate(batch) if item.draft is not None]
        verdicts = self._verify(batch, drafted, out) if drafted else {}
        outputs, finished, committed = [], [], []
        for i, item in enumerate(batch):
            seq = item.seq
            self._count_prompt(item, out, i)
            if item.draft is not None:
                verdict, logprobs = verdicts[i]
                committed.append(self._commit(seq, verdict.path, out, i))
                tokens = verdict.tokens
            else:
                committed.append(self._commit(seq, range(item.num_tokens), out, i))
                if i not in sampled:
                    continue
                token, logprob = sampled[i]
                tokens, logprobs = [token], ([logprob] if logprob is not None else None)
            self.stats.num_generation_tokens += seq.append_tokens(tokens, logprobs)
            outputs.append(self._output(seq))
            if seq.finished:
                finished.append(seq)
            elif item.draft is not None:
                self.blocks.truncate(seq, seq.num_tokens)
        self._observe(out, committed)
        self._finish(finished)
        return outputs

    def _count_prompt(self, item: ScheduledSeq, out: ForwardOutput, i: int) -> None:
        """Count batch item i's prompt tokens, and keep their logprobs when it asked (`prompt_logprobs`)."""
        seq = item.seq
        self.stats.num_prompt_tokens += max(0, min(item.num_tokens, seq.num_prompt_tokens - seq.num_computed_tokens))
        if out.prompt_logprobs and i in out.prompt_logprobs:
            seq.prompt_logprobs.extend(out.prompt_logprobs[i])

    def _finish(self, finished: list[Sequence]) -> None:
        """Release finished requests (their complete blocks stay cached, draft state included)."""
        if finished and self.spec is not None:
            if self.blocks.enabled:
                self.spec.flush(finished, [self.blocks.num_cached_blocks(seq) for seq in finished])
            self.spec.retire(finished)
        for seq in finished:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)

    def _commit(self, seq: Sequence, nodes, out: ForwardOutput, i: int) -> tuple[Sequence, Union[range, list[int]]]:
        """The KV of these of the item's tokens is now part of seq; returns (seq, the rows of the step's
        tokens committed), for `_observe`."""
        seq.num_computed_tokens += len(nodes)
        first = out.token_offsets[i]
        if (isinstance(nodes, range) and nodes.start == 0) or list(nodes) == list(range(len(nodes))):
            return seq, range(first, first + len(nodes))
        return seq, [first + n for n in nodes]

    def _observe(self, out: ForwardOutput, committed: list) -> None:
        """Tell the proposer, once per step, which auxiliary rows each sequence committed."""
        if self.spec is not None:
            self.spec.observe(out.aux, committed, out.inputs)

    def _verify(self, batch: list[ScheduledSeq], drafted: list[int], out: ForwardOutput) -> dict:
        """Verify every draft of the step at once; per batch index: (its verdict, its tokens' logprobs)."""
        n = batch[drafted[0]].draft.size
        logits = self._sampling_logits(out, drafted).view(len(drafted), n, -1)  # [B, N, vocab]
        # penalties, logit_bias, min_tokens, grammars: applied at each node as a plain step would (logprobs too)
        logits = process_drafts([batch[i].seq for i in drafted], [batch[i].draft for i in drafted], logits)
        results = self.spec.accept([batch[i].seq for i in drafted], [batch[i].draft for i in drafted], logits,
                                   self.shape)
        return dict(zip(drafted, results))

    def _output(self, seq: Sequence) -> RequestOutput:
        new_ids, new_text = seq.take_new_output()
        return RequestOutput.of(seq, new_ids, new_text)
