"""What the routes share: the options, the engine once it is loaded, the requests in flight, the metrics,
and the server's phase (starting -> serving -> draining, or failed)."""
from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Optional

from .. import __version__
from ..engine.async_engine import AsyncEngine
from ..engine.sequence import RequestOptions
from .errors import APIError, bad_request, server_error, unavailable
from .formatting import TokenText
from .metrics import ServerMetrics
from .options import ServerOptions
from .response_store import ResponseStore
from .streams import RequestRegistry


def engine_failure(engine: AsyncEngine) -> str:
    """Why a stopped engine stopped."""
    if engine.rank_failure is not None:
        return engine.rank_failure
    return repr(engine.error) if engine.error is not None else "the engine thread stopped"


class Phase(enum.Enum):
    STARTING = "starting"  # loading and warming the model
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: finishing what is in flight, refusing new requests
    FAILED = "failed"  # the model could not be loaded


class ServerState:
    def __init__(self, options: ServerOptions, model_name: str):
        self.options = options
        self.model_name = model_name
        self.phase = Phase.STARTING
        self.engine: Optional[AsyncEngine] = None
        self.requests: Optional[RequestRegistry] = None
        self.token_text: Optional[TokenText] = None
        self.token_ids = TokenText(None)  # 'token_id:N' for every token
        self.startup_error: Optional[BaseException] = None
        self.metrics = ServerMetrics(model_name, lambda: self.engine)
        self.responses = ResponseStore(options.responses_store_size)
        self.background: dict[str, asyncio.Task] = {}  # background responses running, by id

    def attach(self, engine: AsyncEngine) -> None:
        """Take the loaded engine (the server starts serving once it is warmed: `phase`)."""
        capacity = engine.engine.config.scheduler.max_num_seqs + self.options.max_queued_requests
        self.requests = RequestRegistry(engine, capacity, self.metrics)
        self.token_text = TokenText(engine.tokenizer)
        self.engine = engine

    # ---- gates ----------------------------------------------------------------------------------
    def serving_engine(self) -> AsyncEngine:
        """The engine, when a new request may be served now; otherwise raises the APIError to answer."""
        if self.phase is Phase.STARTING:
            raise unavailable("the server is starting: the model is still loading")
        if self.phase is Phase.DRAINING:
            raise unavailable("the server is shutting down")
        if self.phase is Phase.FAILED:
            raise unavailable(f"the model failed to load: {self.startup_error!r}")
        if not self.engine.healthy:
            raise server_error(f"the engine has failed and serves no more requests: "
                               f"{engine_failure(self.engine)}")
        return self.engine

    @property
    def adapters(self) -> dict:
        """The LoRA adapters served beside the model, by name (engine.LoadedLoRA)."""
        return self.engine.engine.loras if self.engine is not None else {}

    def check_model(self, model: Optional[str]) -> None:
        """A request for another model (neither the served one nor one of its adapters) gets 404, as from OpenAI
        and vLLM."""
        if model is not None and model != self.model_name and model not in self.adapters:
            served = ", ".join(repr(m) for m in [self.model_name, *self.adapters])
            raise APIError(404, f"model {model!r} does not exist; this server serves {served}",
                           "not_found_error", param="model", code="model_not_found")

    def request_options(self, req) -> RequestOptions:
        """How a request (a model of protocol.py) runs: the adapter its `model` names, its `priority`."""
        lora = req.model if req.model != self.model_name and req.model in self.adapters else None
        policy = self.engine.engine.config.scheduler.scheduling_policy
        if req.priority and policy != "priority":
            raise bad_request(f"priority {req.priority} needs --scheduling-policy priority (this server schedules "
                              f"{policy})", "priority")
        return RequestOptions(lora, req.priority, req.cache_salt)

    def token_names(self, req) -> TokenText:
        """How a request's logprobs name tokens: their text, or 'token_id:N' (return_tokens_as_token_ids)."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.options.return_tokens_as_token_ids
        return self.token_ids if as_ids else self.token_text

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for /health: 200 only while serving with a healthy engine."""
        if self.phase is Phase.SERVING and self.engine.healthy:
            return 200, {"status": "ok"}
        body = {"status": self.phase.value}
        if self.phase is Phase.FAILED:
            body["error"] = repr(self.startup_error)
        elif self.engine is not None and not self.engine.healthy:
            body.update(status="failed", error=engine_failure(self.engine))
        return 503, body

    # ---- /server_info -----------------------------------------------------------------------------
    def info(self) -> dict:
        """Configuration and live statistics (speculation included) for /server_info."""
        options = dataclasses.asdict(self.options)
        options["api_key"] = "(set)" if self.options.api_key else None
        info = {"version": __version__, "model": self.model_name, "phase": self.phase.value, "server": options}
        if self.engine is None:
            return info
        core = self.engine.engine
        stats = dataclasses.asdict(core.stats)
        spec = stats.pop("spec")
        spec["mean_acceptance_length"] = core.stats.spec.mean_acceptance_length
        spec["synthetic_acceptance_rates"] = core.config.speculative.speculative_synthetic_acceptance_rates
        spec["controller"] = core.spec.controller.explain() if core.spec is not None else None
        off_loop = core.spec.off_loop if core.spec is not None else None
        spec["controller_off_loop"] = off_loop.explain() if off_loop is not None else None
        spec["proposer"] = core.spec.proposer.info() if core.spec is not None else None
        cache, blocks = core.stats.prefix_cache, core.blocks
        prefix = stats.pop("prefix_cache")
        prefix.update(enabled=blocks.enabled, hit_rate=cache.hit_rate, device_hit_rate=cache.device_hit_rate,
                      host_hit_rate=cache.host_hit_rate, cached_blocks=len(blocks.index))
        info.update(
            config=core.config.flat(),
            healthy=self.engine.healthy,
            kv_total_blocks=core.blocks.num_blocks,
            kv_free_blocks=core.blocks.num_free_blocks,
            kv_cache_usage=core.blocks.usage,
            num_requests_running=len(core.scheduler.running),
            num_requests_waiting=len(core.scheduler.waiting),
            num_requests_in_flight=len(self.requests),
            stats=stats,
            spec=spec,
            avg_spec_accept_length=core.stats.spec.mean_acceptance_length,
            prefix_cache=prefix,
            prefix_cache_hit_rate=cache.hit_rate,
            kv_host_total_blocks=blocks.host.num_slots if blocks.host is not None else 0,
            kv_host_used_blocks=blocks.host.num_used if blocks.host is not None else 0,
        )
        return info

