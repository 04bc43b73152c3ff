"""Reasoning and tool-call parsers as worked examples: this output text, so this message. Every example
is also fed in random chunkings (and one character at a time): the message must not depend on them."""
from __future__ import annotations

import itertools
import json
import random

import pytest

pytest.importorskip("fastapi")

from specserve.server.parsers import ChatOutputParser, ParsedMessage, TagFinder, parse_message  # noqa: E402


def chunkings(text: str, n: int = 30, seed: int = 0):
    """The whole text, one character at a time, and n random splits."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def parse_streamed(pieces: list[str], reasoning=None, tools=None, schemas=None) -> tuple[ParsedMessage, list]:
    parser = ChatOutputParser(reasoning, tools, schemas)
    message, deltas = ParsedMessage(), []
    for piece in pieces:
        delta = parser.feed(piece)
        deltas.append(delta)
        message.add(delta)
    end = parser.finish()
    deltas.append(end)
    message.add(end)
    return message, deltas


def same_in_every_chunking(text: str, reasoning=None, tools=None, schemas=None) -> ParsedMessage:
    whole = parse_message(ChatOutputParser(reasoning, tools, schemas), text)
    for pieces in chunkings(text):
        got, _ = parse_streamed(pieces, reasoning, tools, schemas)
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), pieces
        assert [(c["name"], c["arguments"]) for c in got.tool_calls] == \
               [(c["name"], c["arguments"]) for c in whole.tool_calls], pieces
    return whole


def test_tag_finder_holds_back_a_possible_tag_start():
    f = TagFinder("</think>")
    assert f.feed("abc</th") == ("abc", None)
    assert f.feed("ink>rest") == ("", "rest")
    assert f.feed("x</") == ("x", None)
    assert f.feed("y") == ("</y", None)
    assert f.flush() == ""


@pytest.mark.parametrize("style, text, reasoning, content", [
    ("qwen3", "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
    ("qwen3", "No thinking here.", "", "No thinking here."),
    ("qwen3", "<think>cut off in the midd", "cut off in the midd", ""),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<thinking> is not the tag", "", "<thinking> is not the tag"),
    ("qwen3", "<thi", "", "<thi"),
    ("deepseek-r1", "the template opened it</think>\n\nanswer", "the template opened it", "answer"),
    ("deepseek-r1", "<think>opened again</think>answer", "opened again", "answer"),
    ("deepseek-r1", "never closed", "never closed", ""),
    ("deepseek-r1", "x</think>", "x", ""),
])
def test_reasoning(style, text, reasoning, content):
    message = same_in_every_chunking(text, reasoning=style)
    assert (message.reasoning, message.content) == (reasoning, content)


def test_one_tool_call():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
            '</tool_call>')
    message = same_in_every_chunking(text, tools="hermes")
    assert message.content == "Let me look."
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "unit": "C"}
    assert call["id"].startswith("call_")


def test_two_calls_nested_arguments_and_tricky_strings():
    args = {"q": "a } in a string, a \"quote\" and </tool", "nested": {"list": [1, {"x": "]"}]}}
    text = (f'<tool_call>{{"name": "search", "arguments": {json.dumps(args)}}}</tool_call>\n'
            '<tool_call>{"arguments": {"n": 2}, "name": "second"}</tool_call>\n')
    message = same_in_every_chunking(text, tools="hermes")
    assert message.content == ""
    assert [c["name"] for c in message.tool_calls] == ["search", "second"]
    assert [json.loads(c["arguments"]) for c in message.tool_calls] == [args, {"n": 2}]


@pytest.mark.parametrize("text, content, calls", [
    # a block without a readable name is content, tags and all
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    # arguments given as a JSON string, or missing
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    # text after a call; an unclosed block (output cut off) still reports the call
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.', "Done.", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
    # no call at all: text is untouched, trailing whitespace included
    ("plain text with <tool but no call \n", "plain text with <tool but no call \n", []),
])
def test_tool_call_edge_cases(text, content, calls):
    message = same_in_every_chunking(text, tools="hermes")
    assert message.content == content
    assert [(c["name"], c["arguments"]) for c in message.tool_calls] == calls


def test_streaming_sends_the_name_first_then_argument_fragments():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    _, deltas = parse_streamed([text[i:i + 4] for i in range(0, len(text), 4)], tools="hermes")
    pieces = list(itertools.chain.from_iterable(d.tool_calls for d in deltas))
    first = pieces[0].to_openai()
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [p.to_openai() for p in pieces[1:]]
    assert len(fragments) > 2, "arguments should stream as they arrive"
    assert all(set(f) == {"index", "function"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'


def test_reasoning_then_tool_call():
    text = '<think>I need the weather.</think>\n\n<tool_call>{"name": "w", "arguments": {"c": "Oslo"}}</tool_call>'
    message = same_in_every_chunking(text, reasoning="qwen3", tools="hermes")
    assert message.reasoning == "I need the weather."
    assert message.content == ""
    assert [(c["name"], c["arguments"]) for c in message.tool_calls] == [("w", '{"c": "Oslo"}')]


# ---- llama3_json --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, content, calls", [
    # one call, Llama 3.1's own key ("parameters"), with or without <|python_tag|> and whitespace before it
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('\n  {"name": "f", "arguments": {"a": "}"}}', "", [("f", '{"a": "}"}')]),
    # several, separated by ";"
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": 2}]}}', "",
     [("a", "{}"), ("b", '{"x": [1, {"y": 2}]}')]),
    # not a call: text, or text that merely mentions JSON later
    ("The weather is fine.", "The weather is fine.", []),
    ('Use {"name": "f"} next time', 'Use {"name": "f"} next time', []),
    ("<|py", "<|py", []),
    # an object without a name is content; text after the calls is content; a cut-off call still reports
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f", "parameters": {}} and then', "and then", [("f", "{}")]),
    ('{"name": "f", "parameters": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
])
def test_llama3_json_calls(text, content, calls):
    message = same_in_every_chunking(text, tools="llama3_json")
    assert message.content == content
    assert [(c["name"], c["arguments"]) for c in message.tool_calls] == calls


def test_llama3_json_streams_the_name_first_then_argument_fragments():
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
    _, deltas = parse_streamed([text[i:i + 5] for i in range(0, len(text), 5)], tools="llama3_json")
    pieces = list(itertools.chain.from_iterable(d.tool_calls for d in deltas))
    assert pieces[0].to_openai()["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 3 and "".join(p.arguments for p in pieces[1:]) == '{"city": "Paris", "unit": "C"}'


# ---- qwen3_coder --------------------------------------------------------------------------------
SCHEMAS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"}, "dry": {"type": "boolean"},
    "opts": {"type": "object"}, "tags": {"type": "array"}}}}}]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("text, content, calls", [
    # values typed by the tool's schema; text keeps its inner newlines and backslashes, unescaped
    (xml_call("edit", path="a/b.py", line="12", scale="1.5", dry="true", opts='{"x": [1, 2]}', tags='["a"]'), "",
     [("edit", {"path": "a/b.py", "line": 12, "scale": 1.5, "dry": True, "opts": {"x": [1, 2]}, "tags": ["a"]})]),
    # (whitespace next to a block is dropped, as for hermes)
    ("Let me fix it.\n" + xml_call("edit", path='C:\\dir\\"q".py\nsecond line') + "\nDone.", "Let me fix it.Done.",
     [("edit", {"path": 'C:\\dir\\"q".py\nsecond line'})]),
    # unknown tool or parameter: text; a value that does not parse as its type: text
    (xml_call("other", n="7"), "", [("other", {"n": "7"})]),
    (xml_call("edit", line="twelve", dry="maybe"), "", [("edit", {"line": "twelve", "dry": "maybe"})]),
    # two calls, no parameters; a block without a function tag is content; a cut-off value still comes back
    (xml_call("edit") + xml_call("other", k="v"), "", [("edit", {}), ("other", {"k": "v"})]),
    ("<tool_call>no function</tool_call>", "<tool_call>no function</tool_call>", []),
    ("<tool_call>\n<function=edit>\n<parameter=path>\nx.py", "", [("edit", {"path": "x.py"})]),
])
def test_qwen3_coder_calls(text, content, calls):
    message = same_in_every_chunking(text, tools="qwen3_coder", schemas=SCHEMAS)
    assert message.content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in message.tool_calls] == calls


def test_qwen3_coder_streams_the_name_then_a_parameter_at_a_time():
    text = xml_call("edit", path="a.py", line="3")
    _, deltas = parse_streamed([text[i:i + 3] for i in range(0, len(text), 3)], tools="qwen3_coder", schemas=SCHEMAS)
    pieces = list(itertools.chain.from_iterable(d.tool_calls for d in deltas))
    assert pieces[0].to_openai()["function"] == {"name": "edit", "arguments": ""}
    assert [p.arguments for p in pieces[1:]] == ['{"path": "a.py"', ', "line": 3', "}"]


# ---- pythonic (Llama 3.2 / Llama 4) --------------------------------------------------------------
@pytest.mark.parametrize("text, content, calls", [
    # one call, keyword arguments of every literal kind; strings holding the list's own punctuation
    ("[get_weather(city='San Francisco', unit=\"celsius\")]", "",
     [("get_weather", {"city": "San Francisco", "unit": "celsius"})]),
    ("[f(a=1, b=2.5, c=True, d=None, e=[1, (2, 3)], g={'k': 'v, ) ]'}, h='it\\'s')]", "",
     [("f", {"a": 1, "b": 2.5, "c": True, "d": None, "e": [1, [2, 3]], "g": {"k": "v, ) ]"}, "h": "it's"})]),
    # several calls, no arguments, Llama 4's tags, whitespace around
    ("  <|python_start|>[a(), b.c(x=1)]<|python_end|>", "", [("a", {}), ("b.c", {"x": 1})]),
    ("[a(), b(y='z')]\nDone.", "Done.", [("a", {}), ("b", {"y": "z"})]),
    # not calls: text, a list of values, text that mentions a call later
    ("The answer is [f(x)].", "The answer is [f(x)].", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("<|py", "<|py", []),
    # a value that is no literal comes as its text, a positional argument as argN; a cut-off call still reports
    ("[f(x=some_name, 3)]", "", [("f", {"x": "some_name", "arg1": 3})]),
    ("[f(a=1, b='tw", "", [("f", {"a": 1, "b": "'tw"})]),
])
def test_pythonic_calls(text, content, calls):
    message = same_in_every_chunking(text, tools="pythonic")
    assert message.content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in message.tool_calls] == calls


def test_pythonic_streams_the_name_then_an_argument_at_a_time():
    text = "[get_weather(city='Paris', days=3)]"
    _, deltas = parse_streamed([text[i:i + 4] for i in range(0, len(text), 4)], tools="pythonic")
    pieces = list(itertools.chain.from_iterable(d.tool_calls for d in deltas))
    assert pieces[0].to_openai()["function"] == {"name": "get_weather", "arguments": ""}
    assert [p.arguments for p in pieces[1:]] == ['{"city": "Paris"', ', "days": 3', "}"]
