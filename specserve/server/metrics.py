"""Prometheus metrics for /metrics, named like vLLM's with a `specserve:` prefix.

Each server has its own CollectorRegistry. Request histograms are observed as outputs reach the server;
engine counters (tokens, speculation) are read from `engine.stats` at scrape time on the event loop
thread, without locking: they are plain ints the engine thread only ever increases.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput
from .streams import OutputStream

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000


class EngineCollector:
    """Engine gauges and counters, read when Prometheus scrapes (nothing while the model loads)."""

    def __init__(self, engine: Callable[[], Optional[AsyncEngine]], model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        if engine is None:
            return
        core = engine.engine
        for kind, name, doc, value in engine_values(core):
            family = kind(f"specserve:{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family
        per_pos = CounterMetricFamily("specserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position",
                                      labels=[*self.labels, "position"])
        for position, count in enumerate(list(core.stats.spec.accepted_per_position)):
            per_pos.add_metric([*self.labels.values(), str(position)], count)
        yield per_pos
        yield self._lora(core)
        if core.spec is not None:
            yield from self._controller(core.spec.controller.explain())

    def _lora(self, core) -> Metric:
        """vLLM's lora_requests_info: the adapters of the running and the waiting requests as labels
        (comma-separated), and how many may be loaded (max_loras); its value the time of the scrape."""
        names = {adapter.slot: name for name, adapter in dict(core.loras).items()}
        info = GaugeMetricFamily("specserve:lora_requests_info", "LoRA adapters of the running and waiting "
                                 "requests", labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        running, waiting = ({names[s.lora] for s in list(queue) if s.lora in names}
                            for queue in (core.scheduler.running, core.scheduler.waiting))
        info.add_metric([",".join(sorted(running)), ",".join(sorted(waiting)), str(core.config.lora.max_loras or 0)],
                        time.time())
        return info

    def _controller(self, explained: dict) -> Iterator[Metric]:
        """The speculation controller's choice per batch bucket (see Controller.explain)."""
        names = [*self.labels, "bucket"]
        k = GaugeMetricFamily("specserve:spec_decode_chosen_k", "Draft tokens per request the controller chose, "
                              "per batch-size bucket", labels=names)
        share = GaugeMetricFamily("specserve:spec_decode_exploration_ratio", "Share of a bucket's steps spent "
                                  "on shapes other than the chosen one (tries and probes)", labels=names)
        goodput = GaugeMetricFamily("specserve:spec_decode_predicted_goodput", "Output tokens/s the controller "
                                    "predicts for each measured shape, per bucket", labels=[*names, "shape"])
        for b, bucket in explained.get("buckets", {}).items():
            labels = [*self.labels.values(), str(b)]
            if bucket["k"] is not None:
                k.add_metric(labels, bucket["k"])
            share.add_metric(labels, bucket["exploration_share"])
            for shape, value in bucket["predicted_goodput"].items():
                goodput.add_metric([*labels, shape], value)
        yield from (k, share, goodput)


