"""The path both generation endpoints share: check the request against the engine, submit it, and answer
with one body or a stream of chunks. A client that goes away aborts its request."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Optional, Type, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.engine import RequestError, RequestOutput
from ..sampling_params import SamplingParams
from .errors import APIError, bad_request, from_validation_error, server_error, unavailable
from .formatting import SSE_DONE, Formatter, sse, usage
from .protocol import SamplingRequest, unknown_fields
from .state import ServerState
from .streams import OutputStream, RequestAborted

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def parse_request(request: Request, state: ServerState, model: Type[Body]) -> tuple[AsyncEngine, Body]:
    """The engine, if the server is serving, and the validated body, if it names the served model."""
    engine = state.serving_engine()
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None
    _unknown_fields(request.url.path, body, raw, state.options.strict_request_fields)
    state.check_model(body.model)
    return engine, body


def _unknown_fields(path: str, body: BaseModel, raw: bytes, strict: bool) -> None:
    """vLLM's policy: fields the API does not know are ignored with one warning line per request naming
    them; with --strict-request-fields they are refused."""
    unknown = unknown_fields(body, json.loads(raw))
    if unknown and strict:
        raise bad_request(f"unknown field {unknown[0]!r}", unknown[0], "unknown_field")
    if unknown:
        log.warning("ignoring unknown fields in %s: %s", path, ", ".join(unknown))


def as_api_error(exc: BaseException) -> APIError:
    """The error a client gets for a request that failed after submission."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestAborted):
        return unavailable(str(exc))
    if isinstance(exc, EngineDeadError):
        return server_error(str(exc))
    if isinstance(exc, (RequestError, ValueError)):
        return bad_request(str(exc))
    return server_error(f"the request failed: {exc!r}")


def sampling_params(engine: AsyncEngine, req: SamplingRequest, prompt_ids: list[int], prompt_param: str,
                    max_tokens: Optional[int], default_max_tokens: Optional[int],
                    logprobs: Optional[int]) -> SamplingParams:
    """Check the prompt and the stop token ids against the vocabulary, the output length against
    max_model_len; build the request's SamplingParams.

    Without max_tokens a request may use `default_max_tokens` or, when None, all the room left.
    """
    core = engine.engine
    try:
        core.check_prompt(prompt_ids)
    except RequestError as e:
        raise bad_request(str(e), prompt_param) from None
    vocab_size = core.arch.vocab_size
    for token_id in req.stop_token_ids or []:
        if token_id >= vocab_size:
            raise bad_request(f"stop token id {token_id} is outside the vocabulary (size {vocab_size})",
                              "stop_token_ids")
    max_len = core.config.model.max_model_len
    room = max_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens or room)
    elif max_tokens > room:
        raise bad_request(f"max_tokens {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds "
                          f"max_model_len {max_len}: ask for at most {room}", "max_tokens")
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise bad_request(str(e)) from None


async def respond(request: Request, state: ServerState, req: SamplingRequest, prompt_ids: list[int],
                  params: SamplingParams, fmt: Formatter) -> Response:
    """Submit the request and answer: a stream of chunks, or one body once it finishes."""
    stream = state.requests.submit(prompt_ids, params, fmt.id)
    if req.stream:
        async def close() -> None:  # also when the client leaves before the body starts
            stream.close()

        return StreamingResponse(_events(stream, fmt, req), media_type="text/event-stream",
                                 headers=SSE_HEADERS, background=BackgroundTask(close))
    out = await _finished_or_disconnected(request, stream)
    if out is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(fmt.response(out, stream.num_prompt_tokens))


async def _events(stream: OutputStream, fmt: Formatter, req: SamplingRequest) -> AsyncIterator[str]:
    """The SSE body. It always ends with [DONE]: a request the server aborts ends its choice with
    finish_reason "abort"; an engine failure sends an error event. With continuous usage stats every
    chunk carries the usage so far; with include_usage a last chunk carries the total. Closing it (the
    client went away) aborts the request."""
    num_tokens = 0

    def event(chunk: dict) -> str:
        if req.continuous_usage:
            chunk["usage"] = usage(stream.num_prompt_tokens, num_tokens)
        return sse(chunk)

    try:
        for chunk in fmt.first_chunks():
            yield event(chunk)
        try:
            async for out in stream:
                num_tokens = len(out.token_ids)
                chunk = fmt.chunk(out)
                if chunk is not None:
                    yield event(chunk)
        except RequestAborted:
            yield event(fmt.end_chunk("abort"))
        except Exception as e:  # the engine failed under the request: headers are sent, say it in-band
            yield sse(as_api_error(e).body())
        if req.include_usage:
            yield sse(fmt.usage_chunk(stream.num_prompt_tokens, num_tokens))
        yield SSE_DONE
    finally:
        stream.close()


async def _finished_or_disconnected(request: Request, stream: OutputStream) -> Optional[RequestOutput]:
    """The finished output, or None if the client disconnects first (the request is then aborted)."""
    work = asyncio.ensure_future(stream.final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            try:
                return work.result()
            except Exception as e:
                raise as_api_error(e) from e
        return None
    finally:
        gone.cancel()
        work.cancel()
        stream.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
