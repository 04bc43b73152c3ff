"""Tool-call parsers for chat output as it streams (hermes, llama3_json, qwen3_coder, pythonic), and the tag finder the
parsers share. Each takes text in arbitrary pieces (`feed`) and returns what each piece adds (content, and
tool-call deltas: a call's id and name first, then its arguments' JSON text as it grows); `finish` flushes
what was held back. Text that might be the start of a tag is held back until the next piece decides."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional


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

    def __init__(self, tools: Optional[list[dict]] = None,
                 new_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"):
        """tools: the request's tools (OpenAI's shape), for a format whose argument values need their types."""
        self.tools = tools or []
        self.new_id = new_id
        self.block = None  # the call being read (its format's reader: _CallScanner, _XmlCall)
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
    dropped. A block's text is read by `_open_block` / `_block_text` / `_end_block`: a JSON object here,
    another format in a subclass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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
                    self.ws_before_block, self.trailing_ws = self.trailing_ws, ""
                    self._open_block()
            else:
                before, rest = self.closer.feed(rest)
                self._block_text(before, delta)
                if rest is not None:
                    self._end_block(delta, closed=True)
        return delta

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self.block is not None:
            self._block_text(self.closer.flush(), delta)
            self._end_block(delta, closed=False)
        else:
            delta.content += self._content(self.opener.flush())
        if not self.num_calls:
            delta.content += self.trailing_ws
        self.trailing_ws = ""
        return delta

    def _open_block(self) -> None:
        self.block = _CallScanner()

    def _block_text(self, text: str, delta: ToolDelta) -> None:
        self.block.feed(text)
        delta.tool_calls += self._call_deltas(final=False)

    def _end_block(self, delta: ToolDelta, closed: bool) -> None:
        delta.tool_calls += self._call_deltas(final=True)
        self._close_block(delta, closed)

    def _close_block(self, delta: ToolDelta, closed: bool) -> None:
        """The open block is over: a call (what follows loses its leading whitespace) or, without a name,
        content again, tags and all."""
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
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


FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
FUNCTION_CLOSE = "</function>"


@dataclass
class _XmlCall:
    """One Qwen3-Coder block as it arrives."""

    text: str = ""
    name: Optional[str] = None
    index: Optional[int] = None
    at: int = 0  # where in text the next parameter may start
    params: int = 0  # parameters reported


class Qwen3CoderToolParser(HermesToolParser):
    """Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`): `<tool_call><function=NAME><parameter=KEY>VALUE
    </parameter>...</function></tool_call>`, in hermes's blocks. A call is reported once its function tag is
    complete, then its arguments as JSON, a parameter at a time as each closes; a value is typed by the tool's
    parameter schema (integer, number, boolean, object, array; text otherwise, one newline trimmed at each
    end). A block without a function tag is given back as content, tags included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.types = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
                      for t in self.tools if "function" in t}

    def _open_block(self) -> None:
        self.block = _XmlCall()

    def _block_text(self, text: str, delta: ToolDelta) -> None:
        call = self.block
        call.text += text
        if call.name is None:
            match = FUNCTION_OPEN.search(call.text)
            if match is None:
                return
            call.name, call.at, call.index = match.group(1).strip(), match.end(), self.num_calls
            self.num_calls += 1
            delta.tool_calls.append(ToolCallDelta(call.index, self.new_id(), call.name))
        for match in PARAMETER.finditer(call.text, call.at):
            self._parameter(match.group(1), match.group(2), delta)
            call.at = match.end()

    def _parameter(self, key: str, raw: str, delta: ToolDelta) -> None:
        call = self.block
        kind = self.types.get(call.name, {}).get(key.strip(), {}).get("type")
        value = json.dumps({key.strip(): _typed(raw, kind)}, ensure_ascii=False)[1:-1]
        delta.tool_calls.append(ToolCallDelta(call.index, arguments=("{" if not call.params else ", ") + value))
        call.params += 1

    def _end_block(self, delta: ToolDelta, closed: bool) -> None:
        call = self.block
        if call.name is not None:
            tail = PARAMETER_OPEN.search(call.text, call.at)  # cut off inside a value: what arrived of it
            if tail is not None and not closed:
                end = call.text.find(FUNCTION_CLOSE, tail.end())
                self._parameter(tail.group(1), call.text[tail.end():end if end >= 0 else len(call.text)], delta)
            delta.tool_calls.append(ToolCallDelta(call.index, arguments="}" if call.params else "{}"))
        self._close_block(delta, closed)


def _typed(raw: str, kind: Optional[str]):
    """A parameter's text as its schema type says (text when it says none, or the text does not parse)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if kind in (None, "string"):
        return text
    if text.strip().lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(text.strip())
        if kind == "number":
            number = float(text.strip())
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean":
            return {"true": True, "false": False}[text.strip().lower()]
        return json.loads(text)
    except (ValueError, KeyError):
        return text


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
CLOSERS = {"(": ")", "[": "]", "{": "}"}


@dataclass
class _PyCall:
    """One call of a pythonic list as it arrives: its name, then its arguments' text up to the closing paren."""

    text: str = ""  # the name, then (after "(") the argument being read
    name: Optional[str] = None
    index: Optional[int] = None
    args: int = 0  # arguments reported
    depth: list = field(default_factory=list)  # brackets open inside the argument
    quote: Optional[str] = None  # the string literal being read
    escaped: bool = False


class PythonicToolParser(_ToolParser):
    """Llama 3.2 / Llama 4's pythonic tool calls (vLLM's and SGLang's `pythonic`): an output that opens, after
    whitespace and an optional <|python_start|>, with "[" is a Python list of calls `[f(a=1, b="x"), g()]` whose
    keyword arguments are Python literals; any other output is content. A call is reported once its name and "("
    have arrived, then its arguments as JSON, one at a time as each value completes (a value that is no literal
    comes as its text; a positional argument as "argN"). What follows the list (<|python_end|> dropped) is
    content, and so is a list that holds no call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = "opening"  # -> "list" -> "after", or "content"
        self.pending = ""  # the opening, held until it decides; then the list's text until its first call

    def feed(self, text: str) -> ToolDelta:
        delta = ToolDelta()
        if self.state == "opening":
            self.pending += text
            head = self.pending.lstrip()
            head = head[len(PYTHON_START):].lstrip() if head.startswith(PYTHON_START) else head
            if not head or PYTHON_START.startswith(head):  # too short to tell
                return delta
            if not head.startswith("["):
                self.state, text, self.pending = "content", self.pending, ""
            else:
                self.state, text, self.pending = "list", head[1:], "["
        for i, c in enumerate(text):
            if self.state in ("content", "after"):
                delta.content += self._after(text[i:])
                break
            self._scan(c, delta)
        return delta

    def _after(self, text: str) -> str:
        """Text after the list: content, less <|python_end|> (or the start of one) and whitespace before it."""
        if self.state == "after":
            self.pending += text
            head = self.pending.lstrip()
            if PYTHON_END.startswith(head):
                return ""
            self.state, text = "content", head[len(PYTHON_END):].lstrip() if head.startswith(PYTHON_END) else head
            self.pending = ""
        return text

    def _scan(self, c: str, delta: ToolDelta) -> None:
        call = self.block
        if call is None:  # between calls
            if c.isspace() or (c == "," and self.num_calls):
                self.pending += c
            elif c == "]" and self.num_calls:
                self.state, self.pending = "after", ""
            elif c.isalpha() or c == "_":
                self.block = _PyCall(c)
                self.pending += c
            else:  # not a list of calls: what came of it is content
                self.state, pending, self.pending = "content", self.pending + c, ""
                delta.content += pending if not self.num_calls else pending.lstrip(", \n")
            return
        if call.name is None:
            self.pending += c
            if c == "(":
                call.name, call.text, call.index = call.text.strip(), "", self.num_calls
                self.num_calls += 1
                delta.tool_calls.append(ToolCallDelta(call.index, self.new_id(), call.name))
            elif c.isalnum() or c in "_.":
                call.text += c
            else:  # no call after all: content (from the list's start when it is the first)
                delta.content += self.pending if not self.num_calls else call.text + c
                self.block, self.state, self.pending = None, "content", ""
            return
        self._argument_char(c, delta)

    def _argument_char(self, c: str, delta: ToolDelta) -> None:
        call = self.block
        if call.quote is not None:
            call.text += c
            if call.escaped:
                call.escaped = False
            elif c == "\\":
                call.escaped = True
            elif c == call.quote:
                call.quote = None
        elif c in "'\"":
            call.quote, call.text = c, call.text + c
        elif c in CLOSERS:
            call.depth.append(CLOSERS[c])
            call.text += c
        elif call.depth and c == call.depth[-1]:
            call.depth.pop()
            call.text += c
        elif not call.depth and c in ",)":
            self._argument(delta)
            if c == ")":
                delta.tool_calls.append(ToolCallDelta(call.index, arguments="}" if call.args else "{}"))
                self.block, self.pending = None, ""
        else:
            call.text += c

    def _argument(self, delta: ToolDelta) -> None:
        """The argument read so far, as JSON after those before it (nothing for an empty one)."""
        call = self.block
        text, call.text = call.text.strip(), ""
        if not text:
            return
        key, sep, value = text.partition("=")
        if not sep or not key.strip().isidentifier():
            key, value = f"arg{call.args}", text
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            parsed = value.strip()
        item = json.dumps({key.strip(): parsed}, ensure_ascii=False)[1:-1]
        delta.tool_calls.append(ToolCallDelta(call.index, arguments=("{" if not call.args else ", ") + item))
        call.args += 1

    def finish(self) -> ToolDelta:
        delta = ToolDelta()
        if self.state == "opening":
            delta.content, self.pending = self.pending, ""
        elif self.block is not None and self.block.name is not None:  # cut off inside a call: what arrived
            self._argument(delta)
            call, self.block = self.block, None
            delta.tool_calls.append(ToolCallDelta(call.index, arguments="}" if call.args else "{}"))
        elif self.state == "list" and not self.num_calls:  # "[" and no call: content
            delta.content += self.pending
        elif self.state == "after" and not PYTHON_END.startswith(self.pending.strip()):
            delta.content += self.pending.strip()
        return delta


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "qwen3_coder": Qwen3CoderToolParser,
                "pythonic": PythonicToolParser,
                "qwen25": HermesToolParser, "llama3": Llama3JsonToolParser}  # the last two: SGLang's names
