"""Structured output on the server: OpenAI's `response_format` and `tool_choice`, vLLM's `structured_outputs`
and `guided_*` fields, onto the engine's grammar (`SamplingParams.structured_outputs`, layers/grammar.py).

- `response_format` {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema":
  {"schema": S}}: a match of S; {"type": "text"}: no constraint. Both endpoints.
- `structured_outputs` {"json": S} (or its JSON text), {"regex": R}, {"choice": [...]}, {"grammar": EBNF},
  {"json_object": true}; `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` the same (vLLM
  before 0.12). Both endpoints.
- `tool_choice` "required" or {"type": "function", "function": {"name": X}} (chat): the output is
  constrained to a tool call and comes back as `tool_calls` with finish_reason "tool_calls"
  (`forced_tool_call`).

A constraint is compiled before the request is submitted, so one the grammar compiler cannot use (a schema,
a regex, a grammar) gets a 400 naming the problem rather than a failed stream.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..sampling_params import SamplingParams
from .errors import bad_request
from .parsers import TOOL_CLOSE, TOOL_OPEN
from .protocol import ChatCompletionRequest, Tool


@dataclass(frozen=True)
class ForcedToolCall:
    """How a request whose output must be a tool call is framed: in the hermes format, or in Llama 3.1's JSON
    where the server reads calls with llama3_json (`parser`: the parser that reads it).

    The hermes tool-call parser (parsers.HermesToolParser, the format of the shipped model's chat template;
    a forced call is read with it unless the server reads llama3_json) reads
    `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`.
    The engine's grammar is a JSON schema, so it constrains the JSON inside the block and the tags around
    it are the server's: `prefix` ends the prompt (the model continues a block it has been trained to
    write) and is fed to the parser before the output, `suffix` after it. So a forced call goes through
    the very parser, streaming included, that reads the calls a model makes of its own accord.

    - "required": prefix `<tool_call>\\n`, schema anyOf over the tools of {"name": const, "arguments":
      the tool's parameters} (name first, so a stream names the call before its arguments arrive);
    - a named function X (as vLLM): prefix `<tool_call>\\n{"name": "X", "arguments": `, schema X's
      parameters; the output is the arguments alone.
    In Llama 3.1's JSON (llama3_json) the same without the tags, and with "parameters" for "arguments".
    """

    schema: dict[str, Any]
    prefix: str
    suffix: str
    parser: str = "hermes"


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def forced_tool_call(req: ChatCompletionRequest, parser: Optional[str] = None) -> Optional[ForcedToolCall]:
    """The framing of a request with tool_choice "required" or a named function; None for others. parser: the
    server's tool-call parser: llama3_json (or SGLang's llama3) frames the call as the JSON object Llama 3.1
    writes, `{"name": ..., "parameters": {...}}`, with no tags; any other, or none, in hermes's block.
    Raises a 400 when there is no such tool, or another constraint is asked for too."""
    if not req.forces_tool_call:
        return None
    choice = req.tool_choice
    what = "'required'" if choice == "required" else f"naming function {choice.function.name!r}"
    if not req.tools:
        raise bad_request(f"tool_choice {what} needs tools", "tool_choice")
    if req.constraints():
        raise bad_request(f"tool_choice {what} excludes {req.constraints()[0]}", "tool_choice")
    llama3 = parser in ("llama3_json", "llama3")
    key, opening, closing = ("parameters", "", "") if llama3 else ("arguments", f"{TOOL_OPEN}\n", f"\n{TOOL_CLOSE}")
    parser = "llama3_json" if llama3 else "hermes"
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, key: _parameters(t)},
                  "required": ["name", key]} for t in req.tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ForcedToolCall(schema, opening, closing, parser)
    tool = next((t for t in req.tools if t.function.name == choice.function.name), None)
    if tool is None:
        names = ", ".join(repr(t.function.name) for t in req.tools)
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools ({names})",
                          "tool_choice")
    prefix = f'{opening}{{"name": {json.dumps(tool.function.name)}, "{key}": '
    return ForcedToolCall(_parameters(tool), prefix, "}" + closing, parser)


_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # xgrammar's "[04:38:56] /path/file.cc:5088: "


async def check_grammar(tokenizer, params: SamplingParams, param: Optional[str]) -> None:
    """Compile the request's grammar (off the event loop; the compiler caches it for the engine): a 400
    naming the problem when the schema cannot be used."""
    if not params.guided:
        return
    if tokenizer is None:
        raise bad_request("structured output needs a model folder with a tokenizer", param)
    from ..layers.grammar import Grammar

    kind = params.structured_outputs.kind
    try:
        await asyncio.to_thread(Grammar, params, tokenizer, [])
    except ValueError as e:
        message, about = str(e), f"invalid sampling parameter: structured_outputs.{kind}: "
        if not message.startswith(about):  # not the constraint's fault (xgrammar is not installed)
            raise bad_request(message.removeprefix("invalid sampling parameter: "), param) from None
        message = _LOG_PREFIX.sub("", message.removeprefix(about)).strip()
        raise bad_request(f"unusable {UNUSABLE[kind]}: {message}", param) from None


UNUSABLE = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


def guided_param(req) -> Optional[str]:
    """The request field a grammar error is about."""
    if isinstance(req, ChatCompletionRequest) and req.forces_tool_call:
        return "tools"
    if req.structured_outputs is not None:
        return "structured_outputs." + req.structured_outputs.options().popitem()[0]
    given = req.constraints()
    if given == ["response_format"] and req.response_format.type == "json_schema":
        return "response_format.json_schema.schema"
    return given[0] if given else None
