"""Request bodies of the OpenAI API (and vLLM's /tokenize, /detokenize), as pydantic models (they are also
/openapi.json's schemas; the responses' are in server/responses.py).

Requests are strictly typed: "5" is not an integer, while a whole-number float such as 9.0 is, as in JSON Schema.
Fields the models do not know are ignored; `unknown_fields` names them so the server can warn, or refuse them
under --strict-request-fields. Known options that would change the output but that specserve does not implement
are accepted only at their neutral value (no beam search, `best_of` 1, ...), which is all their schema allows, and
refused otherwise with a message naming the field, never silently ignored. Structured output
(server/structured.py), one constraint a request, on both endpoints: `response_format` json_object / json_schema
(OpenAI's); vLLM's `structured_outputs` {json | regex | choice | grammar | json_object}, and its older
`guided_json` (a schema or its JSON text), `guided_regex`, `guided_choice`, `guided_grammar`; and on chat
`tool_choice` "required" or a named function. `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`repetition_penalty`, `min_tokens`, `allowed_token_ids` and `bad_words` are extra sampling fields, as in vLLM, and
`truncate_prompt_tokens` keeps a prompt's last tokens (with `include_stop_str_in_output`, `skip_special_tokens`,
and on completions `echo`); `n` choices are n requests of the same prompt, for each prompt of a list. Stop strings
must not be empty: `"stop": ""` and `"stop": [""]` are both refused.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_N = 128  # OpenAI's limit on choices per request


def _whole(value):
    """A float with no fractional part is the integer it names (JSON Schema's view); other floats fail."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be a whole number")
        return int(value)
    return value


# integer types (constraints before the validator, so that the JSON schema shows them)
Int = Annotated[int, BeforeValidator(_whole)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_whole)]
TokenId = Annotated[int, Field(ge=0, description="below the model's vocabulary size (config.json's "
                                                   "vocab_size): a larger id gets 400"), BeforeValidator(_whole)]
NumLogprobs = Annotated[int, Field(ge=0, description="at most the server's --max-logprobs (20 unless set): more "
                                                     "gets 400"), BeforeValidator(_whole)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), BeforeValidator(_whole)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_whole)]
StopString = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
# OpenAI's logit_bias: token ids as strings, each mapped to a bias in [-100, 100]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
                      Field(json_schema_extra={"additionalProperties": False})]


class _Strict(BaseModel):
    """Strict types; unknown fields are dropped here and found by `unknown_fields`."""

    model_config = ConfigDict(extra="ignore", strict=True)


def unknown_fields(body: Any, data: Any, prefix: str = "") -> list[str]:
    """Dotted paths (`messages.0.refusal`) of the fields of `data`, the parsed JSON, that `body`, the model
    validated from it, ignored."""
    if isinstance(body, BaseModel) and isinstance(data, dict):
        names = {f.alias or name: name for name, f in type(body).model_fields.items()}  # JSON key -> field
        found = []
        for key, value in data.items():
            if key in names:
                found += unknown_fields(getattr(body, names[key]), value, f"{prefix}{key}.")
            else:
                found.append(prefix + key)
        return found
    if isinstance(body, list) and isinstance(data, list):
        return [path for i, (b, d) in enumerate(zip(body, data)) for path in unknown_fields(b, d, f"{prefix}{i}.")]
    return []


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the running usage


# Options that change the output and that specserve does not implement:
# (the one value accepted besides null, why others are refused)
UNSUPPORTED = {
    "best_of": (1, "only best_of 1 is supported: the server does not rank choices (use n)"),
    "use_beam_search": (False, "beam search is not supported"),
    "whitespace_pattern": (None, "whitespace_pattern is not supported: JSON is generated with compact whitespace"),
    "structural_tag": (None, "structural_tag is not supported: use tools and tool_choice"),
    "suffix": (None, "suffix is not supported"),
    "functions": (None, "functions is not supported: use tools"),
    "function_call": (None, "function_call is not supported: use tools and tool_choice"),
}


