"""One typed configuration for the engine.

Users pass flat options (`LLM(model=..., max_num_seqs=8)`, `--max-num-seqs 8`); each flat name belongs to
exactly one section below. `EngineConfig.from_options` rejects names it does not know, and `resolve()`
derives the settings that depend on the machine and the checkpoint once, into a new frozen object; what it
needs to know of them comes in as a `Machine`, so this module imports nothing heavier than the standard library.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional


class ConfigError(ValueError):
    """An option is unknown, has the wrong type, or contradicts another option."""


def _opt(default, help: str, choices: tuple | None = None, many: bool = False):
    """A config field; many: a comma-separated list, which the command line also takes as several words."""
    return field(default=default, metadata={"help": help, "choices": choices, "many": many})


@dataclass(frozen=True)
class ModelConfig:
    model: Optional[str] = _opt(None, "Hugging Face checkpoint folder (default: the shipped default model)")
    tokenizer: Optional[str] = _opt(None, "tokenizer folder (default: the model folder)")
    chat_template: Optional[str] = _opt(None, "a Jinja chat template, or a file holding one, in place of the "
                                              "tokenizer's (chat requests, /tokenize, generate --chat)")
    dtype: str = _opt("auto", "weights and activations dtype", ("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "device to run on", ("auto", "cpu", "cuda"))
    load_format: str = _opt("safetensors", "where weights come from", ("safetensors", "dummy"))
    max_model_len: Optional[int] = _opt(None, "longest prompt + output in tokens (default: from config.json)")
    seed: int = _opt(0, "seed for dummy weights and unseeded sampling")
    max_logprobs: int = _opt(20, "most top log-probabilities a request may ask for a token (logprobs, top_logprobs, "
                                 "prompt_logprobs, top_logprobs_num), as vLLM's; -1: the whole vocabulary")
    generation_config: str = _opt("auto", "where sampling defaults and end tokens come from: 'auto' = the model "
                                          "folder's generation_config.json (as vLLM), 'vllm' = none, or a folder "
                                          "holding one")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA options. Each targeted layer reserves room for max_loras adapters of up to max_lora_rank at
    start-up, so that loading one moves no tensor and CUDA graphs serve adapter rows."""

    lora_modules: Optional[str] = _opt(None, "LoRA adapters (PEFT folders) served beside the model, as name=folder, "
                                             "comma-separated; a request names one as its model", many=True)
    enable_lora: Optional[bool] = _opt(None, "reserve room for adapters (default: on when lora_modules names any; "
                                             "needed to load adapters at run time)")
    max_loras: Optional[int] = _opt(None, "adapters served at once (default: as many as lora_modules names, at "
                                          "least 1)")
    max_lora_rank: Optional[int] = _opt(None, "largest adapter rank (default: the largest of lora_modules', at "
                                              "least 16)")

    @property
    def enabled(self) -> bool:
        return bool(self.enable_lora) if self.enable_lora is not None else bool(self.modules)

    @property
    def modules(self) -> dict[str, str]:
        """The LoRA adapters: name -> folder, in the order given (slot i + 1 is the i-th)."""
        out: dict[str, str] = {}
        for entry in (self.lora_modules or "").split(","):
            if not entry.strip():
                continue
            name, sep, folder = entry.partition("=")
            name, folder = name.strip(), folder.strip()
            if not sep or not name or not folder:
                raise ConfigError(f"lora_modules entry {entry.strip()!r} is not name=folder")
            if name in out:
                raise ConfigError(f"lora_modules names {name!r} twice")
            out[name] = folder
        return out

    def validate(self) -> None:
        modules = self.modules
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"option {name} must be >= 1, got {value}")
        if self.enable_lora is False and modules:
            raise ConfigError("lora_modules given with enable_lora off")
        if self.max_loras is not None and len(modules) > self.max_loras:
            raise ConfigError(f"lora_modules names {len(modules)} adapters, more than max_loras {self.max_loras}")

    def resolved(self) -> "LoRAConfig":
        """max_loras and max_lora_rank filled in from the adapters named (their folders must exist)."""
        if not self.enabled:
            return self
        ranks = [16]
        for name, folder in self.modules.items():
            path = os.path.join(folder, "adapter_config.json")
            if not os.path.isfile(path):
                raise ConfigError(f"LoRA adapter {name!r}: {folder!r} is no adapter folder (no adapter_config.json)")
            with open(path) as f:
                rank = json.load(f).get("r")
            if isinstance(rank, int):
                ranks.append(rank)
        return replace(self, enable_lora=True, max_loras=self.max_loras or max(1, len(self.modules)),
                       max_lora_rank=self.max_lora_rank or max(ranks))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block")
    num_kv_blocks: Optional[int] = _opt(None, "KV blocks in the pool (default: from kv_cache_gb or "
                                              "gpu_memory_utilization)")
    kv_cache_gb: Optional[float] = _opt(None, "KV pool size in GiB (default: 1 on CPU, 85%% of free memory on CUDA)")
    gpu_memory_utilization: Optional[float] = _opt(None, "CUDA: the share of the GPU's memory this engine may fill, "
                                                         "weights, activations and CUDA graphs included (vLLM's); the "
                                                         "KV pool takes 85%% of what the share leaves after the "
                                                         "weights, as the default does with all free memory")
    enable_prefix_caching: bool = _opt(True, "share full KV blocks of identical prefixes between requests")
    kv_host_ratio: Optional[float] = _opt(None, "host KV pool size as a multiple of the device pool (default: 1 on "
                                                "CUDA, capped at a quarter of free host memory; 0 on CPU = off)")
    kv_host_size_gb: Optional[float] = _opt(None, "host KV pool size in GiB (overrides kv_host_ratio; 0 = off)")
    kv_host_policy: str = _opt("write_through", "when a cached block is copied to the host pool: as soon as it is "
                                                "complete, or when it is evicted from the device pool",
                               ("write_through", "write_back"))

    @property
    def host_tier_requested(self) -> bool:
        """Did the user size the host pool explicitly (to a nonzero size)?"""
        return bool(self.kv_host_size_gb) or (self.kv_host_size_gb is None and bool(self.kv_host_ratio))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(256, "most requests running at once")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    scheduling_policy: str = _opt("fcfs", "the order requests run in: fcfs = arrival; priority = each request's "
                                          "priority (lower first), then arrival", ("fcfs", "priority"))


