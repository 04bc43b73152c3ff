"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template; the output split into
reasoning, content and tool calls by the configured parsers. A forced tool call (tool_choice "required" or
a named function, structured.py) is framed as a hermes block, or as Llama 3.1's JSON where the server reads
llama3_json, and parsed as one."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Optional

from fastapi import Request
from fastapi.responses import Response
from jinja2 import TemplateError

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput
from ..engine.sequence import TokenLogprob
from ..sampling_params import SamplingParams
from .errors import bad_request
from .formatting import Envelope, Formatter, json_logprob, new_logprobs
from .generation import parse_request, respond, sampling_params
from .parsers import ChatDelta, ChatOutputParser, FramedOutputParser, parse_message
from .protocol import ChatCompletionRequest, ChatTemplateInput
from .state import ServerState
from .structured import ForcedToolCall, check_grammar, forced_tool_call, guided_param


class ChatFormatter(Formatter):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, reasoning_parser: Optional[str], tools: Optional[str], guided: bool = False,
                 frame: Optional[ForcedToolCall] = None, schemas: Optional[list[dict]] = None, **kwargs):
        """tools: the tool-call parser that reads the output (None: none); guided: the output is constrained
        from its first token, so it holds no reasoning (and is not read for any); frame: the framing of a
        forced tool call (see structured.ForcedToolCall); schemas: the request's tools."""
        super().__init__(*args, **kwargs)
        self.reasoning_parser = reasoning_parser
        self.guided = guided
        self.tools = tools
        self.frame = frame
        self.schemas = schemas
        self.parser = self._new_parser()  # the streamed response's

    def _new_parser(self):
        parser = ChatOutputParser(None if self.guided else self.reasoning_parser, self.tools, self.schemas)
        return FramedOutputParser(parser, self.frame.prefix, self.frame.suffix) if self.frame else parser

    # ---- streamed -------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        delta = self.parser.feed(out.new_text)
        if out.finished:
            delta = delta + self.parser.finish()
        logprobs = self._logprobs(new_logprobs(out)) if self.logprobs else None
        reason = self._finish_reason(self.parser, out.finish_reason) if out.finished else None
        if not delta and logprobs is None and reason is None:
            return None
        return self._chunk(_delta_fields(delta), logprobs, reason)

    def end_chunk(self, finish_reason: str) -> dict:
        return self._chunk({}, None, finish_reason)

    def _chunk(self, delta: dict, logprobs: Optional[dict], finish_reason: Optional[str]) -> dict:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.envelope.wrap(self.chunk_object, [choice])

    # ---- not streamed ---------------------------------------------------------------------------
    def choice(self, out: RequestOutput) -> dict:
        parser = self._new_parser()
        parsed = parse_message(parser, out.text)
        message = {"role": "assistant", "content": parsed.content}
        if self.reasoning_parser:
            message["reasoning_content"] = parsed.reasoning or None
        if parsed.tool_calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in parsed.tool_calls]
        logprobs = self._logprobs(list(zip(out.token_ids, out.logprobs))) if self.logprobs else None
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish_reason(parser, out.finish_reason)}

    @staticmethod
    def _finish_reason(parser, reason: str) -> str:
        return "tool_calls" if reason == "stop" and parser.num_tool_calls else reason

    def _logprobs(self, tokens: list[tuple[int, TokenLogprob]]) -> dict:
        """The chat logprobs shape: one entry per token with its top alternatives."""
        return {"content": self._logprob_entries(tokens)}

    def _logprob_entries(self, tokens: list[tuple[int, TokenLogprob]]) -> list[dict]:
        return [dict(self._entry(token_id, lp.logprob), top_logprobs=[self._entry(t, v) for t, v in lp.top])
                for token_id, lp in tokens]

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _delta_fields(delta: ChatDelta) -> dict:
    fields = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [piece.to_openai() for piece in delta.tool_calls]
    return fields


def render_prompt(tokenizer, req: ChatTemplateInput, then: str = "") -> list[int]:
    """The messages (and tools) through the tokenizer's chat template, followed by `then` (the start of
    the answer), as token ids."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
        raise bad_request("continue_final_message needs add_generation_prompt false and an assistant message "
                          "last", "continue_final_message")
    try:
        text = tokenizer.apply_chat_template(req.template_messages(), tools=req.template_tools(), tokenize=False,
                                             **req.template_options())
    except (TemplateError, ValueError, TypeError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    return tokenizer.encode(text + then, add_special_tokens=False)  # the template wrote any special tokens itself


@dataclass(frozen=True)
class ChatSubmission:
    """A chat request made ready for the engine: its prompt, its params, and how its output is read."""

    prompt_ids: list[int]
    params: SamplingParams
    frame: Optional[ForcedToolCall]  # a forced tool call's framing
    tool_parser: Optional[str]  # the parser that reads tool calls out of the output (None: none)


async def submission(engine: AsyncEngine, state: ServerState, req: ChatCompletionRequest) -> ChatSubmission:
    """Render the prompt, check it and the request against the engine and compile its constraint (a 400 names
    what is wrong)."""
    tools = req.wants_tool_calls
    # the server frames and parses a forced call itself (in its parser's format where it can): no parser needed
    frame = forced_tool_call(req, state.options.tool_call_parser)
    if tools and frame is None and state.options.tool_call_parser is None:
        raise bad_request("this server parses no tool calls: start it with --tool-call-parser, "
                          "or send tool_choice 'none'", "tools")
    prompt_ids = req.truncated(render_prompt(engine.tokenizer, req, frame.prefix if frame else ""),
                               engine.engine.config.model.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(engine, req, prompt_ids, "messages", max_tokens, None, req.num_logprobs,
                             {"json": frame.schema} if frame else None)
    await check_grammar(engine.tokenizer, params, guided_param(req))
    parser = frame.parser if frame is not None else (state.options.tool_call_parser if tools else None)
    return ChatSubmission(prompt_ids, params, frame, parser)


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    engine, req = await parse_request(request, state, ChatCompletionRequest)
    sub = await submission(engine, state, req)
    envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", state.model_name)
    formatters = [ChatFormatter(envelope, state.token_names(req), req.logprobs, index,
                                reasoning_parser=state.options.reasoning_parser, tools=sub.tool_parser,
                                guided=sub.params.guided, frame=sub.frame, schemas=req.template_tools())
                  for index in range(req.num_choices)]
    return await respond(request, state, req, [(sub.prompt_ids, sub.params)], formatters,
                         options=state.request_options(req))
