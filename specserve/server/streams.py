"""One request's outputs on the server side, and the set of requests in flight.

A pump task iterates the engine's stream for the request and queues what arrives, so the request can be
ended from outside (shutdown, engine failure) by cancelling the pump: its only await is on the engine, and
cancelling it there closes the engine's stream, which aborts the request and frees its KV at once. The
handler reading the queue closes the stream when it stops early (a client that went away). An observer
(the metrics) sees every output and every request that ends without a finished output (an abort).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Protocol

from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.outputs import RequestOutput
from ..engine.sequence import RequestOptions
from ..sampling_params import SamplingParams
from .errors import APIError


class RequestAborted(Exception):
    """The server ended the request before it finished (the message says why)."""


@dataclass
class RequestTimes:
    """What the server saw of one request (time.monotonic() seconds), filled in by the observer."""

    arrival: float
    scheduled: Optional[float] = None  # estimated: when the engine began the step that gave the first token
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_output_tokens: int = 0


class StreamObserver(Protocol):
    def on_output(self, stream: "OutputStream", out: RequestOutput) -> None:
        """An output of `stream` reached the server."""

    def on_abort(self, stream: "OutputStream") -> None:
        """`stream` ended without a finished output: aborted by the server or by a client that left."""


class OutputStream:
    """The outputs of one submitted request, in order; ends after the finished output. With `after`, the
    request reaches the engine only once that event is set."""

    def __init__(self, engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 observer: StreamObserver, after: Optional[asyncio.Event] = None,
                 options: RequestOptions = RequestOptions()):
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_ids)
        self.times = RequestTimes(arrival=time.monotonic())
        self.started = asyncio.Event()  # set at the first output, or when the request ends without one
        self._observer = observer
        self._queue: asyncio.Queue = asyncio.Queue()
        self._abort_reason = "the request was cancelled"
        self._pump_task = asyncio.create_task(self._pump(engine, prompt_ids, params, after, options),
                                              name=f"pump-{request_id}")
        self._pump_task.add_done_callback(self._pump_done)
        self._pump_task.add_done_callback(lambda _: self.started.set())

    async def _pump(self, engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams,
                    after: Optional[asyncio.Event], options: RequestOptions) -> None:
        if after is not None:
            await after.wait()
        async for out in engine.generate(prompt_ids, params, self.request_id, options):
            self._observer.on_output(self, out)
            self._queue.put_nowait(out)
            self.started.set()

    def _pump_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._observer.on_abort(self)
            self._queue.put_nowait(RequestAborted(self._abort_reason))
        elif task.exception() is not None:
            self._queue.put_nowait(task.exception())

    @property
    def done(self) -> bool:
        """The engine is finished with this request (its KV is free or about to be)."""
        return self._pump_task.done()

    def add_done_callback(self, fn: Callable[["OutputStream"], None]) -> None:
        self._pump_task.add_done_callback(lambda _: fn(self))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the finished one. Raises RequestAborted, EngineDeadError or the engine's
        validation error (RequestError / ValueError) when the request ends otherwise."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    async def final(self) -> RequestOutput:
        """The finished output (it carries the whole text, tokens and logprobs)."""
        out = None
        async for out in self:
            pass
        return out

    def abort(self, reason: str) -> None:
        """End the request now; the reader gets RequestAborted(reason) after what already arrived."""
        self._abort_reason = reason
        self._pump_task.cancel()

    def fail(self, error: BaseException) -> None:
        """End the request with an error for the reader (the engine died under it)."""
        if not self.done:
            self._pump_task.remove_done_callback(self._pump_done)
            self._pump_task.cancel()
            self._queue.put_nowait(error)

    def close(self) -> None:
        """The reader is gone: stop the request if it is still running (never awaits)."""
        self._pump_task.cancel()


class RequestRegistry:
    """Requests submitted to the engine and not yet finished by it.

    At most `capacity` (max_num_seqs + max_queued_requests) at once: one more gets 429. On shutdown the
    server waits for the set to empty, then aborts what is left.
    """

    def __init__(self, engine: AsyncEngine, capacity: int, observer: StreamObserver):
        self.engine = engine
        self.capacity = capacity
        self._share_prompts = engine.engine.config.cache.enable_prefix_caching
        self._observer = observer
        self._streams: set[OutputStream] = set()
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._streams)

    def submit(self, prompts: list[tuple[list[int], list[SamplingParams]]], request_ids: list[str],
               options: RequestOptions = RequestOptions()) -> list[OutputStream]:
        """One request per choice of a response: per prompt, its token ids and the params of each of its
        choices; request_ids in that order; options: their adapter and priority. All are taken, or none (429).
        With prefix caching a prompt's choices after its first reach the engine once the first has its first
        output: the prompt's KV blocks are cached by then, so the others share them."""
        count = sum(len(params) for _, params in prompts)
        if len(self._streams) + count > self.capacity:
            raise APIError(429, f"the server is at capacity ({len(self._streams)} requests in flight, "
                                f"limit {self.capacity}): retry later", "rate_limit_error", code="queue_full")
        streams: list[OutputStream] = []
        ids = iter(request_ids)
        for prompt_ids, params in prompts:
            first = None
            for choice_params in params:
                after = first.started if first is not None and self._share_prompts else None
                stream = OutputStream(self.engine, prompt_ids, choice_params, next(ids), self._observer, after,
                                      options)
                self._streams.add(stream)
                stream.add_done_callback(self._discard)
                streams.append(stream)
                first = first or stream
        self._empty.clear()
        return streams

    def _discard(self, stream: OutputStream) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._empty.set()

    async def wait_empty(self, timeout: float) -> bool:
        """True when every request finished within timeout seconds."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def finish(self, request_id: Optional[str]) -> int:
        """End the requests of a response id (its one request, or those of its choices: `respond`'s ids), or
        every request for None, each with its output so far finished with reason "abort"; returns how many."""
        ended = [s for s in self._streams if request_id is None or s.request_id == request_id
                 or s.request_id.startswith(f"{request_id}-")]
        for stream in ended:
            self.engine.abort(stream.request_id)
        return len(ended)

    def abort_all(self, reason: str) -> None:
        for stream in list(self._streams):
            stream.abort(reason)

    def fail_all(self, error: EngineDeadError) -> None:
        for stream in list(self._streams):
            stream.fail(error)