@dataclass(frozen=True)
class ExecutionConfig:
    attention_backend: str = _opt("auto", "attention kernels: auto = triton on CUDA when installed, else torch",
                                  ("auto", "torch", "triton"))
    enforce_eager: bool = _opt(False, "run every step eagerly (no CUDA graphs)")
    cuda_graph_max_bs: Optional[int] = _opt(None, "largest batch replayed from CUDA graphs (default: max_num_seqs)")
    cuda_graph_max_tokens: int = _opt(512, "largest step with prompt chunks replayed from a mixed CUDA graph "
                                           "(0: such steps run eagerly)")
    disable_overlap_schedule: bool = _opt(False, "finish each step before preparing the next (no overlap of "
                                                 "host work with plain decode steps)")
    gemm_tuning_rows: int = _opt(128, "CUDA: half-precision products of at least this many rows take the fastest "
                                    "of cuBLASLt's candidate algorithms for their shape, timed against cuBLAS's own "
                                    "pick when CUDA graphs are captured (0 = cuBLAS's pick always)")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks")


@dataclass(frozen=True)
class SpeculativeConfig:
    """SGLang's knobs: draft depth (num_steps), children kept per node (topk; 1 = chain), and tokens
    verified per request counting the root (num_draft_tokens; a chain verifies num_steps + 1)."""

    speculative_algorithm: Optional[str] = _opt(None, "speculative decoding algorithm: EAGLE3 (a draft model) or "
                                                      "NGRAM (drafts copied from the request's own tokens: chains, "
                                                      "or with topk > 1 trees of several earlier occurrences); "
                                                      "unset = EAGLE3 with the shipped drafter when the shipped "
                                                      "model runs, else off", ("EAGLE3", "NGRAM", "none"))
    speculative_draft_model_path: Optional[str] = _opt(None, "EAGLE-3 draft checkpoint folder")
    speculative_draft_model_quantization: str = _opt(
        "auto", "the draft's weights: int8 = int8 rows with one scale each (CPU only; its products 2-3x faster there, "
                "the output unchanged: the target verifies every draft); auto = int8 on a CPU, none on CUDA",
        ("auto", "none", "int8"))
    speculative_num_steps: int = _opt(3, "draft depth S (at most S+1 tokens accepted per verify)")
    speculative_eagle_topk: int = _opt(1, "children kept per draft node; 1 = chain, >1 = tree")
    speculative_num_draft_tokens: Optional[int] = _opt(None, "tokens verified per request incl. the root "
                                                              "(default: steps+1 for a chain, 8 for a tree)")
    speculative_policy: str = _opt("adaptive", "how much to speculate each step", ("adaptive", "always", "threshold"))
    speculative_disable_batch_threshold: int = _opt(32, "threshold policy: no speculation while more requests run")
    speculative_calibration_s: Optional[float] = _opt(
        None, "adaptive policy: seconds the start-up measurement of each shape's step time may take, batch sizes "
              "1, 2, 4, ... in turn (default: 30 on CUDA, 3 on CPU; 0 = learn step times from live steps only)")
    speculative_ngram_min_match_window_size: int = _opt(1, "NGRAM: the shortest suffix of a request's tokens looked "
                                                           "up in its earlier tokens (vLLM's prompt_lookup_min)")
    speculative_ngram_max_match_window_size: int = _opt(5, "NGRAM: the longest suffix looked up, tried first "
                                                           "(vLLM's prompt_lookup_max)")
    speculative_ngram_capacity: int = _opt(1 << 20, "NGRAM: tokens of finished requests (prompt and output) kept "
                                                    "for lookups across requests, 8 bytes each (0 = a request "
                                                    "looks up its own tokens only; requests with a cache_salt "
                                                    "neither read nor add to it)")
    speculative_synthetic_acceptance_rates: Optional[tuple[float, ...]] = _opt(
        None, "benchmarks only: accept drafts at these per-position rates instead of verifying them (entry i = "
              "probability that the first i+1 drafts are accepted; one per draft step; output text is meaningless)")
    speculative_synthetic_chain_rates: Optional[tuple[float, ...]] = _opt(
        None, "benchmarks only: with a tree configured, the rates its chain candidates (adaptive policy) accept at, "
              "one per draft step (default: the tree's rates; a chain accepts less than a tree of the same drafter)")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm not in (None, "none")

    def validate(self) -> None:
        s, k, n = self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if s < 1 or k < 1:
            raise ConfigError(f"speculative_num_steps ({s}) and speculative_eagle_topk ({k}) must be >= 1")
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ConfigError(f"the n-gram match windows must satisfy 1 <= min ({low}) <= max ({high})")
        if self.speculative_ngram_capacity != 0 and self.speculative_ngram_capacity < 1024:
            raise ConfigError(f"speculative_ngram_capacity must be 0 (off) or >= 1024 tokens, got "
                              f"{self.speculative_ngram_capacity}")
        if self.speculative_algorithm == "NGRAM":
            if self.speculative_draft_model_path:
                raise ConfigError("NGRAM needs no speculative_draft_model_path (its drafts come from the request's "
                                  "own tokens)")
        for name in ("speculative_synthetic_acceptance_rates", "speculative_synthetic_chain_rates"):
            if getattr(self, name) is not None:
                self._validate_rates(name, getattr(self, name))
        if self.speculative_synthetic_chain_rates is not None and self.speculative_synthetic_acceptance_rates is None:
            raise ConfigError("speculative_synthetic_chain_rates needs speculative_synthetic_acceptance_rates")
        if n is None:
            return
        if k == 1 and n != s + 1:
            raise ConfigError(f"with speculative_eagle_topk 1 (a chain) speculative_num_draft_tokens must be "
                              f"speculative_num_steps + 1 = {s + 1}, got {n}")
        most = 1 + k + (s - 1) * k * k
        if not 2 <= n <= most:
            raise ConfigError(f"speculative_num_draft_tokens {n} must be in [2, {most}] for "
                              f"{s} steps with topk {k}")

    def _validate_rates(self, name: str, rates: tuple[float, ...]) -> None:
        depth = self.speculative_num_steps
        if len(rates) != depth:
            raise ConfigError(f"{name} has {len(rates)} entries; it needs one per draft step "
                              f"(speculative_num_steps = {depth})")
        if any(not 0.0 <= r <= 1.0 for r in rates):
            raise ConfigError(f"{name} must lie in [0, 1], got {list(rates)}")
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ConfigError(f"{name} must be non-increasing (entry i is the probability that the first i+1 "
                              f"drafts are all accepted), got {list(rates)}")

    def resolved(self, device: str) -> "SpeculativeConfig":
        budget = self.speculative_calibration_s
        if budget is None:
            budget = 30.0 if device == "cuda" else 3.0
        if budget < 0:
            raise ConfigError(f"speculative_calibration_s must be >= 0, got {budget}")
        quantization = self.speculative_draft_model_quantization
        if quantization == "auto":
            quantization = "int8" if device == "cpu" else "none"
        if quantization == "int8" and device != "cpu":
            raise ConfigError("speculative_draft_model_quantization 'int8' runs on a CPU only (torch's int8 "
                              f"weight-only kernel); the device is {device}")
        n = self.speculative_num_draft_tokens
        if n is None:
            n = self.speculative_num_steps + 1 if self.speculative_eagle_topk == 1 else \
                min(8, 1 + self.speculative_eagle_topk
                    + (self.speculative_num_steps - 1) * self.speculative_eagle_topk ** 2)
        return replace(self, speculative_num_draft_tokens=n, speculative_calibration_s=float(budget),
                       speculative_draft_model_quantization=quantization)