def engine_values(core) -> list[tuple[type, str, str, float]]:
    """(kind, name, help, value) of each single-valued engine metric."""
    stats, spec, cache, host = core.stats, core.stats.spec, core.stats.prefix_cache, core.blocks.host
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    return [
        (gauge, "num_requests_running", "Requests running in the engine", len(core.scheduler.running)),
        (gauge, "num_requests_waiting", "Requests waiting to be scheduled", len(core.scheduler.waiting)),
        (gauge, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", core.blocks.usage),
        (counter, "prompt_tokens", "Prompt tokens computed", stats.num_prompt_tokens),
        (counter, "generation_tokens", "Output tokens generated", stats.num_generation_tokens),
        (counter, "num_preemptions", "Requests preempted", stats.num_preemptions),
        (counter, "engine_steps", "Engine steps run", stats.num_steps),
        (counter, "engine_step_seconds", "Wall seconds the engine spent inside its steps (against the server's "
         "uptime: how busy the engine thread is)", stats.step_seconds),
        (counter, "spec_decode_num_drafts", "Speculative verifies (one per request)", spec.num_drafts),
        (counter, "spec_decode_num_draft_tokens", "Draft tokens proposed", spec.num_draft_tokens),
        (counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens),
        (gauge, "spec_decode_k", "Draft tokens per request chosen for the latest step", spec.last_k),
        (counter, "prefix_cache_queries", "Tokens looked up in the prefix cache (every token of a request when "
         "it is admitted)", cache.num_queries),
        (counter, "prefix_cache_hits", "Tokens served from the prefix cache (device and host pools)",
         cache.num_hits),
        (counter, "prefix_cache_host_hits", "Tokens served from the host KV pool (copied back to the device)",
         cache.num_host_hits),
        (counter, "kv_evicted_blocks", "Cached KV blocks evicted from the device pool", cache.num_evicted_blocks),
        (counter, "kv_host_saved_blocks", "KV blocks copied to the host pool", cache.num_host_saved_blocks),
        (counter, "kv_host_loaded_blocks", "KV blocks copied back from the host pool", cache.num_host_loaded_blocks),
        (gauge, "kv_host_usage_perc", "Fraction of host KV pool slots in use (0-1)",
         host.usage if host is not None else 0.0),
    ]


class StepClock:
    """When the engine's steps end, as the server sees them. The outputs of one engine step reach the event
    loop together and are handled before its next turn: the first of such a burst marks the step's end,
    which is also when the engine began its next step."""

    def __init__(self):
        self.latest = self.previous = float("-inf")  # the latest burst, the one before it
        self._in_burst = False

    def tick(self, now: float) -> None:
        """An output reached the server at `now`."""
        if not self._in_burst:
            self._in_burst = True
            self.previous, self.latest = self.latest, now
            asyncio.get_running_loop().call_soon(self._end_burst)

    def _end_burst(self) -> None:
        self._in_burst = False


class ServerMetrics:
    """The server's registry: request latencies observed here, engine counters collected at scrape time.

    Per request, as vLLM: queue time (arrival to scheduled), prefill time (scheduled to first token), decode
    time (first to last token), prompt and generation tokens, and the finish reason, "abort" included. The
    engine's outputs do not say when a request was scheduled: the server takes the start of the step that
    gave its first token (the end of the step before it, or the arrival when the engine was idle). With
    chunked prefill the chunks before the last count as queue time. Aborted requests are observed with what
    they got; those aborted before their first token have no queue, prefill or decode time.
    """

    def __init__(self, model_name: str, engine: Callable[[], Optional[AsyncEngine]],
                 clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.clock = clock
        self.steps = StepClock()

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"specserve:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between outputs of a request")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last output")
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to scheduling (estimated)")
        self.prefill = histogram("request_prefill_time_seconds", "Time from scheduling to the first token")
        self.decode = histogram("request_decode_time_seconds", "Time from the first to the last token")
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Output tokens per request", TOKEN_BUCKETS)
        self._finished = Counter("specserve:request_success", "Requests finished, by finish reason",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def on_output(self, stream: OutputStream, out: RequestOutput) -> None:
        """Observe one output as it reaches the server."""
        now = self.clock()
        self.steps.tick(now)
        times = stream.times
        if out.new_token_ids:
            if times.first_token is None:
                times.first_token = now
                times.scheduled = max(times.arrival, self.steps.previous)
                self.ttft.observe(now - times.arrival)
            else:
                self.itl.observe(now - times.last_token)
            times.last_token = now
        times.num_output_tokens = out.num_output_tokens
        if out.finished:
            self._ended(stream, out.finish_reason, now)

    def on_abort(self, stream: OutputStream) -> None:
        """The request ended without a finished output (the server aborted it or its client left)."""
        self._ended(stream, "abort", self.clock())

    def _ended(self, stream: OutputStream, reason: str, now: float) -> None:
        times = stream.times
        self._finished.labels(self._model_name, reason).inc()
        self.e2e.observe(now - times.arrival)
        self.prompt_tokens.observe(stream.num_prompt_tokens)
        self.generation_tokens.observe(times.num_output_tokens)
        if times.first_token is not None:
            self.queue.observe(times.scheduled - times.arrival)
            self.prefill.observe(times.first_token - times.scheduled)
            self.decode.observe(times.last_token - times.first_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)