def _neutral_only(value, info: ValidationInfo):
    """Before type checks: a clearer refusal than the types' (which admit only the neutral value)."""
    neutral, why = UNSUPPORTED[info.field_name]
    if value is None:
        return None
    if value != neutral or isinstance(value, bool) != isinstance(neutral, bool):  # 0 is not false
        raise ValueError(why)
    return neutral  # 1.0 -> 1


# stream_options only with "stream": true, in the schema's words
STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class JsonSchemaSpec(_Strict):
    name: str = Field(description="the schema's name (not used by the server)")
    description: Optional[str] = None
    json_schema: dict[str, Any] = Field({}, alias="schema", description="the JSON schema the output must match "
                                        "(default: any JSON value); one the grammar compiler cannot use gets 400")
    strict: Optional[bool] = Field(None, description="the output is always constrained, as in vLLM: properties "
                                                     "the schema does not name are never generated")


# json_schema with "type": "json_schema" only, and then required, in the schema's words
JSON_SCHEMA_WITH_ITS_TYPE = {
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"]},
    "else": {"not": {"required": ["json_schema"]}},
}


class ResponseFormat(_Strict):
    """OpenAI's: "text" (no constraint), "json_object" (any JSON object) or "json_schema" (a match of
    json_schema.schema)."""

    model_config = ConfigDict(json_schema_extra=JSON_SCHEMA_WITH_ITS_TYPE)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec = Field(None, description="with type json_schema only (then required)",
                                        json_schema_extra=lambda schema: schema.pop("default", None))

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and not allowed otherwise")
        return self


JsonObjectText = Annotated[str, Field(pattern=r"^\s*\{[\s\S]*\}\s*$")]
GuidedJson = Annotated[Union[dict[str, Any], JsonObjectText],
                      Field(description="the JSON schema the output must match, or its JSON text (one the grammar "
                                        "compiler cannot use gets 400)")]
NonEmpty = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[NonEmpty], Field(min_length=1)]
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(v, name: str):
    """A schema given as JSON text must hold an object (a schema)."""
    if isinstance(v, str):
        try:
            schema = json.loads(v)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{name} must be a JSON schema (an object)")
        return schema
    return v


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint. Its whitespace and structural-tag options are
    not implemented (refused unless null)."""

    json_schema: Optional[GuidedJson] = Field(None, alias="json")
    regex: Optional[NonEmpty] = Field(None, description="a regular expression the whole output matches "
                                                        "(no lookaround or backreferences)")
    choice: Optional[Choices] = Field(None, description="the output is exactly one of these strings")
    grammar: Optional[NonEmpty] = Field(None, description="an EBNF grammar (xgrammar's GBNF) with a root rule")
    json_object: Optional[bool] = Field(None, description="true: any JSON object")
    whitespace_pattern: None = None
    structural_tag: None = None

    _unsupported = field_validator("whitespace_pattern", "structural_tag", mode="before")(_neutral_only)

    @field_validator("json_schema", mode="after")
    @classmethod
    def _schema(cls, v):
        return _schema_text(v, "json")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = self.given()
        if len(given) != 1:
            raise ValueError(f"takes exactly one of {', '.join(CONSTRAINTS)} (got {', '.join(given) or 'none'})")
        return self

    def given(self) -> list[str]:
        values = (self.json_schema, self.regex, self.choice, self.grammar, self.json_object or None)
        return [name for name, value in zip(CONSTRAINTS, values) if value is not None]

    def options(self) -> dict[str, Any]:
        """StructuredOutputsParams' keyword arguments."""
        kind = self.given()[0]
        return {"json": self.json_schema} if kind == "json" else {kind: getattr(self, kind)}


# one constraint a request, in the schema's words: no two of these fields set (a response_format of type text
# sets none)
_SET = {f: {"not": {"type": "null"}} for f in GUIDED + ("structured_outputs",)}
_SET["response_format"] = {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
ONE_CONSTRAINT = {"not": {"anyOf": [{"required": [a, b], "properties": {a: _SET[a], b: _SET[b]}}
                                    for i, a in enumerate(_SET) for b in list(_SET)[i + 1:]]}}
NO_CONSTRAINT = {f: {"type": "null"} for f in GUIDED + ("structured_outputs",)}
NO_CONSTRAINT["response_format"] = {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}
# tool_choice "required" or a named function needs tools, and excludes the other constraints
FORCED_CALL_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                                                 {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}, **NO_CONSTRAINT}},
}


