"""The path both generation endpoints share: check the request against the engine, submit it (one engine
request per choice: `n` > 1 and a list of prompts fan out), and answer with one body or a stream of chunks. A
client that goes away aborts its requests."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import AsyncIterator, Callable, Optional, Type, TypeVar, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.outputs import RequestError, RequestOutput
from ..engine.sequence import RequestOptions
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .errors import APIError, bad_request, from_validation_error, server_error, unavailable
from .formatting import SSE_DONE, Formatter, response, sse, usage
from .protocol import SamplingRequest, unknown_fields
from .state import ServerState
from .streams import OutputStream, RequestAborted

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_body(request: Request, model: Type[Body]) -> Body:
    """The request's JSON body validated as model; a 400 naming the field it fails on."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation_error(e, getattr(model, "union_tags", ())) from None


async def parse_request(request: Request, state: ServerState, model: Type[Body]) -> tuple[AsyncEngine, Body]:
    """The engine, if the server is serving, and the validated body, if it names the served model."""
    engine = state.serving_engine()
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e, getattr(model, "union_tags", ())) from None
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
                    logprobs: Optional[int], structured: Optional[dict] = None,
                    prompt_logprobs: Optional[int] = None) -> SamplingParams:
    """Check the prompt, the stop token ids and logit_bias's token ids against the vocabulary, the output
    length against max_model_len, logprobs and prompt_logprobs against the engine's max_logprobs; build the
    request's SamplingParams.

    Without max_tokens a request may use `default_max_tokens` or, when None, the model's max_new_tokens
    (generation_config.json) or all the room left. What else the request leaves out takes the model's
    sampling defaults. `structured`: StructuredOutputsParams' arguments (default: the request's own
    constraint, `structured_options`).
    """
    core = engine.engine
    try:
        core.check_prompt(prompt_ids)
    except RequestError as e:
        raise bad_request(str(e), prompt_param) from None
    _check_token_ids(req, core.arch.vocab_size)
    max_len = core.config.model.max_model_len
    room = max_len - len(prompt_ids)
    defaults = core.generation.sampling
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens or defaults.get("max_tokens") or room)
    elif max_tokens > room:
        raise bad_request(f"max_tokens {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds "
                          f"max_model_len {max_len}: ask for at most {room}", "max_tokens")
    if (req.min_tokens or 0) > max_tokens:
        raise bad_request(f"min_tokens {req.min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
    options = req.sampling_options(max_tokens, logprobs, defaults)
    if prompt_logprobs is not None:
        options["prompt_logprobs"] = prompt_logprobs
    structured = req.structured_options() if structured is None else structured
    try:
        if structured is not None:
            options["structured_outputs"] = StructuredOutputsParams(**structured)
        params = SamplingParams(**options)
        params.update_from_tokenizer(core.tokenizer)
        params.check_token_ids(core.arch.vocab_size)
        params.check_logprobs(core.max_logprobs)
    except ValueError as e:  # SamplingParamError names the field
        param = getattr(e, "param", None)
        raise bad_request(str(e), req.logprobs_field if param == "logprobs" else param) from None
    return params


def _check_token_ids(req: SamplingRequest, vocab_size: int) -> None:
    """stop_token_ids, logit_bias's keys and allowed_token_ids must name tokens of the vocabulary."""
    for param, token_ids in (("stop_token_ids", req.stop_token_ids or []),
                             ("logit_bias", [int(k) for k in req.logit_bias or {}]),
                             ("allowed_token_ids", req.allowed_token_ids or [])):
        for token_id in token_ids:
            if token_id >= vocab_size:
                raise bad_request(f"token id {token_id} in {param} is outside the vocabulary (size {vocab_size})",
                                  param)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of n choices: the same, except that choice i of a seeded request has seed + i
    (as vLLM), so that its choices differ and each reproduces."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


async def respond(request: Request, state: ServerState, req: SamplingRequest,
                  prompts: list[tuple[list[int], SamplingParams]], formatters: list[Formatter],
                  body: Callable = response, events: Optional[Callable] = None,
                  options: RequestOptions = RequestOptions()) -> Response:
    """Submit one request per choice (`formatters`: n per prompt, prompt by prompt; `prompts`: each one's
    token ids and params) and answer: a stream of chunks, or one body once all have finished (`body` of
    the formatters, the finished outputs and the prompt tokens; OpenAI's by default). The usage counts each
    prompt once. `events`: the SSE body of the streams, formatters, request and prompt tokens (default: chat
    and completion chunks ending with [DONE]); options: the requests' adapter and priority."""
    n, total, response_id = req.num_choices, len(formatters), formatters[0].envelope.id
    if total > state.requests.capacity:
        what, param = (f"n {n}", "n") if len(prompts) == 1 else (f"{len(prompts)} prompts x n {n}", "prompt")
        raise bad_request(f"{what} is more choices than this server runs at once ({state.requests.capacity})",
                          param)
    request_ids = [response_id] if total == 1 else [f"{response_id}-{i}" for i in range(total)]
    streams = state.requests.submit([(ids, choice_params(params, n)) for ids, params in prompts], request_ids,
                                    options)
    num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
    if req.stream:
        async def close() -> None:  # also when the client leaves before the body starts
            for stream in streams:
                stream.close()

        details = state.options.enable_prompt_tokens_details
        body_events = events(streams, formatters, req, num_prompt_tokens) if events else \
            _events(streams, formatters, req, num_prompt_tokens, details)
        return StreamingResponse(body_events, media_type="text/event-stream",
                                 headers=SSE_HEADERS, background=BackgroundTask(close))
    outs = await _finished_or_disconnected(request, streams)
    if outs is None:
        return Response(status_code=499)  # nobody is listening
    answer = body(formatters, outs, num_prompt_tokens)
    if state.options.enable_prompt_tokens_details and isinstance(answer, dict) and "usage" in answer:
        answer["usage"]["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outs[::n])}
    return JSONResponse(answer)


async def _merged(streams: list[OutputStream]) -> AsyncIterator[tuple[int, Union[RequestOutput, Exception]]]:
    """The outputs of the streams as they arrive, each with its stream's index; a stream that ends without
    its finished output gives the exception that ended it (RequestAborted, an engine failure) instead."""
    queue: asyncio.Queue = asyncio.Queue()

    async def read(index: int, stream: OutputStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    readers = [asyncio.create_task(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(readers)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()


async def _events(streams: list[OutputStream], formatters: list[Formatter], req: SamplingRequest,
                  num_prompt_tokens: int, details: bool = False) -> AsyncIterator[str]:
    """The SSE body. It always ends with [DONE]: a request the server aborts ends its choice with
    finish_reason "abort"; an engine failure sends an error event. With continuous usage stats every
    chunk carries the usage so far (of all choices); with include_usage a last chunk carries the total
    (details: with the cached prompt tokens, each prompt's counted once). Closing it (the client went away)
    aborts the requests."""
    num_tokens, cached = [0] * len(streams), [0] * len(streams)

    def so_far() -> dict:
        return usage(num_prompt_tokens, sum(num_tokens), sum(cached[::req.num_choices]) if details else None)

    def event(chunk: dict) -> str:
        if req.continuous_usage:
            chunk["usage"] = so_far()
        return sse(chunk)

    try:
        for fmt in formatters:
            for chunk in fmt.first_chunks():
                yield event(chunk)
        async with contextlib.aclosing(_merged(streams)) as outputs:
            async for index, item in outputs:
                if isinstance(item, RequestAborted):
                    yield event(formatters[index].end_chunk("abort"))
                elif isinstance(item, Exception):  # the engine failed under the request: headers are sent
                    yield sse(as_api_error(item).body())
                    break
                else:
                    num_tokens[index], cached[index] = formatters[index].count(item), item.num_cached_tokens
                    chunk = formatters[index].chunk(item)
                    if chunk is not None:
                        yield event(chunk)
        if req.include_usage:
            yield sse(formatters[0].usage_chunk(so_far()))
        yield SSE_DONE
    finally:
        for stream in streams:
            stream.close()


async def _finished_or_disconnected(request: Request, streams: list[OutputStream]) -> Optional[list[RequestOutput]]:
    """The finished outputs, or None if the client disconnects first (the requests are then aborted)."""
    work = asyncio.ensure_future(asyncio.gather(*(stream.final() for stream in streams)))
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
        for stream in streams:
            stream.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
