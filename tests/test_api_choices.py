"""`n` > 1 through the real server (issue 20): n requests of the same prompt, choices 0..n-1 in one body or
one stream, the prompt's KV shared through the prefix cache, usage counting every choice, and a client
that leaves aborting them all (each counted as `abort` on /metrics).
"""
from __future__ import annotations

import json
import re

import pytest

from .test_server import MODEL, PROMPTS, greedy, llm, metric, model, server, wait_idle  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=60)


def events(srv, path: str, body: dict) -> list:
    """The parsed chunks of a stream, then "[DONE]"."""
    with httpx.stream("POST", srv.url + path, json=body, headers=srv.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def scrape(srv, name: str) -> float:
    return metric(httpx.get(srv.url + "/metrics").text, name)


def test_greedy_choices_each_equal_offline(server, llm):  # noqa: F811
    [ref] = llm.generate([PROMPTS[0]], greedy(12))
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], n=3, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ref.text] * 3
    assert all(c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 36)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 36  # the prompt counts once


def test_seeded_choice_i_is_the_request_with_seed_plus_i(server):  # noqa: F811
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    choices = [c.text for c in client.completions.create(n=3, seed=40, **kw).choices]
    alone = [client.completions.create(seed=40 + i, **kw).choices[0].text for i in range(3)]
    assert choices == alone and len(set(choices)) > 1


def test_chat_choices_stream_by_index_with_usage_of_all(server):  # noqa: F811
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Sort a list."}], "n": 2, "max_tokens": 10,
            "temperature": 1.0, "seed": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got = events(server, "/v1/chat/completions", body)
    assert got[-1] == "[DONE]"
    chunks, final = got[:-2], got[-2]
    assert all(len(c["choices"]) == 1 for c in chunks) and len({c["id"] for c in got[:-1]}) == 1
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]  # each choice opens with its role
    whole = post(server, "/v1/chat/completions", dict(body, stream=False, stream_options=None)).json()
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    running = [c["usage"]["completion_tokens"] for c in chunks]
    assert running == sorted(running) and running[-1] == 20  # the usage so far, of both choices
    assert final["choices"] == [] and final["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 20


def test_choices_share_the_prompts_kv(server):  # noqa: F811
    prompt = "# shared prompt\n" + "\n".join(reversed(PROMPTS * 3))  # several KV blocks, not cached before
    hits = scrape(server, "specserve:prefix_cache_hits_total")
    r = post(server, "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    full_blocks = r.json()["usage"]["prompt_tokens"] // server.info()["config"]["block_size"]
    assert full_blocks >= 4
    # choices 1-3 start on the first one's cached blocks (the last block may wait for the drafter, if any)
    assert scrape(server, "specserve:prefix_cache_hits_total") - hits >= 3 * (full_blocks - 1) * 16


def aborted(srv) -> float:
    text = httpx.get(srv.url + "/metrics").text
    return sum(float(v) for v in re.findall(r'^specserve:request_success_total{[^}]*"abort"[^}]*} (\S+)$', text, re.M))


def test_a_client_that_leaves_aborts_every_choice(server):  # noqa: F811
    before = aborted(server)
    body = {"prompt": "x", "n": 3, "max_tokens": 1000, "ignore_eos": True, "stream": True, "logprobs": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    wait_idle(server)
    assert aborted(server) - before == 3


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2.5}, "n"), ({"n": 2, "best_of": 2}, "best_of"),
])
def test_bad_n_is_refused(server, body, param):  # noqa: F811
    r = post(server, "/v1/completions", {"prompt": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_best_of_1_is_neutral(server):  # noqa: F811
    r = post(server, "/v1/completions", {"prompt": "x", "n": 2, "best_of": 1.0, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
