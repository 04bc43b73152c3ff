"""The request body of POST /v1/responses (OpenAI's Responses API), and its translation into a chat request.

`input` is a string (one user message) or a list of items: messages (`{"role", "content"}`, content a string
or input_text / output_text parts), `function_call` and `function_call_output` items (a tool call and its
result, as a client sends them back), and `reasoning` items (their text becomes the next assistant message's
reasoning_content). `instructions` becomes a system message first; the "developer" role is "system". Only
function tools are served; `text.format` is the structured output (text, json_object, json_schema), and the
sampling fields are chat's, vLLM's extras included. `previous_response_id` continues a stored response's
conversation (the server keeps the latest --responses-store-size responses; none by default, as vLLM, and then it
is refused with a 400 that says so); its instructions are not carried over, as in OpenAI's API. An
`item_reference` names an output item (message, reasoning, function call) of a stored response, which takes its
place (`responses_api`); `background` responses run on after the answer, kept in the store
(`responses_background`).
`reasoning` (effort, summary) and `include` values other than "message.output_text.logprobs" are accepted and
have no effect (the model reasons as its chat template has it).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .protocol import (
    ChatCompletionRequest,
    NumLogprobs,
    PositiveInt,
    SamplingFields,
    _Strict,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextContent(_Strict):
    """A text part of a message; `annotations` and `logprobs` (on an output sent back) are ignored."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class RefusalContent(_Strict):
    type: Literal["refusal"]
    refusal: str


class UnsupportedContent(_Strict):
    """Images, files and audio: refused by name (this server runs text models)."""

    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"{self.type} content is not supported: this server runs text-only models")


def _content_kind(v) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if kind in ("input_image", "input_file", "input_audio"):
        return "unsupported_part"
    return "refusal_part" if kind == "refusal" else "text_part"


Content = Annotated[Union[Annotated[TextContent, Tag("text_part")], Annotated[RefusalContent, Tag("refusal_part")],
                          Annotated[UnsupportedContent, Tag("unsupported_part")]], Discriminator(_content_kind)]


def _joined(content: Union[str, list]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextContent) else part.refusal for part in content)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Content]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Content]]
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


class ItemReference(_Strict):
    """An output item of a stored response, by its id (resolved before the request runs)."""

    type: Literal["item_reference"]
    id: str


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")


def _item_kind(v) -> Optional[str]:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")],
          Annotated[ItemReference, Tag("item_reference")]],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message=f"an input item's type must be one of {', '.join(ITEM_TYPES)}"),
]


class FunctionTool(_Strict):
    """A function the model may call (the Responses API's flat form of chat's `tools[].function`)."""

    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v):
        kind = v.get("type") if isinstance(v, dict) else "function"
        if kind != "function":
            raise ValueError(f"only function tools are supported (got a {kind!r} tool): this server runs no "
                             "built-in tools")
        return v


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: "text", "json_object", or "json_schema" with `schema` (flat, unlike chat's)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("schema is required with type 'json_schema' and not allowed otherwise")
        return self

    def response_format(self) -> dict[str, Any]:
        """Chat's response_format for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.json_schema,
                                                        "strict": self.strict}}


class TextConfig(_Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(_Strict):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesRequest(SamplingFields):
    # the tags of the unions of items and parts, left out of the paths errors name
    union_tags: ClassVar[tuple[str, ...]] = ITEM_TYPES + ("text_part", "refusal_part", "unsupported_part")

    model: Optional[str] = None
    input: Annotated[list[InputItem], Field(min_length=1, description="a string (one user message) or a list of "
                                                                     "items")]
    instructions: Optional[str] = None
    stream: bool = False
    max_output_tokens: Optional[PositiveInt] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    top_logprobs: Optional[NumLogprobs] = None
    include: Optional[list[str]] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    truncation: Optional[Literal["auto", "disabled"]] = Field(
        None, description="'auto': the conversation's oldest turns are dropped where the input would not fit")
    background: Optional[bool] = Field(None, description="answer at once (queued) and run on: poll GET "
                                                         "/v1/responses/{id}, end it with POST .../cancel "
                                                         "(with --responses-store-size; not streamed)")
    previous_response_id: Optional[Annotated[str, Field(min_length=1)]] = Field(
        None, description="continue a stored response's conversation (with --responses-store-size)")
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_message(cls, v):
        if v == "" or v == []:
            raise ValueError("the input is empty")
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def input_items(self, new_id) -> list[dict[str, Any]]:
        """The input as OpenAI lists a stored response's input items: each with an id (new_id(prefix) where the
        client sent none) and a status, a message's text as parts (input_text; output_text for the assistant)."""
        items = []
        for item in self.input:
            data = item.model_dump(exclude_none=True, by_alias=True)
            if isinstance(item, MessageItem):
                part = "output_text" if item.role == "assistant" else "input_text"
                data["content"] = [{"type": part, "text": item.content}] if isinstance(item.content, str) else \
                    data["content"]
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(data["type"], "rs")
            items.append({"id": data.pop("id", None) or new_id(prefix), **data, "status": data.get("status") or
                          "completed"})
        return items

    def conversation(self, previous: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The input after `previous` (a stored conversation's messages) as chat messages: function calls on the
        assistant message before them (or one of their own), their outputs as tool messages."""
        messages = [dict(m) for m in previous]
        reasoning = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            if reasoning is not None and messages and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        return messages

    def chat_messages(self, previous: list[dict[str, Any]] = (), drop: int = 0) -> list[dict[str, Any]]:
        """The instructions as a system message, then the conversation, of which the first `drop` messages are
        left out, and then any that would open it with something else than a user turn (a tool result, an
        assistant message), so that only whole turns go."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        conversation = self.conversation(previous)
        if drop:
            conversation = conversation[drop:]
            while len(conversation) > 1 and conversation[0]["role"] != "user":
                conversation = conversation[1:]
        return system + conversation

    def to_chat(self, previous: list[dict[str, Any]] = (), drop: int = 0) -> ChatCompletionRequest:
        """The chat request this one asks for (the same sampling, tools, constraint and stream), after the
        messages of `previous` (a stored conversation), the first `drop` of its messages left out
        (`chat_messages`)."""
        fields = self.model_dump(include=set(SamplingFields.model_fields), exclude_none=True)
        tool_choice = self.tool_choice
        if isinstance(tool_choice, FunctionChoice):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        fields.update(
            model=self.model, stream=self.stream, messages=self.chat_messages(previous, drop),
            max_tokens=self.max_output_tokens,
            tool_choice=tool_choice, parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=[{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                   for t in self.tools] if self.tools else None,
            response_format=self.text.format.response_format() if self.text and self.text.format else None,
            logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs if self.wants_logprobs else None)
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
