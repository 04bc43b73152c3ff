"""Response bodies and streamed chunks of the API, exactly as the server writes them (the OpenAPI document's
response schemas; the server builds the bodies themselves as dicts, server/formatting.py)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the server sends no other field


def _sometimes(description: str):
    """A field the server leaves out at times, never null when present."""
    return Field(None, description=description, json_schema_extra=lambda schema: schema.pop("default", None))


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = _sometimes("with --enable-prompt-tokens-details: the prompt tokens "
                                                            "found in the prefix cache")


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
    root: str = _sometimes("a LoRA adapter's: its folder")
    parent: str = _sometimes("a LoRA adapter's: the model it adapts")


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


# ---- /v1/responses (OpenAI's Responses API) -------------------------------------------------------
class OutputText(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: list[ChatTokenLogprob] = Field(description="with include 'message.output_text.logprobs' or "
                                                         "top_logprobs: every output token's, as chat lists them")


class ReasoningTextPart(_Response):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_Response):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText] = Field(description="one part (empty when the item is announced)")


class OutputReasoning(_Response):
    id: str
    type: Literal["reasoning"]
    summary: list[dict] = Field(description="always empty: the model's reasoning is in content")
    status: ItemStatus
    content: list[ReasoningTextPart] = Field(description="one part (empty when the item is announced)")


class OutputFunctionCall(_Response):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Union[OutputMessage, OutputReasoning, OutputFunctionCall]


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(description="cached_tokens: the input tokens found in the prefix "
                                                             "cache")
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(description="reasoning_tokens: output tokens up to the end of "
                                                              "the reasoning")
    total_tokens: int


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    background: bool
    error: Optional[ResponseError]
    incomplete_details: Optional[dict[str, str]] = Field(description="reason max_output_tokens when incomplete")
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    reasoning: dict[str, Optional[str]]
    store: bool = Field(description="whether the server keeps it (--responses-store-size, and the request's store)")
    temperature: float
    text: dict[str, dict[str, Any]]
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, str]]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: Optional[ResponseUsage] = Field(description="null until the response ends")
    user: Optional[str]


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class ResponseStreamEvent(_Response):
    """One typed event of a streamed response (the SSE event line names its type)."""

    type: str = Field(description="response.created, response.in_progress, response.output_item.added, "
                                  "response.content_part.added, response.output_text.delta, "
                                  "response.reasoning_text.delta, response.function_call_arguments.delta, their "
                                  ".done events, response.content_part.done, response.output_item.done, "
                                  "response.completed, response.incomplete, error, response.failed")
    sequence_number: int
    response: ResponseObject = _sometimes("the response.* lifecycle events")
    output_index: int = _sometimes("item events")
    item_id: str = _sometimes("content and argument events")
    item: OutputItem = _sometimes("output_item.added / .done")
    content_index: int = _sometimes("content events")
    part: Union[OutputText, ReasoningTextPart] = _sometimes("content_part.added / .done")
    delta: str = _sometimes("delta events")
    text: str = _sometimes("output_text.done / reasoning_text.done")
    logprobs: list[ChatTokenLogprob] = _sometimes("output_text.delta / .done")
    name: str = _sometimes("function_call_arguments.done")
    arguments: str = _sometimes("function_call_arguments.done")
    code: Optional[str] = _sometimes("error")
    message: str = _sometimes("error")
    param: Optional[str] = _sometimes("error")