GENERATION_CONFIG = "generation_config.json"

SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "execution": ExecutionConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "lora": LoRAConfig,
}


def option_table() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat option name -> (section name, dataclass field)."""
    table: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in table, f"option {f.name} defined twice"
            table[f.name] = (section, f)
    return table


def _check_type(name: str, value: Any, f: dataclasses.Field) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"option {name} may not be None")
    base = kind.replace("Optional[", "").rstrip("]")
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "str":
        ok = isinstance(value, str)
    elif base.startswith("tuple"):  # numbers, as a list or "0.8,0.6" (the command line)
        if isinstance(value, str):
            try:
                value = [float(x) for x in value.split(",") if x.strip()]
            except ValueError:
                raise ConfigError(f"option {name} expects comma-separated numbers, got {value!r}") from None
        ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        value = tuple(float(x) for x in value) if ok else value
    else:
        ok = True
    if not ok:
        what = "a list of numbers" if base.startswith("tuple") else base
        raise ConfigError(f"option {name} expects {what}, got {type(value).__name__} {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"option {name}={value!r} is not one of {', '.join(map(str, choices))}")
    return value


@dataclass(frozen=True)
class Machine:
    """What `EngineConfig.resolve` reads beyond the options: this machine and the checkpoints on it.

    `specserve.engine.machine.this_machine()` gathers it, so that this module imports neither torch nor the
    model code. The callables are asked only when resolve reaches the step that needs them (a missing
    model folder is reported before its config.json is read, Triton is looked for only on CUDA).
    """

    default_model: str  # the folder used when no model is given
    default_draft: Optional[str]  # the shipped drafter, None when there is none
    cuda_available: bool  # torch sees a CUDA device
    triton_available: Callable[[], bool]  # the Triton attention kernels can be used
    max_positions: Callable[[str], int]  # a model folder's longest exact context (engine/machine.py)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        table = option_table()
        per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for name, value in options.items():
            if name not in table:
                close = difflib.get_close_matches(name, table, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown option {name!r}{hint}")
            section, f = table[name]
            per_section[section][name] = _check_type(name, value, f)
        config = cls(**{s: SECTIONS[s](**kw) for s, kw in per_section.items()})
        config.validate()
        return config

    def validate(self) -> None:
        positive = {
            "block_size": self.cache.block_size,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ConfigError(f"option {name} must be >= 1, got {value}")
        if self.execution.cuda_graph_max_bs is not None and self.execution.cuda_graph_max_bs < 1:
            raise ConfigError(f"option cuda_graph_max_bs must be >= 1, got {self.execution.cuda_graph_max_bs}")
        for name in ("cuda_graph_max_tokens", "gemm_tuning_rows"):
            if getattr(self.execution, name) < 0:
                raise ConfigError(f"option {name} must be >= 0, got {getattr(self.execution, name)}")
        if self.cache.num_kv_blocks is not None and self.cache.num_kv_blocks < 1:
            raise ConfigError(f"option num_kv_blocks must be >= 1, got {self.cache.num_kv_blocks}")
        utilization = self.cache.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ConfigError(f"option gpu_memory_utilization must be in (0, 1], got {utilization}")
        sizes = [name for name in ("num_kv_blocks", "kv_cache_gb", "gpu_memory_utilization")
                 if getattr(self.cache, name) is not None]
        if len(sizes) > 1:
            raise ConfigError(f"options {' and '.join(sizes)} both size the KV pool: give one")
        for name in ("kv_host_ratio", "kv_host_size_gb"):
            value = getattr(self.cache, name)
            if value is not None and value < 0:
                raise ConfigError(f"option {name} must be >= 0, got {value}")
        if self.cache.host_tier_requested and not self.cache.enable_prefix_caching:
            raise ConfigError("a host KV pool (kv_host_ratio / kv_host_size_gb) needs enable_prefix_caching")
        self.speculative.validate()
        if self.speculative.speculative_draft_model_path and not self.speculative.enabled:
            raise ConfigError("speculative_draft_model_path given without speculative_algorithm='EAGLE3'")
        self.lora.validate()
        if self.model.max_model_len is not None and self.model.max_model_len < 2:
            raise ConfigError(f"option max_model_len must be >= 2, got {self.model.max_model_len}")
        if self.model.max_logprobs < -1:
            raise ConfigError(f"option max_logprobs must be >= 0, or -1 for the whole vocabulary, got "
                              f"{self.model.max_logprobs}")

    def resolve(self, machine: Machine) -> "EngineConfig":
        """Fill in what depends on the machine (as `machine` describes it): model path, device, dtype, attention
        backend, maximum length, the draft."""
        m = self.model
        model = m.model or machine.default_model
        if not os.path.isdir(model):
            raise FileNotFoundError(f"model folder {model!r} does not exist")
        device = m.device
        if device == "auto":
            device = "cuda" if machine.cuda_available else "cpu"
        if device == "cuda" and not machine.cuda_available:
            raise ConfigError("device='cuda' asked for but torch sees no CUDA device")
        dtype = m.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        longest = machine.max_positions(model)
        max_len = m.max_model_len or longest
        if max_len > longest:
            raise ConfigError(f"max_model_len {max_len} exceeds the model's longest context {longest} "
                              f"(max_position_embeddings, or its sliding_window: specserve has no sliding-window "
                              f"attention)")
        if not self.scheduler.enable_chunked_prefill and self.scheduler.max_num_batched_tokens < max_len:
            raise ConfigError(f"without chunked prefill max_num_batched_tokens "
                              f"({self.scheduler.max_num_batched_tokens}) must be >= max_model_len ({max_len})")
        execution = self.execution
        backend = execution.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" and machine.triton_available() else "torch"
        if backend == "triton" and device != "cuda":
            raise ConfigError("attention_backend 'triton' needs device 'cuda'")
        if self.cache.gpu_memory_utilization is not None and device != "cuda":
            raise ConfigError(f"gpu_memory_utilization sizes the KV pool from a GPU's memory; the device is {device}: "
                              f"give kv_cache_gb (GiB) or num_kv_blocks")
        execution = replace(execution, attention_backend=backend,
                            cuda_graph_max_bs=execution.cuda_graph_max_bs or self.scheduler.max_num_seqs)
        generation = m.generation_config
        if generation not in ("auto", "vllm") and not os.path.isfile(os.path.join(generation, GENERATION_CONFIG)):
            raise ConfigError(f"generation_config {generation!r} is not a folder holding {GENERATION_CONFIG} "
                              f"(or 'auto', 'vllm')")
        model_cfg = replace(m, model=model, tokenizer=m.tokenizer or model, device=device, dtype=dtype,
                            max_model_len=max_len, generation_config=model if generation == "auto" else generation)
        spec = self.speculative
        if spec.speculative_algorithm is None and m.model is None and machine.default_draft is not None:
            spec = replace(spec, speculative_algorithm="EAGLE3")  # the shipped pair speculates by default
        if spec.speculative_algorithm == "NGRAM":
            spec = spec.resolved(device)
        elif spec.enabled:
            draft = spec.speculative_draft_model_path or (machine.default_draft if m.model is None else None)
            if draft is None:
                raise ConfigError("speculative_algorithm EAGLE3 needs speculative_draft_model_path")
            if not os.path.isdir(draft):
                raise FileNotFoundError(f"draft model folder {draft!r} does not exist")
            spec = replace(spec.resolved(device), speculative_draft_model_path=draft)
        elif spec.speculative_synthetic_acceptance_rates is not None:
            raise ConfigError("speculative_synthetic_acceptance_rates given without speculative decoding")
        return replace(self, model=model_cfg, execution=execution, speculative=spec, lora=self.lora.resolved())

    def flat(self) -> dict[str, Any]:
        """All options by flat name (for /server_info and logs)."""
        out = {}
        for section in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, section)))
        return out
