"""Response bodies and streamed chunks of the API, exactly as the server writes them (the OpenAPI document's
response schemas; the server builds the bodies themselves as dicts, server/formatting.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the server sends no other field


def _sometimes(description: str):
    """A field the server leaves out at times, never null when present."""
    return Field(None, description=description, json_schema_extra=lambda schema: schema.pop("default", None))


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[Optional[float]] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[Optional[dict[str, float]]] = Field(description="null for an echoed prompt's first token")
    text_offset: list[int]


class PromptLogprob(_Response):
    logprob: float
    rank: Optional[int]
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: its logprob} for the token
# and its top alternatives
PromptLogprobs = list[Optional[dict[str, PromptLogprob]]]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Literal["stop", "length", "abort"]
    prompt_logprobs: PromptLogprobs = _sometimes("with prompt_logprobs")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ToolCallFunction(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatCompletionMessage(_Response):
    role: Literal["assistant"]
    content: Optional[str]
    reasoning_content: Optional[str] = Field(None, description="present when the server has a reasoning parser")
    tool_calls: list[ToolCall] = _sometimes("present when the output holds tool calls")


class ChatChoice(_Response):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = _sometimes("with return_token_strs")


class Version(_Response):
    version: str


class DetokenizeResponse(_Response):
    prompt: str


# ---- streamed chunks (each the JSON of one `data:` event; the last event is `data: [DONE]`) ----------
class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[Literal["stop", "length", "abort"]]
    prompt_logprobs: PromptLogprobs = _sometimes("with prompt_logprobs, in a choice's first chunk")


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice] = Field(description="empty in the usage chunk")
    usage: Usage = _sometimes("in every chunk with stream_options.continuous_usage_stats; in a last chunk "
                              "without choices with stream_options.include_usage")


class ToolCallFunctionDelta(_Response):
    name: str = _sometimes("in the tool call's first delta")
    arguments: str


class ToolCallDelta(_Response):
    index: int
    id: str = _sometimes("in the tool call's first delta")
    type: Literal["function"] = _sometimes("in the tool call's first delta")
    function: ToolCallFunctionDelta


class ChatDelta(_Response):
    role: Literal["assistant"] = _sometimes("in each choice's first chunk")
    content: str = _sometimes("new content")
    reasoning_content: str = _sometimes("new reasoning, with a reasoning parser")
    tool_calls: list[ToolCallDelta] = _sometimes("new tool-call fragments, with a tool-call parser")


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[Literal["stop", "length", "tool_calls", "abort"]]


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice] = Field(description="empty in the usage chunk")
    usage: Usage = _sometimes("in every chunk with stream_options.continuous_usage_stats; in a last chunk "
                              "without choices with stream_options.include_usage")


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Response):
    error: ErrorDetail


class Health(_Response):
    status: Literal["ok", "starting", "draining", "failed"]
    error: str = _sometimes("why the model failed to load or the engine stopped")