class SamplingFields(_Strict):
    """The sampling fields every generation endpoint takes (OpenAI's and vLLM's extras), and vLLM's `priority`."""

    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Optional[Union[StopString, list[StopString]]] = None
    seed: Optional[Seed] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[LogitBias] = None
    user: Optional[str] = None  # OpenAI's end-user id: accepted, has no effect
    # vLLM-style extras
    top_k: Optional[TopK] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=100,
                                                description="> 1 discourages repeats; the range keeps logits finite")
    min_tokens: Optional[Annotated[int, Field(ge=0, description="at most max_tokens (16 by default for "
                                                               "completions)"), BeforeValidator(_whole)]] = None
    allowed_token_ids: Optional[list[TokenId]] = Field(None, min_length=1, description="vLLM's: only these tokens "
                                                                                    "can be sampled")
    bad_words: Optional[list[NonEmpty]] = Field(None, description="vLLM's: words the output never contains as "
                                                                 "tokenized (alone, and after a space)")
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=-1), BeforeValidator(_whole)]] = Field(
        None, description="vLLM's: keep only the prompt's last k tokens (-1: max_model_len's worth)")
    include_stop_str_in_output: bool = Field(False, description="the stop string that ended the output stays in it")
    skip_special_tokens: bool = Field(True, description="false: special tokens (<|im_end|>, ...) appear in the text")
    priority: Int = Field(0, description="with --scheduling-policy priority: lower runs first (otherwise only 0)")
    cache_salt: Optional[NonEmpty] = Field(None, description="vLLM's: the request shares cached KV only with "
                                                             "requests of the same salt")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, v):
        if v == 0:
            raise ValueError("must be -1 (max_model_len) or at least 1")
        return v

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (all of them when unset)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if keep == -1 else keep):]

    @field_validator("stop", mode="before")
    @classmethod
    def _no_empty_stop(cls, v):
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling_options(self, max_tokens: int, logprobs: Optional[int], defaults: Optional[dict] = None
                         ) -> dict[str, Any]:
        """SamplingParams' keyword arguments for this request (`logit_bias` with int keys); `defaults`: the
        model's sampling defaults (SamplingParams names), for the fields the request leaves out."""
        options = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        sampling = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens)
        options.update((k, v) for k, v in sampling.items() if v is not None)
        options.update(seed=self.seed, max_tokens=max_tokens, stop=self.stop or [],
                       stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
                       include_stop_str_in_output=self.include_stop_str_in_output,
                       skip_special_tokens=self.skip_special_tokens)
        if self.logit_bias is not None:
            options["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            options["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.bad_words:
            options["bad_words"] = list(self.bad_words)
        return options


class SamplingRequest(SamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, ONE_CONSTRAINT]})
    logprobs_field: ClassVar[str] = "logprobs"  # the field that sets SamplingParams.logprobs

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[PositiveInt] = None
    n: Optional[Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_whole)]] = None
    use_beam_search: Optional[Literal[False]] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[GuidedJson] = None
    guided_regex: Optional[NonEmpty] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[NonEmpty] = None
    return_tokens_as_token_ids: Optional[bool] = Field(None, description="vLLM's: logprobs name tokens "
                                                                         "'token_id:N' (default: the server's flag)")

    _unsupported = field_validator(*UNSUPPORTED, mode="before", check_fields=False)(_neutral_only)

    @field_validator("guided_json", mode="after")
    @classmethod
    def _guided_json_schema(cls, v):
        return _schema_text(v, "guided_json")

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self.constraints()
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} exclude each other: send one")
        return self

    def constraints(self) -> list[str]:
        """The structured-output fields set (a response_format of type text is none)."""
        fmt = self.response_format
        given = ["response_format"] if fmt is not None and fmt.type != "text" else []
        return given + [f for f in GUIDED + ("structured_outputs",) if getattr(self, f) is not None]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def structured_options(self) -> Optional[dict[str, Any]]:
        """StructuredOutputsParams' keyword arguments for this request's constraint (None: none)."""
        fmt = self.response_format
        if self.structured_outputs is not None:
            return self.structured_outputs.options()
        for name in GUIDED:
            if getattr(self, name) is not None:
                return {name.removeprefix("guided_"): getattr(self, name)}
        if fmt is not None and fmt.type == "json_object":
            return {"json_object": True}
        if fmt is not None and fmt.type == "json_schema":
            return {"json": fmt.json_schema.json_schema}
        return None


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: Union[Text, TokenIds, Annotated[list[Text], Field(min_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1)]] = Field(
        description="a prompt (text or token ids) or a list of them, each answered with n choices (choice "
                    "prompt x n + j); with max_tokens each must fit max_model_len (GET /v1/models), counted in "
                    "tokens")
    max_tokens: Optional[Annotated[int, Field(ge=0, description="0 (with echo only): the prompt alone comes back"),
                                   BeforeValidator(_whole)]] = None
    logprobs: Optional[NumLogprobs] = None
    echo: Optional[bool] = Field(None, description="the prompt before the completion, in the text and (with "
                                                   "logprobs) the logprobs: the first token's is null")
    prompt_logprobs: Optional[NumLogprobs] = Field(None, description="vLLM's: per prompt token (the first: null) "
                                                                     "its logprob, rank and this many alternatives, "
                                                                     "in the choice's prompt_logprobs")
    suffix: None = None
    best_of: Optional[Literal[1]] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_empty_prompt(cls, v):
        """A clearer message than the types' for the likely mistake."""
        if v in ("", []):
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) and ("" in v or [] in v):
            raise ValueError(f"prompt {v.index('' if '' in v else [])} of the list is empty")
        return v

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (the prompt alone comes back)")
        return self

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, a list of one for a single prompt."""
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if single else list(self.prompt)


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


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateInput:
    """What a chat template renders: `messages` and `tools`, with `add_generation_prompt`,
    `continue_final_message` and `chat_template_kwargs` (a request model's fields)."""

    def template_options(self) -> dict[str, Any]:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, **(self.chat_template_kwargs or {}))

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(SamplingRequest, ChatTemplateInput):
    model_config = ConfigDict(json_schema_extra={"allOf": [STREAM_OPTIONS_NEED_STREAM, ONE_CONSTRAINT,
                                                           FORCED_CALL_NEEDS_TOOLS]})

    logprobs_field: ClassVar[str] = "top_logprobs"
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[PositiveInt] = None
    logprobs: bool = False
    top_logprobs: Optional[NumLogprobs] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = Field(
        None, description="'required' or a named function (one of tools): the output is constrained to a call "
                          "(of one of the tools, or of that function) and comes back as tool_calls")
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="the last message (the assistant's) is left open for "
                                                            "the output to continue (with add_generation_prompt "
                                                            "false)")
    functions: None = None
    function_call: None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _some_messages(cls, v):
        if v == []:
            raise ValueError("messages must not be empty")
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
    def forces_tool_call(self) -> bool:
        """tool_choice 'required' or a named function: the output must be a tool call."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs for this request (None: none asked for)."""
        return (self.top_logprobs or 0) if self.logprobs else None

# ---- /tokenize, /detokenize (vLLM's) -------------------------------------------------------------
class TokenizeRequest(_Strict, ChatTemplateInput):
    """A `prompt` (text) or chat `messages` (with `tools`), not both."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = Field(None, description="default: true for a prompt (as /v1/completions), "
                                                                 "false for messages (the template writes them)")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="messages: leave the last one open")
    tools: Optional[list[Tool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = Field(False, description="also each token's string (the tokenizer's own spelling)")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages (one of them)")
        return self


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[TokenId]
