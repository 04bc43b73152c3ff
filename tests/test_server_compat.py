"""Drop-in for the clients vLLM users run (issue 20), against the real server: the exact bodies guidellm 0.8 and
`vllm bench serve` send, vLLM's policy for unknown fields (and --strict-request-fields), whole-number floats,
stop validation, /openapi.json checked against real responses, GET /v1/models/{id}, Retry-After.
"""
from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from .test_server import MODEL, PROMPTS, ServerProcess, client, model, server, wait_idle  # noqa: F401 (fixtures)
from .test_server_app import call

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

WARNING = "ignoring unknown fields in "
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def guidellm_completion(prompt: str, max_tokens: int) -> dict:
    """What guidellm 0.8's openai_http backend sends to /v1/completions for a fixed output length."""
    return {"model": MODEL, "stream": True, "stream_options": CONTINUOUS, "max_tokens": max_tokens,
            "stop": None, "ignore_eos": True, "prompt": prompt}


def guidellm_chat(text: str, max_tokens: int) -> dict:
    return {"model": MODEL, "stream": True, "stream_options": CONTINUOUS, "max_completion_tokens": max_tokens,
            "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}


def vllm_completion(prompt: str, max_tokens: int) -> dict:
    """What `vllm bench serve --ignore-eos` sends (its default sampling params: temperature 0)."""
    return {"model": MODEL, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": max_tokens, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


def vllm_chat(text: str, max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            "max_completion_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=60)


def events(srv, path: str, body: dict) -> list:
    """The data of each server-sent event in order: the parsed chunk, or "[DONE]"."""
    with httpx.stream("POST", srv.url + path, json=body, headers=srv.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def not_streamed(srv, path: str, body: dict) -> dict:
    body = {k: v for k, v in body.items() if k != "stream_options"}
    r = post(srv, path, dict(body, stream=False))
    assert r.status_code == 200, r.text
    return r.json()


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c["choices"])


def warnings(srv) -> list[str]:
    return [line.split(WARNING, 1)[1] for line in srv.output().splitlines() if WARNING in line]


def assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def strict(tmp_path_factory, model):  # noqa: F811
    """--strict-request-fields, room for one request at a time, and a model name with a slash in it."""
    srv = ServerProcess(tmp_path_factory.mktemp("strict") / "server.log", "--model", model,
                        "--strict-request-fields", "--max-num-seqs", "1", "--max-queued-requests", "0",
                        "--served-model-name", "org/tiny")
    try:
        srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            assert srv.stop() == 0, srv.output()


# ---- the bodies of guidellm and vllm bench serve -------------------------------------------------
@pytest.mark.parametrize("path, body", [("/v1/completions", guidellm_completion(PROMPTS[0], 24)),
                                        ("/v1/chat/completions", guidellm_chat("Hello there", 24))])
def test_guidellm_streams_carry_continuous_usage(server, path, body):  # noqa: F811
    seen = warnings(server)
    got = events(server, path, body)
    assert got[-1] == "[DONE]" and "[DONE]" not in got[:-1]
    chunks, (final,) = got[:-2], got[-2:-1]
    assert all("usage" in c for c in got[:-1])
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 24, counts  # strictly growing, to the last token
    for c in got[:-1]:
        u = c["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert all(c["choices"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert final["choices"] == [] and final["usage"] == chunks[-1]["usage"]
    assert final["usage"] == not_streamed(server, path, body)["usage"]
    assert len({c["id"] for c in got[:-1]}) == 1
    assert warnings(server) == seen  # guidellm sends no field unknown here


@pytest.mark.parametrize("path, body", [("/v1/completions", vllm_completion(PROMPTS[1], 20)),
                                        ("/v1/chat/completions", vllm_chat("Sort a list.", 20))])
def test_vllm_bench_serve_streams(server, path, body):  # noqa: F811
    seen = warnings(server)
    got = events(server, path, body)
    assert got[-1] == "[DONE]"
    chunks, final = got[:-2], got[-2]
    assert all("usage" not in c for c in chunks)  # include_usage alone: only the last chunk has it
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 20
    whole = not_streamed(server, path, body)
    assert final["usage"] == whole["usage"]
    choice = whole["choices"][0]
    assert text_of(chunks) == choice.get("text", (choice.get("message") or {}).get("content") or "")
    assert warnings(server) == seen


def test_strict_server_takes_both_tools_bodies(strict):
    for path, body in [("/v1/completions", guidellm_completion("x", 4)), ("/v1/completions", vllm_completion("x", 4)),
                       ("/v1/chat/completions", guidellm_chat("x", 4)), ("/v1/chat/completions", vllm_chat("x", 4))]:
        got = events(strict, path, dict(body, model="org/tiny"))
        assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 4


# ---- unknown fields -----------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_one_warning(server, client):  # noqa: F811
    seen = len(warnings(server))
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "foo": 1, "bar": {"baz": 2}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "refusal": None}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True, "frobnicate": True}, "foo": 1}
    assert events(server, "/v1/chat/completions", body)[-1] == "[DONE]"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"vendor_option": 1})
    assert r.usage.completion_tokens == 2
    assert warnings(server)[seen:] == ["/v1/completions: foo, bar",
                                       "/v1/chat/completions: messages.0.refusal, stream_options.frobnicate, foo",
                                       "/v1/chat/completions: vendor_option"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "foo": 1}, "foo"),
    ({"messages": [{"role": "user", "content": "x", "refusal": None}]}, "messages.0.refusal"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
])
def test_strict_server_refuses_unknown_fields(strict, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = assert_error(post(strict, path, body), 400, param)
    assert error["code"] == "unknown_field" and param in error["message"]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"use_beam_search": True}, "use_beam_search"), ({"use_beam_search": 0}, "use_beam_search"),
    ({"functions": []}, "functions"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_options_that_change_the_output_are_refused_not_ignored(server, extra, param):  # noqa: F811
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


# ---- numbers and stops --------------------------------------------------------------------------
def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def test_whole_floats_are_integers(server):  # noqa: F811
    ints = {"prompt": [5, 17, 42, 99], "max_tokens": 9, "seed": 3, "top_k": 5, "logprobs": 2, "stop_token_ids": [7],
            "temperature": 1.0, "ignore_eos": True}
    floats = dict(ints, prompt=[5.0, 17.0, 42.0, 99.0], max_tokens=9.0, seed=3.0, top_k=5.0, logprobs=2.0,
                  stop_token_ids=[7.0])
    a, b = post(server, "/v1/completions", ints), post(server, "/v1/completions", floats)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["usage"] == b.json()["usage"]
    assert a.json()["choices"][0]["logprobs"]["token_logprobs"] == b.json()["choices"][0]["logprobs"]["token_logprobs"]
    for field, value in [("max_tokens", 9.5), ("seed", 3.25), ("prompt", [5, 6.5]), ("stop_token_ids", [7.5])]:
        error = assert_error(post(server, "/v1/completions", dict(ints, **{field: value})), 400,
                             field + (".0" if field == "stop_token_ids" else ""))
        assert "whole number" in error["message"]
    assert_error(post(server, "/v1/completions", dict(ints, max_tokens="9")), 400, "max_tokens")  # still strict


def test_stops_and_stop_token_ids_are_checked(server, model):  # noqa: F811
    for stop in ("", [""], ["ab", ""]):
        error = assert_error(post(server, "/v1/completions", {"prompt": "x", "stop": stop}), 400, "stop")
        assert "empty" in error["message"]
    assert post(server, "/v1/completions", {"prompt": "x", "stop": [], "max_tokens": 2}).status_code == 200
    vocab = vocab_size(model)
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})]:
        error = assert_error(post(server, path, dict(body, stop_token_ids=[3, vocab])), 400, "stop_token_ids")
        assert str(vocab) in error["message"]
        assert post(server, path, dict(body, stop_token_ids=[vocab - 1], max_tokens=2)).status_code == 200
    assert_error(post(server, "/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}), 400, "stop_token_ids.0")


# ---- models, Retry-After ------------------------------------------------------------------------
def test_models_retrieve(server, client, strict):  # noqa: F811
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by, card.max_model_len) == (MODEL, "model", "specserve", 1024)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found" and "gpt-4" in missing.value.message
    assert strict.client().models.retrieve("org/tiny").id == "org/tiny"  # a name with a slash


def test_429_carries_retry_after(strict):
    body = {"model": "org/tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", strict.url + "/v1/completions", json=body, timeout=60) as running:
        assert running.status_code == 200  # submitted: the server is full
        r = httpx.post(strict.url + "/v1/completions", json=dict(body, stream=False), timeout=10)
        assert assert_error(r, 429, None)["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError) as limited:
            strict.client().completions.create(model="org/tiny", prompt="x", max_tokens=2)
        assert limited.value.response.headers["retry-after"] == "1"
    wait_idle(strict)  # the stream's client left: its request is aborted
    r = httpx.post(strict.url + "/v1/completions", json=dict(body, stream=False, max_tokens=2), timeout=10)
    assert r.status_code == 200 and "retry-after" not in r.headers


def test_503_carries_retry_after():
    from specserve.server.app import build_app
    from specserve.server.options import ServerOptions
    from specserve.server.state import ServerState

    app = build_app(ServerState(ServerOptions(), "m"))  # never attached: the model is still loading

    async def main():
        return [await call(app, "GET", "/health"), await call(app, "GET", "/v1/models/m"),
                await call(app, "POST", "/v1/chat/completions", json={"messages": []}),
                await call(app, "GET", "/v1/models/other")]

    health, card, chat, missing = asyncio.run(main())
    for r in (health, card, chat):
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert missing.status_code == 404 and "retry-after" not in missing.headers


# ---- /openapi.json ------------------------------------------------------------------------------
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
              "null": type(None)}


def conforms(value, schema: dict, spec: dict) -> bool:
    """Whether `value` satisfies `schema`, for the JSON Schema the server's models produce ($ref, anyOf, type,
    const, enum, properties, required, additionalProperties, items)."""
    if "$ref" in schema:
        return conforms(value, spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec)
    if "anyOf" in schema:
        return any(conforms(value, option, spec) for option in schema["anyOf"])
    if "const" in schema and value != schema["const"] or "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, JSON_TYPES[kind]) or isinstance(value, bool) != (kind == "boolean")):
        return False
    if kind == "array":
        return all(conforms(item, schema.get("items", {}), spec) for item in value)
    if kind == "object":
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        others = (lambda v: extra) if isinstance(extra, bool) else (lambda v: conforms(v, extra, spec))
        return set(schema.get("required", ())) <= set(value) and all(
            conforms(v, props[k], spec) if k in props else others(v) for k, v in value.items())
    return True


def refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in refs(v)]
    return [r for v in node for r in refs(v)] if isinstance(node, list) else []


