"""Parsers that split chat output text as it streams: reasoning (`<think>...</think>`) and tool calls
(hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; llama3_json `{"name": ..., "parameters":
{...}}` objects, Llama 3.1-3.3's).

Each parser takes text in arbitrary pieces (`feed`) and returns what each piece adds; text that might be
the start of a tag is held back until the next piece decides, and `finish` flushes it. A non-streamed
response runs the same parser over the whole text, so streamed and non-streamed responses agree whatever
the chunking.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Union


class TagFinder:
    """Finds `tag` in text that arrives in pieces."""

    def __init__(self, tag: str):
        self.tag = tag
        self.held = ""

    def feed(self, text: str) -> tuple[str, Optional[str]]:
        """(text before the tag, text after it); after is None while the tag has not appeared. A tail that
        could be the start of the tag is held back."""
        buf = self.held + text
        i = buf.find(self.tag)
        if i >= 0:
            self.held = ""
            return buf[:i], buf[i + len(self.tag):]
        keep = _partial_tag_suffix(buf, self.tag)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---- reasoning ------------------------------------------------------------------------------------
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits the reasoning at the start of an output from the answer after it.

    qwen3: the output is reasoning only if it opens with <think>. deepseek-r1: the chat template puts
    <think> in the prompt, so text up to </think> is reasoning with or without the opening tag. An output
    that ends inside the reasoning is all reasoning. Newlines right after </think> are dropped.
    """

    def __init__(self, style: str):
        if style not in ("qwen3", "deepseek-r1"):
            raise ValueError(f"unknown reasoning parser {style!r}")
        self.implicit_open = style == "deepseek-r1"
        self.state = "opening"  # -> "reasoning" -> "content", or "opening" -> "content"
        self.pending = ""
        self.closer = TagFinder(THINK_CLOSE)
        self.strip_newlines = False

    def feed(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        if self.state == "opening":
            self.pending += text
            head = self.pending.lstrip()
            if head.startswith(THINK_OPEN):
                text, self.state = head[len(THINK_OPEN):], "reasoning"
            elif THINK_OPEN.startswith(head):  # too short to tell
                return delta
            else:
                text, self.state = self.pending, "reasoning" if self.implicit_open else "content"
            self.pending = ""
        if self.state == "reasoning":
            before, after = self.closer.feed(text)
            delta.reasoning += before
            if after is None:
                return delta
            text, self.state, self.strip_newlines = after, "content", True
        delta.content += self._content(text)
        return delta

    def _content(self, text: str) -> str:
        if self.strip_newlines:
            text = text.lstrip("\n")
            self.strip_newlines = not text
        return text

    def finish(self) -> ReasoningDelta:
        if self.state == "opening":
            text, self.pending = self.pending, ""
            return ReasoningDelta(reasoning=text) if self.implicit_open else ReasoningDelta(content=text)
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=self.closer.flush())
        return ReasoningDelta()


