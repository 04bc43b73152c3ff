"""Process lifetime of `specserve serve`.

Bind at once and answer /health with 503 while the model loads and warms up in the background; serve;
on SIGTERM or SIGINT drain: refuse new requests with 503, let those in flight finish for up to
`shutdown_timeout` seconds, abort the rest (a stream then ends with finish_reason "abort"), and exit 0.
A second signal aborts at once. User mistakes found at start-up end it with one line and no traceback: a
port that cannot be bound (a ConfigError from `run`), a missing model folder or a bad option (checked by
`specserve serve` before it calls `run`). A model that fails to load exits 1; an engine that fails while
serving turns /health to 503 and ends every request with a 500 error. An engine that lost a
tensor-parallel rank cannot recover: the server also ends (its other ranks with it) and exits 1, so a
supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from typing import Optional

import uvicorn

from ..config import ConfigError, EngineConfig
from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.sequence import RequestOptions
from ..sampling_params import SamplingParams
from .app import build_app
from .middleware import AccessLog
from .options import ServerOptions
from .state import Phase, ServerState, engine_failure

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "specserve-default"
WATCH_INTERVAL_S = 0.5  # how often the engine's health is checked while serving
SEND_GRACE_S = 5.0  # after the drain: time for the last responses to reach their clients


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal starts specserve's drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame) -> None:
        self._on_signal(sig)


async def warm_up(engine: AsyncEngine) -> None:
    """One tiny request through the whole engine path, so the first client does not pay for it (under a cache
    salt of its own: what it says is nobody's, neither cached prefix nor NGRAM history)."""
    ids = (engine.engine.tokenize("Hello") if engine.tokenizer is not None else []) or [0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    async for _ in engine.generate(ids, params, "warm-up", RequestOptions(cache_salt="specserve warm-up")):
        pass


async def watch_engine(state: ServerState, interval: float = WATCH_INTERVAL_S, on_rank_lost=None) -> None:
    """Once the engine has failed, end every request in flight with the error, so none waits forever
    (new requests are refused by `ServerState.serving_engine`); call `on_rank_lost()` once a
    tensor-parallel rank is known to be gone."""
    engine = state.engine
    while engine.healthy:
        await asyncio.sleep(interval)
    reason = engine_failure(engine)
    log.error("the engine failed (%s): /health turns 503 and requests get 500", reason)
    error = EngineDeadError(f"the engine failed: {reason}")
    while True:
        state.requests.fail_all(error)
        if on_rank_lost is not None and engine.rank_failure is not None:
            on_rank_lost()
            on_rank_lost = None
        await asyncio.sleep(interval)


class Lifecycle:
    """Starts the engine, watches it, and drains and stops the server on signals."""

    def __init__(self, state: ServerState, engine_config: EngineConfig):
        self.state = state
        self.engine_config = engine_config
        self.server: Optional[uvicorn.Server] = None
        self.exit_code = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._start_task: Optional[asyncio.Task] = None
        self._watch_task: Optional[asyncio.Task] = None
        self._drain_task: Optional[asyncio.Task] = None
        self._stopping = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._loop = asyncio.get_running_loop()
        self._start_task = asyncio.create_task(self._start())
        try:
            yield
        finally:
            await self._stop()

    # ---- start ------------------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            engine = await asyncio.to_thread(AsyncEngine, self.engine_config)
            self.state.attach(engine)
            if self._stopping:
                return
            await warm_up(engine)
        except Exception as e:
            user_mistake = isinstance(e, (ConfigError, FileNotFoundError))  # no traceback for those
            log.error("the model could not be loaded: %s", e, exc_info=None if user_mistake else e)
            self.state.startup_error = e
            self.state.phase = Phase.FAILED
            self.exit_code = 1
            self.server.should_exit = True
            return
        if self.state.phase is Phase.STARTING:
            self.state.phase = Phase.SERVING
            log.info("ready: serving %r", self.state.model_name)
        self._watch_task = asyncio.create_task(watch_engine(self.state, on_rank_lost=self._rank_lost))

    def _rank_lost(self) -> None:
        log.error("a tensor-parallel rank is gone (%s): exiting 1", self.state.engine.rank_failure)
        self.exit_code = 1
        self.server.should_exit = True

    # ---- signals and drain ------------------------------------------------------------------------
    def on_signal(self, sig: int) -> None:
        """Runs inside the signal handler: hand over to the event loop."""
        if self._loop is None:
            self.server.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._signalled, sig)

    def _signalled(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            log.info("%s: draining (up to %.1f s for requests in flight)", name, self.state.options.shutdown_timeout)
            self._drain_task = asyncio.create_task(self._drain())
        else:
            log.warning("%s again: aborting requests in flight now", name)
            self._abort_in_flight()
            self.server.should_exit = True

    async def _drain(self) -> None:
        if self.state.phase is Phase.SERVING:
            self.state.phase = Phase.DRAINING
            if not await self.state.requests.wait_empty(self.state.options.shutdown_timeout):
                log.warning("shutdown timeout: aborting %d requests in flight", len(self.state.requests))
                self._abort_in_flight()
        self.server.should_exit = True

    def _abort_in_flight(self) -> None:
        if self.state.requests is not None:
            self.state.requests.abort_all("the server is shutting down")

    # ---- stop -------------------------------------------------------------------------------------
    async def _stop(self) -> None:
        self._stopping = True
        for task in (self._watch_task, self._drain_task):
            if task is not None:
                task.cancel()
        if self._start_task is not None:
            await asyncio.gather(self._start_task, return_exceptions=True)  # a load cannot be interrupted
        self._abort_in_flight()
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.shutdown)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, before the model loads, so that a taken port fails at once; a
    ConfigError that names the port and the flag to change when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?): choose another "
                              f"port with --port") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}: check --host and --port") from None
    sock.set_inheritable(True)
    return sock


def run(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGTERM or SIGINT. Returns the exit code: 0, or 1 when the model failed to load. Raises
    ConfigError at once when the port cannot be bound."""
    sock = listen(options.host, options.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(options, options.served_model_name or engine_config.model.model or DEFAULT_MODEL_NAME)
    lifecycle = Lifecycle(state, engine_config)
    app = build_app(state, lifespan=lifecycle.lifespan)
    config = uvicorn.Config(AccessLog(app) if options.access_log else app, host=options.host, port=options.port,
                            http="h11", loop="asyncio", lifespan="on", access_log=False,
                            timeout_graceful_shutdown=SEND_GRACE_S)
    server = _Server(config, lifecycle.on_signal)
    lifecycle.server = server
    log.info("listening on http://%s:%d, serving %r", options.host, sock.getsockname()[1], state.model_name)
    server.run(sockets=[sock])
    return lifecycle.exit_code