@pytest.fixture(scope="module")
def spec(server) -> dict:  # noqa: F811
    r = httpx.get(server.url + "/openapi.json", timeout=10)  # open without the API key
    assert r.status_code == 200
    return r.json()


def test_openapi_is_well_formed(server, spec):  # noqa: F811
    try:
        from openapi_spec_validator import validate
    except ImportError:
        validate = None
    if validate is not None:
        validate(spec)
    assert spec["openapi"].startswith("3.") and spec["info"]["title"] == "specserve"
    schemas = spec["components"]["schemas"]
    assert all(ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas for ref in refs(spec))
    for path, name in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        operation = spec["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"}
        assert {"stream_options", "stop_token_ids", "ignore_eos", "max_tokens"} <= set(schemas[name]["properties"])
        assert {"application/json", "text/event-stream"} == set(operation["responses"]["200"]["content"])
        assert {"400", "401", "413", "429", "500", "503"} <= set(operation["responses"])
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"]  # never sent here
            declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), path
    assert "/v1/models/{model_id}" in spec["paths"]
    docs = httpx.get(server.url + "/docs", timeout=10)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def response_schema(spec: dict, method: str, path: str, status: int) -> dict:
    return spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]


def test_real_responses_match_the_openapi_schema(server, spec):  # noqa: F811
    messages = [{"role": "user", "content": "Hi"}]
    cases = [
        ("post", "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 2}),
        ("post", "/v1/completions", {"prompt": "x", "max_tokens": 4}),
        ("post", "/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 0, "echo": True, "logprobs": 1}),
        ("post", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "prompt_logprobs": 2}),
        ("post", "/tokenize", {"prompt": "x y", "return_token_strs": True}), ("post", "/detokenize", {"tokens": [5]}),
        ("post", "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
        ("post", "/v1/chat/completions", {"messages": messages, "max_tokens": 4}),
        ("post", "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 2,
                                   "include": ["message.output_text.logprobs"]}),
        ("post", "/v1/responses", {"input": "Hi", "max_output_tokens": 4, "background": True}),
        ("post", "/v1/completions", {"prompt": "x", "max_tokens": "4"}),
        ("get", "/v1/models", None), ("get", f"/v1/models/{MODEL}", None), ("get", "/v1/models/nope", None),
        ("get", "/health", None),
    ]
    for method, path, body in cases:
        r = httpx.request(method, server.url + path, json=body, headers=server.headers, timeout=60)
        template = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
        schema = response_schema(spec, method, template, r.status_code)
        assert conforms(r.json(), schema, spec), (path, r.status_code, r.text)
        # the check can fail: an undocumented field, or a documented one missing, is caught
        assert not conforms(dict(r.json(), undocumented=1), schema, spec)
        assert not conforms({k: v for k, v in list(r.json().items())[1:]}, schema, spec)
    info = httpx.get(server.url + "/server_info", headers=server.headers, timeout=10)
    assert conforms(info.json(), response_schema(spec, "get", "/server_info", 200), spec)
    assert conforms(guidellm_completion("x", 4), spec["components"]["schemas"]["CompletionRequest"], spec)
    assert conforms(vllm_chat("x", 4), spec["components"]["schemas"]["ChatCompletionRequest"], spec)


def test_more_choices_than_the_server_runs_at_once_is_400(strict):
    error = assert_error(post(strict, "/v1/completions", {"prompt": "x", "n": 2, "model": "org/tiny"}), 400, "n")
    assert "at once" in error["message"]
    error = assert_error(post(strict, "/v1/completions", {"prompt": [[5], [6]], "model": "org/tiny"}), 400, "prompt")
    assert "2 prompts x n 1 is more choices than this server runs at once" in error["message"]


def test_streamed_chunks_match_the_openapi_schema(server, spec):  # noqa: F811
    messages = [{"role": "user", "content": "Hi"}]
    for path, body in [
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 1, "n": 2}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "logprobs": True, "top_logprobs": 1, "n": 2}),
    ]:
        event = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        chunk = event["properties"]["data"]["anyOf"][0]["contentSchema"]
        got = events(server, path, dict(body, stream=True, stream_options=CONTINUOUS))
        assert got[-1] == "[DONE]" and conforms({"data": "[DONE]"}, event, spec)
        for c in got[:-1]:
            assert conforms(c, chunk, spec) and conforms({"data": json.dumps(c), "event": "message"}, event, spec), c
        assert not conforms(dict(got[0], undocumented=1), chunk, spec)


def test_streamed_response_events_match_the_openapi_schema(server, spec):  # noqa: F811
    event = spec["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    schema = event["properties"]["data"]["contentSchema"]
    body = {"input": "Hi", "max_output_tokens": 4, "top_logprobs": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) % 2 == 0 and len(lines) > 8
    for name, data in zip(lines[::2], lines[1::2]):
        chunk = json.loads(data.removeprefix("data: "))
        assert name == f"event: {chunk['type']}"
        assert conforms(chunk, schema, spec) and conforms({"data": data[6:], "event": chunk["type"]}, event, spec)
    assert not conforms(dict(chunk, undocumented=1), schema, spec)
    assert chunk["type"] == "response.incomplete"


def test_wrong_method_is_405_with_allow(server):  # noqa: F811
    r = httpx.put(server.url + "/v1/models", headers=server.headers, timeout=10)
    assert_error(r, 405, None)
    assert r.headers["allow"] == "GET"
    r = httpx.get(server.url + "/v1/completions", headers=server.headers, timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