# ---- tool calls -----------------------------------------------------------------------------------
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first piece carries id and name, later ones argument text."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The `delta.tool_calls[]` entry of a streamed chunk."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _CallScanner:
    """Reads one tool-call JSON object as it arrives: its top-level "name" string, and the raw text of its
    top-level arguments value (key one of `args_keys`; it can be sent as it grows when it is an object or an
    array)."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",)):
        self.args_keys = args_keys
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start: Optional[int] = None  # of a top-level string
        self.key: Optional[str] = None
        self.after_colon = False
        self.name: Optional[str] = None
        self.args_start: Optional[int] = None
        self.args_end: Optional[int] = None
        self.index: Optional[int] = None  # set when the call is reported
        self.sent = 0  # argument characters reported

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._scan(self.text[i], i)

    def _in_args(self) -> bool:
        return self.args_start is not None and self.args_end is None

    def _scan(self, c: str, i: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.string_start is not None:
                    self._top_level_string(i)
            return
        if self.depth == 1 and self.after_colon and self.key in self.args_keys and self.args_start is None \
                and not c.isspace():
            self.args_start = i
        if c == '"':
            self.in_string = True
            self.string_start = i if self.depth == 1 else None
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self._in_args() and self.depth <= 1:  # an object/array value closed, or a scalar ended by "}"
                self.args_end = i + 1 if self.depth == 1 else i
        elif self.depth == 1 and c == ":":
            self.after_colon = True
        elif self.depth == 1 and c == ",":
            if self._in_args():
                self.args_end = i
            self.key, self.after_colon = None, False

    def _top_level_string(self, end: int) -> None:
        raw = self.text[self.string_start:end + 1]
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw[1:-1]
        if not self.after_colon:
            self.key = value
        elif self.key == "name" and self.name is None:
            self.name = value
        elif self.key in self.args_keys and self.args_start == self.string_start:
            self.args_end = end + 1

    def arguments(self, final: bool) -> str:
        """The arguments JSON text known so far (final: the whole of it, once the block has ended)."""
        if self.args_start is None:
            return "{}" if final else ""
        end = self.args_end if self.args_end is not None else len(self.text)
        raw = self.text[self.args_start:end]
        if raw[0] in "{[":
            return raw
        if not final:
            return ""
        if raw[0] == '"':  # arguments given as a JSON string: its content is the arguments text
            try:
                return json.loads(raw)
            except ValueError:
                return raw[1:]
        return raw.strip()


class _ToolParser:
    """What the tool-call parsers share: a call is reported as soon as its name is known (id, type and name
    first), then its arguments as their JSON text arrives."""

    def __init__(self, new_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"):
        self.new_id = new_id
        self.block: Optional[_CallScanner] = None  # the call being read
        self.num_calls = 0

    def _call_deltas(self, final: bool) -> list[ToolCallDelta]:
        block = self.block
        if block.name is None:
            return []
        out = []
        if block.index is None:
            block.index = self.num_calls
            self.num_calls += 1
            out.append(ToolCallDelta(block.index, self.new_id(), block.name))
        args = block.arguments(final)
        if len(args) > block.sent:
            out.append(ToolCallDelta(block.index, arguments=args[block.sent:]))
            block.sent = len(args)
        return out


class HermesToolParser(_ToolParser):
    """Turns `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks into tool calls. A block whose
    name is never found is given back as content, tags included. Whitespace next to tool-call blocks is
    dropped."""

    def __init__(self, *args):
        super().__init__(*args)
        self.opener = TagFinder(TOOL_OPEN)
        self.closer = TagFinder(TOOL_CLOSE)
        self.trailing_ws = ""  # content whitespace held until we know whether a call follows
        self.ws_before_block = ""
        self.strip_leading = False

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        rest: Optional[str] = text
        while rest is not None:
            if self.block is None:
                before, rest = self.opener.feed(rest)
                delta.content += self._content(before)
                if rest is not None:
                    self.block = _CallScanner()
                    self.ws_before_block, self.trailing_ws = self.trailing_ws, ""
            else:
                before, rest = self.closer.feed(rest)
                self.block.feed(before)
                delta.tool_calls += self._call_deltas(final=False)
                if rest is not None:
                    self._end_block(delta, closed=True)
        return delta

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self.block is not None:
            self.block.feed(self.closer.flush())
            self._end_block(delta, closed=False)
        else:
            delta.content += self._content(self.opener.flush())
        if not self.num_calls:
            delta.content += self.trailing_ws
        self.trailing_ws = ""
        return delta

    def _end_block(self, delta: ToolDelta, closed: bool) -> None:
        delta.tool_calls += self._call_deltas(final=True)
        block, self.block = self.block, None
        if block.name is not None:
            self.strip_leading = True
        else:
            raw = TOOL_OPEN + block.text + (TOOL_CLOSE if closed else "")
            delta.content += self._content(self.ws_before_block + raw)
        self.ws_before_block = ""

    def _content(self, text: str) -> str:
        if self.strip_leading:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_leading = False
        text = self.trailing_ws + text
        body = text.rstrip()
        self.trailing_ws = text[len(body):]
        return body


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(_ToolParser):
    """Llama 3.1-3.3's JSON tool calls (vLLM's `llama3_json`): an output that opens, after whitespace and an
    optional <|python_tag|>, with "{" is JSON objects `{"name": ..., "parameters": {...}}` ("arguments" is
    read too) separated by ";" and whitespace; any other output is content. An object whose name is never
    found is given back as content, as is text after the calls."""

    def __init__(self, *args):
        super().__init__(*args)
        self.state = "opening"  # -> "calls" or "content"
        self.pending = ""

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        if self.state == "opening":
            self.pending += text
            head = self.pending.lstrip()
            head = head[len(PYTHON_TAG):].lstrip() if head.startswith(PYTHON_TAG) else head
            if not head or PYTHON_TAG.startswith(head):  # too short to tell
                return delta
            self.state = "calls" if head.startswith("{") else "content"
            text = head if self.state == "calls" else self.pending
            self.pending = ""
        for i, c in enumerate(text):
            if self.state == "content":
                delta.content += text[i:]
                break
            self._scan(c, delta)
        return delta

    def _scan(self, c: str, delta: ToolDelta) -> None:
        if self.block is None:
            if c.isspace() or c == ";":
                return
            if c != "{":
                self.state = "content"  # text after the calls
                delta.content += c
                return
            self.block = _CallScanner(("parameters", "arguments"))
        self.block.feed(c)
        delta.tool_calls += self._call_deltas(final=False)
        if self.block.depth == 0:
            self._end_block(delta)

    def _end_block(self, delta: ToolDelta) -> None:
        delta.tool_calls += self._call_deltas(final=True)
        block, self.block = self.block, None
        if block.name is None:
            delta.content += block.text

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self.state == "opening":
            delta.content, self.pending = self.pending, ""
        elif self.block is not None:  # cut off inside an object
            self._end_block(delta)
        return delta


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


# ---- both, for a chat response --------------------------------------------------------------------
@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: "ChatDelta") -> "ChatDelta":
        return ChatDelta(self.reasoning + other.reasoning, self.content + other.content,
                         self.tool_calls + other.tool_calls)


class ChatOutputParser:
    """Reasoning first (when configured), then tool calls in the content (when the request has tools)."""

    def __init__(self, reasoning: Optional[str], tools: Optional[str]):
        """reasoning, tools: the parsers' names (None: no such parsing)."""
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = TOOL_PARSERS[tools]() if tools else None

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools else 0

    def feed(self, text: str) -> ChatDelta:
        r = self.reasoning.feed(text) if self.reasoning else ReasoningDelta(content=text)
        t = self.tools.feed(r.content) if self.tools else ToolDelta(r.content)
        return ChatDelta(r.reasoning, t.content, t.tool_calls)

    def finish(self) -> ChatDelta:
        r = self.reasoning.finish() if self.reasoning else ReasoningDelta()
        if not self.tools:
            return ChatDelta(r.reasoning, r.content)
        t = self.tools.feed(r.content)
        end = self.tools.finish()
        return ChatDelta(r.reasoning, t.content, t.tool_calls) + ChatDelta("", end.content, end.tool_calls)


class FramedOutputParser:
    """A parser over `prefix` + the output + `suffix`: for an output that is the inside of a block whose
    opening is in the prompt and whose end is implied (a forced tool call, server/structured.py)."""

    def __init__(self, inner: ChatOutputParser, prefix: str, suffix: str):
        self.inner = inner
        self.prefix = prefix
        self.suffix = suffix

    @property
    def num_tool_calls(self) -> int:
        return self.inner.num_tool_calls

    def feed(self, text: str) -> ChatDelta:
        text, self.prefix = self.prefix + text, ""
        return self.inner.feed(text)

    def finish(self) -> ChatDelta:
        return self.feed(self.suffix) + self.inner.finish()


@dataclass
class ParsedMessage:
    """A whole chat response's text, split: what goes into a non-streamed `message`."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"}

    def add(self, delta: ChatDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        for piece in delta.tool_calls:
            if piece.name is not None:
                self.tool_calls.append({"id": piece.id, "name": piece.name, "arguments": ""})
            self.tool_calls[piece.index]["arguments"] += piece.arguments


def parse_message(parser: Union[ChatOutputParser, FramedOutputParser], text: str) -> ParsedMessage:
    """The whole text through the same parser a stream uses."""
    message = ParsedMessage()
    message.add(parser.feed(text) + parser.finish())
    return message
