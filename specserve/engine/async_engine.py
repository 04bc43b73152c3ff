"""An engine that runs in a background thread and streams to asyncio callers (used by the server).

Callers `submit` a request and iterate its `RequestOutput`s; cancelling the iteration (a client that
went away) aborts the request and frees its KV at once. A failure inside a step is fatal: every stream
gets the error, `healthy` turns False, and new requests are refused. It is never silently retried. A lost
tensor-parallel rank (`rank_failure`) is fatal too, even while no step runs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Optional

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from .engine import LLMEngine
from .outputs import Prompt, RequestOutput
from .sequence import RequestOptions

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.error: Optional[BaseException] = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.engine: Optional[LLMEngine] = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, built), name="specserve-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self.engine is None:
            raise self.error

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and self.rank_failure is None

    @property
    def rank_failure(self) -> Optional[str]:
        """Why a tensor-parallel rank is gone, or None; the engine cannot recover from it."""
        return self.engine.runner.failure

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- caller side (event loop thread) ------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: Optional[str] = None,
                       options: RequestOptions = RequestOptions()) -> AsyncIterator[RequestOutput]:
        """Validate, submit and stream one request (options: its adapter and priority). Validation errors raise
        before anything runs."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.engine.tokenize(prompt)
        self.engine.check_prompt(ids)
        self.engine.check_options(options)
        params.validate()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._command(("add", ids, params, request_id, options))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Rejected):  # the engine refused the request itself: its caller's error
                    raise item.error
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._command(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    async def call(self, fn, *args):
        """fn(*args) run in the engine thread between two steps (what changes the engine's state: loading an
        adapter); its result, or its exception raised here."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._command(("call", fn, args, loop, future))
        return await future

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    def _command(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, ids, params, request_id, options = cmd
                try:
                    self.engine.add_request(ids, params, request_id, options)
                except ValueError as e:  # what only add_request checks (a grammar that does not compile, ...)
                    self._deliver(request_id, Rejected(e))
            elif cmd[0] == "call":
                _, fn, args, loop, future = cmd
                try:
                    outcome = (future.set_result, fn(*args))
                except Exception as e:
                    outcome = (future.set_exception, e)
                loop.call_soon_threadsafe(_settle, future, *outcome)
            else:  # a reader still listening gets the request's output so far, finished with reason "abort"
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver(cmd[1], out)

    def _run(self, config: EngineConfig, built: threading.Event) -> None:
        """Build the engine here, the thread that steps it: torch's CPU workers (OpenMP) belong to the thread
        that starts them, and a second thread's set beside this one's makes all of them sleep between
        operations instead of spinning (a chain step ~1.3x slower on a 2-core CPU)."""
        try:
            self.engine = LLMEngine(config)
        except BaseException as e:
            self.error = e
            return
        finally:
            built.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # fatal: fail every stream, refuse new work
            log.exception("engine step failed")
            self.error = e
            self.engine.close()  # other tensor-parallel ranks may wait inside the failed step: end them
            for request_id in list(self._streams):
                self._deliver(request_id, e)


class Rejected:
    """A request add_request refused (error: its ValueError, for the caller to raise): not an engine failure."""

    def __init__(self, error: ValueError):
        self.error = error


def _settle(future: asyncio.Future, setter, value) -> None:
    """Set a call's outcome, unless its caller has gone (the future was cancelled)."""
    if not future.done():
        setter(value)
