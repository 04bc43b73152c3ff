"""Structured output through the server (issue 20, criterion 3): `specserve serve` on the shipped default pair
(EAGLE-3, speculation on every step), driven by the real `openai` client.

JSON-schema-constrained outputs (`response_format` json_schema on chat, vLLM's `guided_json` on completions)
parse and validate against their schema, and regex-, choice- and grammar-constrained ones (vLLM's
`structured_outputs` and `guided_*` fields) match theirs; greedy and seeded ones are the tokens the in-process
engine gives without speculation; json_object outputs are objects; tool_choice "required" returns a tool call of
one of the tools whose arguments validate, a named function a call to that function; unusable schemas and
contradictory requests get 400 naming the problem.
"""
from __future__ import annotations

import json
import random

import pytest

from specserve import SamplingParams, StructuredOutputsParams
from specserve.assets import default_model_path

from .conftest import make_llm
from .test_grammar import constraints, random_schema
from .test_server import MODEL, chat_prompt_ids, metric, serving

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

MAX_TOKENS = 160
NUM_SCHEMAS = 12
PROMPTS = ["def load(path):\n    return", "# settings\nCONFIG = ", "import json\n\n", "class A:\n    x = "]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped default model and its EAGLE-3 drafter, speculating on every step (fp32 on CPU, so
    that it can equal the engine without speculation token for token)."""
    yield from serving(tmp_path_factory.mktemp("server") / "server.log", "--dtype", "float32",
                       "--speculative-policy", "always", timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def plain():
    """The same model in process, without speculation: the oracle."""
    return make_llm(default_model_path(), speculative_algorithm="none", dtype="float32")


def cases():
    """(endpoint, prompt, schema, temperature, seed): random bounded object schemas, half greedy, half
    seeded, alternating completions (guided_json) and chat (response_format json_schema)."""
    rng = random.Random(20)
    out = []
    for i in range(NUM_SCHEMAS):
        temperature, seed = ((0.0, None), (1.0, 200 + i))[i // 2 % 2]
        endpoint = ("completions", "chat")[i % 2]
        prompt = PROMPTS[i % len(PROMPTS)] if endpoint == "completions" else f"Describe item {i} as JSON."
        out.append((endpoint, prompt, random_schema(rng), temperature, seed))
    return out


def test_json_schema_outputs_validate_and_equal_no_speculation(server, client, plain):
    accepted_before = metric(httpx.get(server.url + "/metrics").text, "specserve:spec_decode_num_accepted_tokens_total")
    finished = 0
    for endpoint, prompt, schema, temperature, seed in cases():
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                                structured_outputs=StructuredOutputsParams(json=schema))
        if endpoint == "completions":
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=temperature,
                                          seed=seed, extra_body={"guided_json": schema})
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            want = plain.generate([prompt], params)[0]
        else:
            messages = [{"role": "user", "content": prompt}]
            r = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema,
                                                                        "strict": True}})
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
            want = plain.generate([chat_prompt_ids(plain, messages)], params)[0]
        assert (text, reason) == (want.text, want.finish_reason), (endpoint, schema, temperature)
        if reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(text), schema)
    assert finished >= NUM_SCHEMAS - 1, "nearly all outputs complete within max_tokens"
    accepted = metric(httpx.get(server.url + "/metrics").text, "specserve:spec_decode_num_accepted_tokens_total")
    assert accepted - accepted_before > NUM_SCHEMAS, "the server speculated"


def test_regex_choice_and_grammar_outputs_match_and_equal_no_speculation(client, plain):
    """Every regex, choice and grammar of test_grammar, greedy and seeded, through vLLM's `structured_outputs`
    (completions) and its older `guided_*` fields (chat); the last streamed too."""
    cases = constraints()
    finished = 0
    for i, (constraint, check) in enumerate(cases):
        temperature, seed = ((0.0, None), (1.0, 400 + i))[i % 2]
        kind, value = constraint.kind, getattr(constraint, constraint.kind)
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=64, structured_outputs=constraint)
        kw = dict(model=MODEL, max_tokens=64, temperature=temperature, seed=seed)
        if i % 2 == 0:
            prompt = PROMPTS[i % len(PROMPTS)]
            r = client.completions.create(prompt=prompt, extra_body={"structured_outputs": {kind: value}}, **kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            want = plain.generate([prompt], params)[0]
        else:
            messages = [{"role": "user", "content": f"Answer {i}."}]
            r = client.chat.completions.create(messages=messages, extra_body={f"guided_{kind}": value}, **kw)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
            want = plain.generate([chat_prompt_ids(plain, messages)], params)[0]
            if i == len(cases) - 1:
                chunks = client.chat.completions.create(messages=messages, extra_body={f"guided_{kind}": value},
                                                        stream=True, **kw)
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert (text, reason) == (want.text, want.finish_reason), (kind, value, temperature)
        if reason == "stop":
            finished += 1
            assert check(text), (kind, value, text)
    assert finished >= len(cases) - 1


def test_json_object_is_an_object(client):
    for prompt in ("a JSON object please", "Reply in JSON."):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
                                           max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "text"}})
    assert r.choices[0].finish_reason == "length"


def tool_call(message) -> tuple[str, dict]:
    [call] = message.tool_calls
    assert message.content is None and call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


def streamed_call(chunks) -> tuple[str, dict, str]:
    """(name, arguments, finish_reason) put together from a stream's tool-call deltas."""
    name, args, reason = None, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                assert piece.index == 0
                name = piece.function.name or name
                args += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    return name, json.loads(args), reason


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 7)])
def test_tool_choice_required_returns_a_call_that_validates(client, temperature, seed):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
              temperature=temperature, seed=seed)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    name, args = tool_call(r.choices[0].message)
    jsonschema.validate(args, PARAMETERS[name])
    assert streamed_call(client.chat.completions.create(stream=True, **kw)) == (name, args, "tool_calls")


@pytest.mark.parametrize("name", list(PARAMETERS))
def test_a_named_function_is_called(client, name):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0,
              tool_choice={"type": "function", "function": {"name": name}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    called, args = tool_call(r.choices[0].message)
    assert called == name
    jsonschema.validate(args, PARAMETERS[name])
    assert streamed_call(client.chat.completions.create(stream=True, **kw)) == (name, args, "tool_calls")


@pytest.mark.parametrize("path, extra, param, says", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema", "nope"),
    ("/v1/completions", {"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
    ("/v1/completions", {"guided_json": "{not json}"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, None,
     "exclude each other"),
    ("/v1/completions", {"guided_json": {"type": "object"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not in tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "excludes response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
     "tool_choice", "excludes guided_regex"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unusable regex"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= foo"}, "guided_grammar", "unusable grammar"),
    ("/v1/completions", {"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs.grammar", "root"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object (got regex, choice)"),
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs", "(got none)"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, None,
     "guided_regex and guided_choice exclude each other"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "at least 1"),
    ("/v1/completions", {"guided_choice": ["a", ""]}, "guided_choice.1", "at least 1"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json}"}}, "structured_outputs.json", "not valid JSON"),
])
def test_bad_structured_requests_are_400(server, path, extra, param, says):
    body = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"}
    r = httpx.post(server.url + path, json={**body, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"text": "x", "sampling_params": {"regex": "(ab", "max_new_tokens": 4}}, "sampling_params"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 4}, {"regex": "(ab", "max_new_tokens": 4}]},
     "sampling_params.1"),
])
def test_sglang_generate_refuses_an_unusable_constraint(server, body, param):
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "unusable regex" in error["message"], error
