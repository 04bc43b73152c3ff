"""Parsers that split chat output text as it streams: reasoning (`<think>...</think>`), then tool calls
(server/tool_parsers.py: hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, llama3_json,
qwen3_coder).

Each parser takes text in arbitrary pieces (`feed`) and returns what each piece adds; text that might be
the start of a tag is held back until the next piece decides, and `finish` flushes it. A non-streamed
response runs the same parser over the whole text, so streamed and non-streamed responses agree whatever
the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .tool_parsers import TOOL_CLOSE, TOOL_OPEN, TOOL_PARSERS, TagFinder, ToolCallDelta, ToolDelta

__all__ = ["TOOL_CLOSE", "TOOL_OPEN", "TagFinder", "ChatDelta", "ChatOutputParser", "FramedOutputParser",
           "ParsedMessage", "ReasoningParser", "parse_message"]


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

    def __init__(self, reasoning: Optional[str], tools: Optional[str], schemas: Optional[list[dict]] = None):
        """reasoning, tools: the parsers' names (None: no such parsing); schemas: the request's tools."""
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = TOOL_PARSERS[tools](schemas) if tools else None

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
