"""Background responses (`background: true` on POST /v1/responses): answered at once, run on after.

The response is stored as "queued" and its body is the answer; its request then runs like any other (it counts
against the server's capacity, and a shutdown drains it). Once its first output arrives it is stored as
"in_progress", at the end as the finished response ("completed", or "incomplete" when cut by
max_output_tokens). GET /v1/responses/{id} reads whichever is stored, and POST /v1/responses/{id}/cancel ends a
running one: stored as "cancelled", without output. A response the engine fails under is stored as "failed".
It needs the store (--responses-store-size, and the request's `store` not false), and is not streamed.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from .errors import bad_request
from .generation import as_api_error
from .state import ServerState

if TYPE_CHECKING:
    from .chat import ChatSubmission
    from .protocol_responses import ResponsesRequest
    from .responses_api import ResponseFormatter
    from .streams import OutputStream


def start_background(state: ServerState, req: "ResponsesRequest", sub: "ChatSubmission",
                     fmt: "ResponseFormatter") -> JSONResponse:
    """Submit the response's request, store it as queued and answer that; a task follows it to the end."""
    if fmt.store is None:
        raise bad_request("a background response is read from the store: start the server with "
                          "--responses-store-size N, and do not send store: false", "background")
    if req.stream:
        raise bad_request("a background response is not streamed: poll GET /v1/responses/{id}", "stream")
    response_id = fmt.envelope.id
    [stream] = state.requests.submit([(sub.prompt_ids, [sub.params])], [response_id], state.request_options(req))
    queued = fmt.store_status("queued")
    task = asyncio.create_task(_follow(fmt, stream), name=f"background {response_id}")
    state.background[response_id] = task
    task.add_done_callback(lambda _: state.background.pop(response_id, None))
    return JSONResponse(queued)


async def _follow(fmt: "ResponseFormatter", stream: "OutputStream") -> None:
    """Store the response as it goes: in progress at its first output, then finished, cancelled or failed."""
    try:
        await stream.started.wait()
        fmt.store_status("in_progress")
        out = await stream.final()
        if out is None or out.finish_reason == "abort":  # cancelled, or the server drained it on shutdown
            fmt.store_status("cancelled")
        else:
            fmt.response(out)
    except Exception as e:  # the engine failed under it, or the server ended it
        fmt.store_status("failed", error={"code": "server_error", "message": as_api_error(e).message})
    finally:
        stream.close()


async def cancel(state: ServerState, response_id: str) -> JSONResponse:
    """POST /v1/responses/{id}/cancel: end a running background response; the response as stored then."""
    task = state.background.get(response_id)
    if task is None:
        raise bad_request(f"response {response_id!r} is no background response in progress", "response_id")
    state.requests.finish(response_id)
    await asyncio.shield(task)
    return JSONResponse(state.responses.get(response_id).body)
