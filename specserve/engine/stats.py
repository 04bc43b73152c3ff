"""Counters the engine keeps for metrics, /server_info and benchmarks (read them, never reset)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Speculation counters, named after vLLM's spec_decode_* metrics.

    A draft is one verify of one request; acceptance length per draft = 1 + accepted (the bonus token).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    last_k: int = 0  # draft tokens per request chosen for the latest step (0 = plain decoding)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.append(0)
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens unless named blocks (vLLM's prefix_cache_queries / _hits).

    A query is every token of a request when it is admitted (again after a preemption); a hit is a token
    whose KV came from the cache instead of being computed, from the device pool or copied back from the
    host pool.
    """

    num_queries: int = 0
    num_hits: int = 0  # device + host
    num_host_hits: int = 0
    num_evicted_blocks: int = 0  # cached blocks evicted from the device pool (to the host pool or dropped)
    num_host_saved_blocks: int = 0  # device -> host copies
    num_host_loaded_blocks: int = 0  # host -> device copies

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    @property
    def device_hit_rate(self) -> float:
        return (self.num_hits - self.num_host_hits) / self.num_queries if self.num_queries else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.num_host_hits / self.num_queries if self.num_queries else 0.0


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    num_generation_tokens: int = 0  # output tokens delivered to requests
    num_steps: int = 0
    step_seconds: float = 0.0  # wall time spent inside LLMEngine.step
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
