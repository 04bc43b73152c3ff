"""Request bodies of the OpenAI API, as strict pydantic models.

Strict: "5" is not an integer and unknown fields are refused, so a typo fails loudly instead of being
ignored. Options specserve does not implement are accepted only at their neutral value (`n` 1,
penalties 0, no `logit_bias`) and refused otherwise with a message naming the field. `top_k`, `min_p`,
`ignore_eos` and `stop_token_ids` are extra sampling fields, as in vLLM.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..sampling_params import SamplingParams

MAX_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI fields specserve does not implement: (the one value accepted besides null, why others are refused)
UNSUPPORTED = {
    "n": (1, "only n=1 is supported: send separate requests for more choices"),
    "best_of": (1, "only best_of=1 is supported"),
    "presence_penalty": (0, "penalties are not supported: only 0 is accepted"),
    "frequency_penalty": (0, "penalties are not supported: only 0 is accepted"),
    "logit_bias": ({}, "logit_bias is not supported"),
    "echo": (False, "echo is not supported"),
    "suffix": (None, "suffix is not supported"),
}


def _neutral_only(value, info: ValidationInfo):
    neutral, why = UNSUPPORTED[info.field_name]
    if value is not None and value != neutral:
        raise ValueError(why)
    return value


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # OpenAI's end-user id: accepted, has no effect
    # vLLM-style extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None

    _unsupported = field_validator(*UNSUPPORTED, check_fields=False)(_neutral_only)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        """SamplingParams for this request (raises ValueError naming a bad value)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            logprobs=logprobs)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batches of prompts are not supported: send one request per prompt")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined into one string."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        msg.setdefault("content", "")
        return msg


class FunctionDefinition(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _auto_or_none(cls, v):
        if v not in (None, "auto", "none"):
            raise ValueError("only tool_choice 'auto' and 'none' are supported")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def wants_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs for this request (None: none asked for)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
