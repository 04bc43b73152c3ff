"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request becomes a chat request (protocol_responses.py), so the prompt, the sampling, tools, forced calls
and structured output are chat's. The output is split by the same parsers into output items, in the order
they begin: a `reasoning` item (with --reasoning-parser), one `message` (its text, and with logprobs every
output token's, as chat lists them), a `function_call` per tool call. A response cut by max_output_tokens is
"incomplete". An output with no item (its tokens decode to no text) answers with an empty message. Streamed, it
is OpenAI's typed events (`event: <type>` and its JSON with a sequence_number):
response.created / in_progress, then per item output_item.added, content_part.added, the text, reasoning
or argument deltas, their .done events and output_item.done, and last response.completed (or
response.incomplete; response.failed when the server aborts the request or the engine fails, after an
error event). The message stays open while tool calls follow it, so the items keep the order a non-streamed
response gives. With --responses-store-size finished responses are kept (unless the request says `store`
false) for `previous_response_id`, `item_reference` input items (their output items, by id) and GET / DELETE
/v1/responses/{id}; without it nothing is.
"""
from __future__ import annotations

import copy
import itertools
import json
import uuid
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response
from pydantic import TypeAdapter, ValidationError

from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .chat import ChatFormatter, render_prompt, submission
from .errors import APIError, bad_request, from_validation_error
from .formatting import Envelope, new_logprobs
from .generation import as_api_error, parse_request, respond
from .parsers import THINK_CLOSE, ChatDelta
from .protocol import ChatCompletionRequest
from .protocol_responses import InputItem, ItemReference, ResponsesRequest
from .response_store import ResponseStore, StoredResponse
from .responses_background import start_background
from .state import ServerState
from .streams import OutputStream

# chat's names for what the Responses API calls otherwise, in the errors a chat check raises
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


def sse_event(event: dict) -> str:
    """A typed server-sent event: its type on the event line, the JSON on the data line."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormatter(ChatFormatter):
    """One response's output items, built from the chat parser's deltas; as the events that stream them
    (`first_chunks`, `chunks`, `failed`) or as the finished body (`response`)."""

    object = "response"

    def __init__(self, *args, req: ResponsesRequest, params: SamplingParams, tokenizer,
                 store: Optional[ResponseStore] = None, conversation: list[dict] = (), **kwargs):
        """store: where the finished response goes (None: nowhere), with `conversation`, the chat messages
        before its output (its instructions left out)."""
        super().__init__(*args, **kwargs)
        self.req, self.params, self.tokenizer = req, params, tokenizer
        self.store, self.conversation = store, list(conversation)
        self.input_items = req.input_items(_new_id)  # as stored (ids given once)
        self.items: list[dict] = []  # the output items so far, in the order they began
        self.open: Optional[int] = None  # the reasoning or function call item being written
        self.message: Optional[int] = None  # the message item, open until the end
        self.calls: dict[int, int] = {}  # a tool call's index -> its item's
        self.waiting_logprobs: list[dict] = []  # entries of tokens that came before any message text
        self.reasoning = ""  # the reasoning text, for the usage's count

    # ---- streamed -------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        body = self._body("in_progress", None)
        return [{"type": "response.created", "response": body}, {"type": "response.in_progress", "response": body}]

    def chunks(self, out: RequestOutput) -> list[dict]:
        """The events one output adds (with the closing ones when it is the last)."""
        entries = self._logprob_entries(new_logprobs(out)) if self.logprobs else []
        return self._consume(out.new_text, entries, out)

    def failed(self, error: APIError) -> list[dict]:
        """The events ending a response the server aborted or the engine failed."""
        event = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        body = self._body("failed", None, error={"code": "server_error", "message": error.message})
        return [event, {"type": "response.failed", "response": body}]

    # ---- not streamed ---------------------------------------------------------------------------
    def response(self, out: RequestOutput) -> dict:
        entries = self._logprob_entries(list(zip(out.token_ids, out.logprobs))) if self.logprobs else []
        self._consume(out.text, entries, out)
        return self._final_body(self._status(out), out)

    # ---- the items ------------------------------------------------------------------------------
    def _consume(self, text: str, entries: list[dict], out: RequestOutput) -> list[dict]:
        delta = self.parser.feed(text)
        if out.finished:
            delta = delta + self.parser.finish()
        self.waiting_logprobs += entries
        events = self._add(delta)
        if out.finished:
            events += self._finish(out)
        return events

    def _add(self, delta: ChatDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            self.reasoning += delta.reasoning
            if self.open is None or self.items[self.open]["type"] != "reasoning":
                events += self._close_open("completed")
                self.open = self._start({"type": "reasoning", "summary": []}, {"type": "reasoning_text", "text": ""},
                                        events)
            events.append(self._text_delta("response.reasoning_text.delta", self.open, delta.reasoning))
        if delta.content:
            if self.message is None:
                events += self._close_open("completed")
                self._start_message(events)
            events.append(self._text_delta("response.output_text.delta", self.message, delta.content))
        for piece in delta.tool_calls:
            if piece.name is not None:
                events += self._close_open("completed")
                self.open = self.calls[piece.index] = self._start(
                    {"type": "function_call", "call_id": piece.id, "name": piece.name, "arguments": ""}, None, events)
            if piece.arguments:
                index = self.calls[piece.index]
                self.items[index]["arguments"] += piece.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                               "output_index": index, "delta": piece.arguments})
        return events

    def _start_message(self, events: list[dict]) -> None:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message = self._start({"type": "message", "role": "assistant"}, part, events)

    def _start(self, fields: dict, part: Optional[dict], events: list[dict]) -> int:
        """A new item (with its one content part, if any), announced in `events`; its output index."""
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[fields["type"]]
        item = dict(id=_new_id(prefix), **fields, status="in_progress")
        index = len(self.items)
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": dict(copy.deepcopy(item), **({"content": []} if part else {}))})
        if part is not None:
            item["content"] = [part]
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": copy.deepcopy(part)})
        self.items.append(item)
        return index

    def _text_delta(self, kind: str, index: int, text: str) -> dict:
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        event = {"type": kind, "item_id": item["id"], "output_index": index, "content_index": 0, "delta": text}
        if part["type"] == "output_text":
            event["logprobs"], self.waiting_logprobs = self.waiting_logprobs, []
            part["logprobs"] += event["logprobs"]
        return event

    def _close_open(self, status: str) -> list[dict]:
        index, self.open = self.open, None
        return [] if index is None else self._close(index, status)

    def _close(self, index: int, status: str) -> list[dict]:
        item = self.items[index]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [dict(where, type="response.function_call_arguments.done", name=item["name"],
                           arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = dict(where, type=f"response.{part['type']}.done", content_index=0, text=part["text"])
            if part["type"] == "output_text":
                done["logprobs"] = part["logprobs"]
            events = [done, dict(where, type="response.content_part.done", content_index=0, part=copy.deepcopy(part))]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def _finish(self, out: RequestOutput) -> list[dict]:
        status = self._status(out)
        events = []
        if not self.items:  # an output of no text at all (tokens that decode to nothing) still answers
            self._start_message(events)
        if self.waiting_logprobs and self.message is not None:  # tokens after the message's last text
            events.append(self._text_delta("response.output_text.delta", self.message, ""))
        item_status = "incomplete" if status == "incomplete" else "completed"
        events += self._close_open(item_status)
        if self.message is not None:
            events += self._close(self.message, item_status)
        return events + [{"type": f"response.{status}", "response": self._final_body(status, out)}]

    @staticmethod
    def _status(out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    # ---- the response object --------------------------------------------------------------------
    def _final_body(self, status: str, out: RequestOutput) -> dict:
        """The finished response, stored when it is to be."""
        body = self._body(status, out)
        if self.store is not None:
            self.store.put(StoredResponse(body, self.conversation + [self._as_chat_message()], self.input_items))
        return body

    def store_status(self, status: str, error: Optional[dict] = None) -> dict:
        """A background response's state before it has its output (queued, in_progress) or without one
        (cancelled, failed), stored; its body."""
        body = self._body(status, None, error)
        self.store.put(StoredResponse(body, self.conversation, self.input_items))
        return body

    def _as_chat_message(self) -> dict:
        """The output as the assistant's chat message, for the conversation a later response continues."""
        message = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                message["content"] = item["content"][0]["text"]
            elif item["type"] == "reasoning":
                message["reasoning_content"] = item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return message

    def _body(self, status: str, out: Optional[RequestOutput], error: Optional[dict] = None) -> dict:
        req, env = self.req, self.envelope
        fmt = req.text.format if req.text and req.text.format else None
        choice = req.tool_choice or "auto"
        return {
            "id": env.id, "object": "response", "created_at": env.created, "status": status,
            "background": bool(req.background),
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": env.model,
            "output": copy.deepcopy(self.items) if out is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": self.store is not None, "temperature": self.params.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs or 0, "top_p": self.params.top_p,
            "truncation": req.truncation or "disabled",
            "usage": self._usage(out) if out is not None else None, "user": req.user,
        }

    def _usage(self, out: RequestOutput) -> dict:
        reasoning = self._reasoning_tokens(out) if self.reasoning else 0
        return {"input_tokens": out.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": out.num_output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": out.num_prompt_tokens + out.num_output_tokens}

    def _reasoning_tokens(self, out: RequestOutput) -> int:
        """The output tokens up to the end of the reasoning (all of them when the output ends inside it)."""
        close = self.tokenizer.convert_tokens_to_ids(THINK_CLOSE) if self.tokenizer is not None else None
        if close is None or close == self.tokenizer.unk_token_id:  # the tag is no one token: count the text's
            return len(self.tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.tokenizer else 0
        ids = out.token_ids
        return ids.index(close) + 1 if close in ids else len(ids)


async def response_events(streams: list[OutputStream], formatters: list[ResponseFormatter], req,
                          num_prompt_tokens: int) -> AsyncIterator[str]:
    """The SSE body of one response. Closing it (the client went away) aborts the request."""
    [stream], [fmt] = streams, formatters
    numbers = itertools.count()

    def numbered(events: list[dict]) -> list[str]:
        return [sse_event(dict(e, sequence_number=next(numbers))) for e in events]

    try:
        for event in numbered(fmt.first_chunks()):
            yield event
        try:
            async for out in stream:
                for event in numbered(fmt.chunks(out)):
                    yield event
        except Exception as e:  # the server aborted it (RequestAborted), or the engine failed under it
            for event in numbered(fmt.failed(as_api_error(e))):
                yield event
    finally:
        stream.close()


def _in_responses_terms(error: APIError) -> APIError:
    """A chat check's error, naming the Responses API's fields."""
    param = CHAT_NAMES.get(error.param, error.param)
    message = error.message
    for chat, ours in CHAT_NAMES.items():
        message = message.replace(f"{chat} ", f"{ours} ")
    return APIError(error.status, message, error.type, param, error.code)


def _previous(state: ServerState, req: ResponsesRequest) -> list[dict]:
    """The conversation a request continues (`previous_response_id`), or none."""
    if req.previous_response_id is None:
        return []
    if not state.responses.enabled:
        raise bad_request("this server stores no responses (start it with --responses-store-size N): send the "
                          "whole conversation as input", "previous_response_id")
    stored = state.responses.get(req.previous_response_id)
    if stored is None:
        raise APIError(404, f"previous response {req.previous_response_id!r} not found (the server keeps the latest "
                            f"{state.responses.size})", "not_found_error", "previous_response_id")
    return stored.conversation


_INPUT_ITEM = TypeAdapter(InputItem)


def referenced(store: ResponseStore, req: ResponsesRequest) -> ResponsesRequest:
    """req with each item reference replaced by the output item of that id of a response in store."""
    if not any(isinstance(item, ItemReference) for item in req.input):
        return req
    if not store.enabled:
        raise bad_request("item references name output items of stored responses, and this server stores none "
                          "(start it with --responses-store-size N): send the items themselves", "input")
    items = []
    for k, item in enumerate(req.input):
        if isinstance(item, ItemReference):
            stored = store.item(item.id)
            if stored is None:
                raise APIError(404, f"no stored item {item.id!r}: an item reference names an output item of one of "
                                    f"the latest {store.size} stored responses", "not_found_error",
                               f"input.{k}.id")
            item = _INPUT_ITEM.validate_python(stored)
        items.append(item)
    return req.model_copy(update={"input": items})


def fitted(engine, req: ResponsesRequest, previous: list[dict]) -> ChatCompletionRequest:
    """req as a chat request; with truncation 'auto', the fewest of the conversation's oldest messages dropped
    (whole turns; the instructions and the last message stay) for the prompt to leave max_output_tokens (at
    least one token) of room, OpenAI's 'dropping input items in the middle of the conversation'. Where even
    the last message alone does not fit, the request is what submission then refuses."""
    chat = req.to_chat(previous)
    if req.truncation != "auto":
        return chat
    room = engine.engine.config.model.max_model_len - (req.max_output_tokens or 1)

    def fits(drop: int) -> bool:
        return len(render_prompt(engine.tokenizer, req.to_chat(previous, drop))) <= room

    lo, hi = 0, len(req.conversation(previous)) - 1  # drop counts: none, all but the last message
    if hi <= 0 or fits(lo):
        return chat
    if not fits(hi):
        return req.to_chat(previous, hi)
    while hi - lo > 1:  # fits(hi), not fits(lo): the prompt only shortens as more is dropped
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return req.to_chat(previous, hi)


async def create_response(request: Request, state: ServerState) -> Response:
    engine, req = await parse_request(request, state, ResponsesRequest)
    previous = _previous(state, req)
    req = referenced(state.responses, req)
    try:
        chat = fitted(engine, req, previous)
        sub = await submission(engine, state, chat)
    except ValidationError as e:
        raise _in_responses_terms(from_validation_error(e)) from None
    except APIError as e:
        raise _in_responses_terms(e) from None
    envelope = Envelope(_new_id("resp"), state.model_name)
    fmt = ResponseFormatter(envelope, state.token_text, chat.logprobs, reasoning_parser=state.options.reasoning_parser,
                            tools=sub.tool_parser, guided=sub.params.guided, frame=sub.frame,
                            schemas=chat.template_tools(), req=req, params=sub.params, tokenizer=engine.tokenizer,
                            store=state.responses if state.responses.enabled and req.store is not False else None,
                            conversation=req.conversation(previous))
    if req.background:
        return start_background(state, req, sub, fmt)
    return await respond(request, state, chat, [(sub.prompt_ids, sub.params)], [fmt],
                         body=lambda formatters, outs, _: formatters[0].response(outs[0]), events=response_events,
                         options=state.request_options(req))


def input_items_page(stored: StoredResponse, limit: int, order: str, after: Optional[str],
                     before: Optional[str]) -> dict:
    """GET /v1/responses/{id}/input_items: OpenAI's list of a stored response's input items, `order` desc (newest
    first, the default) or asc, `limit` of them after the item `after` / before the item `before`."""
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    ids = [item["id"] for item in items]
    for cursor, param in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise APIError(404, f"no input item {cursor!r} in response {stored.body['id']!r}", "not_found_error",
                           param)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    page = items[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}


def stored_response(state: ServerState, response_id: str) -> StoredResponse:
    """GET / DELETE /v1/responses/{id}: the stored response, or a 404."""
    stored = state.responses.get(response_id)
    if stored is None:
        kept = f"keeps the latest {state.responses.size}" if state.responses.enabled else "stores no responses"
        raise APIError(404, f"no response {response_id!r} (this server {kept})", "not_found_error", "response_id")
    return stored
