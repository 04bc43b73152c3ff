"""`specserve serve` end to end: the real server in a subprocess, driven by the real `openai` client.

Greedy outputs through the server must equal `LLM.generate` for the same prompts; every error is a 4xx
with an OpenAI error body and the server keeps serving; clients that go away free their KV; SIGTERM lets
streams end cleanly and the process exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from specserve import LLM, SamplingParams, __version__  # noqa: E402
from specserve.assets import make_tiny_checkpoint  # noqa: E402
from specserve.bench.server_process import free_port  # noqa: E402

API_KEY = "test-key"
MODEL = "tiny"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "# a comment about", "return x +",
           "for i in range(", "while True:", "print(", "x = [", "if __name__ =="]


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (read from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


class ServerProcess:
    """`python -m specserve.cli serve` on a free loopback port, with its log in a file."""

    def __init__(self, log_path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(self.port),
               "--served-model-name", MODEL, *args] + (["--api-key", api_key] if api_key else [])
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.output()}")

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", headers=self.headers, timeout=5).json()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM; the exit code. Asserts that the server left no processes behind."""
        kids = children(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self.log.close()
        alive = [pid for pid in kids if os.path.exists(f"/proc/{pid}")]
        assert not alive, f"the server left processes behind: {alive}"
        return rc

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()


def serving(log_path, *args: str, timeout: float = 120, **kw):
    """For a module fixture (`yield from`): a ready ServerProcess, stopped afterwards, which must exit 0."""
    srv = ServerProcess(log_path, *args, **kw)
    try:
        srv.wait_ready(timeout)
        yield srv
    finally:
        if srv.proc.poll() is None:
            rc = srv.stop()
            assert rc == 0, f"server exited {rc}:\n{srv.output()}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny random Llama with a BPE tokenizer and a ChatML template (max_model_len 1024)."""
    path = str(tmp_path_factory.mktemp("model") / "tiny")
    make_tiny_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    yield from serving(tmp_path_factory.mktemp("server") / "server.log", "--model", model,
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--allowed-origins",
                       "http://ui.example, http://other.example", "--max-logprobs", "25", api_key=API_KEY)


@pytest.fixture(scope="module")
def llm(model):
    """The same model offline: the oracle for greedy outputs."""
    return LLM(model)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def chat_prompt_ids(llm, messages) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


# ---- serving ------------------------------------------------------------------------------------
def test_health_models_metrics_and_keys(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # open without a key
    tokens = lambda: metric(httpx.get(server.url + "/metrics").text, "specserve:generation_tokens_total")  # noqa: E731
    generated = tokens()
    for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/health_generate")):  # vLLM's, SGLang's
        r = httpx.request(method, server.url + path, timeout=30)
        assert (r.status_code, r.json()) == (200, {"status": "ok"}), (method, path)
    assert tokens() == generated + 1  # /health_generate's one token
    assert httpx.get(server.url + "/get_server_info").status_code == 401
    assert httpx.get(server.url + "/get_server_info", headers=server.headers).json()["model"] == MODEL
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    [card] = client.models.list().data
    assert card.id == MODEL and card.max_model_len == 1024
    text = httpx.get(server.url + "/metrics").text  # open without a key
    for name in ("specserve:num_requests_running", "specserve:kv_cache_usage_perc", "specserve:prompt_tokens_total",
                 "specserve:generation_tokens_total", "specserve:time_to_first_token_seconds_bucket",
                 "specserve:inter_token_latency_seconds_bucket", "specserve:e2e_request_latency_seconds_bucket",
                 "specserve:spec_decode_num_drafts_total", "specserve:spec_decode_num_draft_tokens_total",
                 "specserve:spec_decode_num_accepted_tokens_total", "specserve:spec_decode_k",
                 "specserve:prefix_cache_queries_total", "specserve:prefix_cache_hits_total",
                 "specserve:prefix_cache_host_hits_total", "specserve:kv_host_usage_perc",
                 "specserve:engine_steps_total", "specserve:engine_step_seconds_total"):
        assert name in text, name
    info = server.info()
    assert info["config"]["max_model_len"] == 1024 and "avg_spec_accept_length" in info
    assert info["kv_free_blocks"] == info["kv_total_blocks"] > 0
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_pages_of_allowed_origins_may_call_it(server):
    """CORS (--allowed-origins): a browser's preflight (no API key) and the call after it."""
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/completions", headers=preflight, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = httpx.options(server.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", headers={**server.headers, "Origin": "http://other.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://other.example"


def test_prefix_cache_hits_reach_metrics_and_server_info(server, client):
    prompt = "\n".join(PROMPTS * 4)  # several full KV blocks
    scrape = lambda name: metric(httpx.get(server.url + "/metrics").text, name)  # noqa: E731
    hits, queries = scrape("specserve:prefix_cache_hits_total"), scrape("specserve:prefix_cache_queries_total")
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
             for _ in range(2)]
    assert texts[0] == texts[1]
    new_hits, new_queries = scrape("specserve:prefix_cache_hits_total") - hits, \
        scrape("specserve:prefix_cache_queries_total") - queries
    assert new_hits >= 16 and new_queries > 2 * new_hits  # the second request hit nearly all of the first
    info = wait_idle(server)
    assert info["prefix_cache"]["enabled"] and info["prefix_cache"]["num_hits"] == hits + new_hits
    assert 0 < info["prefix_cache_hit_rate"] <= 1 and info["prefix_cache"]["cached_blocks"] > 0
    assert info["kv_host_total_blocks"] == 0 and scrape("specserve:kv_host_usage_perc") == 0  # CPU: no host pool


def test_reset_prefix_cache_forgets_prefixes_once_idle(server, client):
    prompt = "\n".join(PROMPTS * 3) + " reset"
    cached = lambda: httpx.post(server.url + "/generate", headers=server.headers, json={  # noqa: E731
        "text": prompt, "sampling_params": {"max_new_tokens": 2}}).json()["meta_info"]["cached_tokens"]
    cached()
    assert cached() > 0
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    r = httpx.post(server.url + "/reset_prefix_cache", headers=server.headers)
    assert r.status_code == 409 and "hold KV blocks" in r.json()["error"]["message"]
    stream.close()
    wait_idle(server)
    assert cached() > 0  # the refused reset changed nothing
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 401
    for path in ("/reset_prefix_cache", "/flush_cache"):
        assert httpx.post(server.url + path, headers=server.headers).status_code == 200
        assert server.info()["prefix_cache"]["cached_blocks"] == 0
        assert cached() == 0


def test_greedy_completions_and_chat_equal_offline(client, llm):
    want = llm.generate(PROMPTS[:4], greedy(24))
    for prompt, ref in zip(PROMPTS[:4], want):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
    # token-id prompts work too
    r = client.completions.create(model=MODEL, prompt=want[0].prompt_token_ids, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[0].text
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    [ref] = llm.generate([chat_prompt_ids(llm, messages)], greedy(20))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    message = r.choices[0].message
    assert message.role == "assistant" and message.content == ref.text  # (no <think> from a random model)
    assert message.tool_calls is None and message.reasoning_content is None
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    [offline] = llm.chat(messages, greedy(20))  # vLLM's LLM.chat renders as the server does
    assert (offline.text, offline.prompt_token_ids) == (ref.text, ref.prompt_token_ids)
    assert [o.text for o in llm.chat([messages, messages[1:]], greedy(20))][0] == ref.text


def test_a_list_of_prompts_gets_n_choices_each(client, llm):
    """As vLLM: choice i x n + j is prompt i's choice j; the usage counts each prompt once."""
    want = llm.generate(PROMPTS[:3], greedy(12))
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=PROMPTS[:3], n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w.text for w in want for _ in range(2)]
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 72)
    chunks = list(client.completions.create(prompt=[w.prompt_token_ids for w in want], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts = [""] * 3
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [w.text for w in want]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 36)
    seeded = dict(model=MODEL, max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=PROMPTS[3:5], n=2, **seeded).choices
    alone = [client.completions.create(prompt=p, n=2, **seeded).choices for p in PROMPTS[3:5]]
    assert [c.text for c in both] == [c.text for choices in alone for c in choices]


def test_echo_returns_the_prompt_and_its_logprobs(client, llm):
    """echo with logprobs (lm-evaluation-harness's loglikelihood requests): the prompt's text and tokens come
    first, the first token's logprob null, the others the offline engine's prompt logprobs."""
    prompt = PROMPTS[1]
    [ref] = llm.generate([prompt], greedy(4, logprobs=2, prompt_logprobs=2))
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2,
              extra_body={"ignore_eos": True})
    choice = client.completions.create(**kw).choices[0]
    assert choice.text == prompt + ref.text
    lp, ids = choice.logprobs, ref.prompt_token_ids + ref.token_ids
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = ref.prompt_logprobs[1:] + ref.logprobs
    assert lp.token_logprobs[1:] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [list(top) for top in lp.top_logprobs[1:]] == [[llm.tokenizer.decode([t]) for t, _ in w.top] for w in want]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs
    r = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == llm.tokenizer.decode(ref.prompt_token_ids)  # max_tokens 0: the prompt alone
    assert r.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ref.prompt_token_ids)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    assert text.startswith(prompt) and ref.text.startswith(text[len(prompt):]) and r.choices[0].logprobs is None


def test_vllm_prompt_logprobs(server, llm):
    """vLLM's prompt_logprobs: per prompt token (the first: null) {token id: {logprob, rank, decoded_token}} for
    the token and its top alternatives, the offline engine's; beside echo with fewer logprobs, each its own."""
    [ref] = llm.generate([PROMPTS[3]], greedy(2, prompt_logprobs=3))
    body = {"prompt": PROMPTS[3], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3, "echo": True,
            "logprobs": 1}
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json=dict(body, stream=stream), headers=server.headers,
                       timeout=60)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] if stream \
            else [r.json()]
        choice = chunks[0]["choices"][0]
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ref.prompt_token_ids)
        for entry, token, want in zip(got[1:], ref.prompt_token_ids[1:], ref.prompt_logprobs[1:]):
            assert entry[str(token)]["rank"] == want.rank
            assert entry[str(token)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)
            assert {int(t) for t in entry} == {t for t, _ in want.top} | {token}
            assert all(entry[str(t)]["rank"] == i for i, (t, _) in enumerate(want.top, 1))
            assert entry[str(token)]["decoded_token"] == llm.tokenizer.decode([token])
        echoed = choice["logprobs"]["top_logprobs"][1:len(ref.prompt_token_ids)]
        assert all(len(top) == 1 for top in echoed)  # echo's own logprobs: 1 alternative
        assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:] if c["choices"])


def test_tokenize_and_detokenize(server, client, llm):
    """vLLM's /tokenize and /detokenize: a prompt as /v1/completions tokenizes it, messages as
    /v1/chat/completions renders them (the count is its usage.prompt_tokens)."""
    def post(path: str, body: dict) -> dict:
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    got = post("/tokenize", {"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True})
    [ref] = llm.generate([PROMPTS[0]], greedy(1))
    assert got["tokens"] == ref.prompt_token_ids and got["count"] == len(ref.prompt_token_ids)
    assert got["max_model_len"] == 1024 and got["token_strs"] == llm.tokenizer.convert_ids_to_tokens(got["tokens"])
    assert post("/detokenize", {"model": MODEL, "tokens": got["tokens"]}) == {"prompt": PROMPTS[0]}
    assert "token_strs" not in post("/tokenize", {"prompt": ""}) and post("/tokenize", {"prompt": ""})["count"] == 0
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    got = post("/tokenize", {"messages": messages})
    assert got["count"] == usage.prompt_tokens and got["tokens"] == chat_prompt_ids(llm, messages)
    assert post("/tokenize", {"messages": messages, "add_generation_prompt": False})["count"] < got["count"]
    for path, body, param in [("/tokenize", {"prompt": "x", "messages": messages}, None), ("/tokenize", {}, None),
                              ("/detokenize", {"tokens": [5, 10**6]}, "tokens"), ("/detokenize", {"tokens": "x"},
                                                                                  "tokens")]:
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=30)  # no key
    assert r.status_code == 401


def test_an_assistant_message_continued(server, client, llm):
    """vLLM's continue_final_message (with add_generation_prompt false): the output continues the last
    message, an assistant's, rendered open."""
    messages = [{"role": "user", "content": "Sort a list."}, {"role": "assistant", "content": "def sort(xs):"}]
    text = llm.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("def sort(xs):")
    [ref] = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)], greedy(12))
    extra = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"messages": messages, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_sglang_generate(server, llm):
    """SGLang's native POST /generate: one prompt or a list (text or ids), n choices, streamed cumulative text,
    SGLang's sampling_params names; greedy outputs are the offline engine's."""
    def post(body: dict, stream: bool = False):
        r = httpx.post(server.url + "/generate", json=dict(body, stream=stream), headers=server.headers, timeout=60)
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")] if stream else \
            r.json()

    want = llm.generate(PROMPTS[:2], greedy(10))
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    one = post({"text": PROMPTS[0], "sampling_params": sp})
    assert one["text"] == want[0].text and one["output_ids"] == want[0].token_ids and "index" not in one
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert (one["meta_info"]["prompt_tokens"], one["meta_info"]["completion_tokens"]) == (
        len(want[0].prompt_token_ids), 10)
    again = post({"text": PROMPTS[0] * 20, "sampling_params": sp})["meta_info"]  # the second asks a cached prefix
    assert post({"text": PROMPTS[0] * 20, "sampling_params": sp})["meta_info"]["cached_tokens"] == \
        (again["prompt_tokens"] - 1) // 16 * 16 > 0
    many = post({"input_ids": [w.prompt_token_ids for w in want], "sampling_params": dict(sp, n=2)})
    assert [(m["index"], m["text"]) for m in many] == list(enumerate(w.text for w in want for _ in range(2)))
    # a prompt whose output has text (the tiny model's tokenizer is trained on this package's files, so which one
    # does changes with them): its events grow
    [(prompt, ref)] = [(p, w) for p, w in zip(PROMPTS, llm.generate(PROMPTS, greedy(10))) if w.text.strip()][:1]
    events = post({"text": prompt, "sampling_params": sp}, stream=True)
    assert events[-1]["text"] == ref.text and len(events) > 1
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))  # cumulative
    seeded = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "seed": 3}
    assert post({"text": PROMPTS[1], "sampling_params": seeded})["text"] == \
        client_text(server, PROMPTS[1], seed=3, max_tokens=10, temperature=1.0)
    for body, param in [({"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
                        ({"sampling_params": {}}, None), ({"text": ["x", ""]}, "text"),
                        ({"text": "x", "sampling_params": {"max_new_tokens": 5000}}, "sampling_params.max_new_tokens"),
                        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
                        ({"text": ["x", "y"], "sampling_params": {"max_new_tokens": ""}},
                         "sampling_params.0.max_new_tokens")]:
        r = httpx.post(server.url + "/generate", json=body, headers=server.headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_sglang_generate_logprobs(server, llm):
    """SGLang's return_logprob on /generate: [logprob, token id, text or null] per output token, and per prompt
    token from logprob_start_len (the first prompt token's logprob null), with top_logprobs_num alternatives; the
    offline engine's logprobs."""
    [ref] = llm.generate([PROMPTS[2]], greedy(6, logprobs=2, prompt_logprobs=2))
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def meta(**fields) -> dict:
        r = httpx.post(server.url + "/generate", headers=server.headers, timeout=60,
                       json=dict(text=PROMPTS[2], sampling_params=sp, **fields))
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    plain = meta(return_logprob=True)
    assert [e[1] for e in plain["output_token_logprobs"]] == ref.token_ids and plain["input_token_logprobs"] == []
    assert [e[0] for e in plain["output_token_logprobs"]] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                                          abs=1e-4)
    assert all(e[2] is None for e in plain["output_token_logprobs"]) and "output_top_logprobs" not in plain
    full = meta(return_logprob=True, top_logprobs_num=2, logprob_start_len=0, return_text_in_logprobs=True)
    prompt = full["input_token_logprobs"]
    assert [e[1] for e in prompt] == ref.prompt_token_ids and prompt[0][0] is None and full["input_top_logprobs"][0] \
        is None
    assert [e[0] for e in prompt[1:]] == pytest.approx([lp.logprob for lp in ref.prompt_logprobs[1:]], abs=1e-4)
    assert [e[2] for e in full["output_token_logprobs"]] == [llm.tokenizer.decode([t]) for t in ref.token_ids]
    assert [[e[1] for e in top] for top in full["output_top_logprobs"]] == [[t for t, _ in lp.top]
                                                                           for lp in ref.logprobs]
    assert len(meta(return_logprob=True, logprob_start_len=3)["input_token_logprobs"]) == len(ref.prompt_token_ids) - 3
    assert "output_token_logprobs" not in meta(return_logprob=False, top_logprobs_num=2)
    assert len(meta(return_logprob=True, top_logprobs_num=25)["output_top_logprobs"][0]) == 25  # --max-logprobs
    for fields, param in [({"return_logprob": True, "top_logprobs_num": 26}, "top_logprobs_num"),
                          ({"return_logprob": True, "logprob_start_len": 10_000}, "logprob_start_len"),
                          ({"return_logprob": [True, False]}, "return_logprob"),
                          ({"return_logprob": True, "token_ids_logprob": [1, 2]}, "token_ids_logprob")]:
        r = httpx.post(server.url + "/generate", headers=server.headers, timeout=30,
                       json=dict(text=PROMPTS[2], sampling_params=sp, **fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_sglang_abort_request_ends_a_request_with_what_it_has(server, client):
    """SGLang's POST /abort_request: the request of that rid (a /generate rid, or a /v1 response id) answers at
    once with its output so far, finish reason "abort"; abort_all ends every request."""
    import concurrent.futures

    sp = {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}
    gen = lambda body: httpx.post(server.url + "/generate", headers=server.headers, timeout=60, json=body)  # noqa
    abort = lambda body: httpx.post(server.url + "/abort_request", headers=server.headers, json=body)  # noqa
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        one = pool.submit(gen, {"text": PROMPTS[0], "rid": "long-one", "sampling_params": sp})
        many = pool.submit(gen, {"text": PROMPTS[:2], "rid": "long-two", "sampling_params": sp})
        wait_running(server, 3)
        assert abort({"rid": "long-one"}).status_code == 200
        body = one.result()
        assert body.status_code == 200, body.text
        meta = body.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort"} and 0 < meta["completion_tokens"] < 900
        assert len(body.json()["output_ids"]) == meta["completion_tokens"] and not many.done()
        streamed = pool.submit(lambda: client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=900,
                                                                 extra_body={"ignore_eos": True}))
        wait_running(server, 3)
        assert abort({"abort_all": True}).status_code == 200
        assert [m["meta_info"]["finish_reason"]["type"] for m in many.result().json()] == ["abort", "abort"]
        assert streamed.result().choices[0].finish_reason == "abort"
    assert abort({}).status_code == 400 and abort({"rid": "nobody"}).status_code == 200
    wait_idle(server)


def wait_running(server, count: int, timeout: float = 30) -> None:
    """Until `count` requests are running in the engine, and a little longer."""
    deadline = time.monotonic() + timeout
    while metric(httpx.get(server.url + "/metrics").text, "specserve:num_requests_running") < count:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.02)
    time.sleep(0.3)  # a few tokens each


def client_text(server, prompt: str, **kw) -> str:
    return server.client().completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True},
                                              **kw).choices[0].text


def test_streaming_with_usage_equals_non_streamed(client):
    kw = dict(model=MODEL, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPTS[4], **kw)
    chunks = list(client.completions.create(prompt=PROMPTS[4], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(messages=messages, **kw)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_strings_and_seeds(client, llm):
    [ref] = llm.generate([PROMPTS[0]], greedy(30))
    stop = ref.text[6:9]
    cut = ref.text[:ref.text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"

    def sampled(seed):
        return client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sampled(7) == sampled(7)
    assert len({sampled(7), sampled(8), sampled(9)}) > 1
    for stream in (False, True):  # vLLM's include_stop_str_in_output keeps the stop string
        extra = {"ignore_eos": True, "include_stop_str_in_output": True}
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                                      stream=stream, extra_body=extra)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == cut + stop


def test_special_tokens_are_skipped_unless_asked_for(client, llm):
    special = llm.tokenizer.convert_tokens_to_ids(llm.tokenizer.eos_token)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={str(special): 100})
    r = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == "" and r.usage.completion_tokens == 3
    r = client.completions.create(extra_body={"ignore_eos": True, "skip_special_tokens": False}, **kw)
    assert r.choices[0].text == llm.tokenizer.eos_token * 3


def test_logprobs(client, llm):
    [ref] = llm.generate([PROMPTS[2]], greedy(8, logprobs=3))
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)

    wide = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=25, extra_body={"ignore_eos": True})  # --max-logprobs 25
    wide = wide.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 25 for t in wide)
    assert [a.logprob for t in wide for a in t.top_logprobs[:2]] == pytest.approx(
        [a.logprob for t in content for a in t.top_logprobs], abs=1e-5)


def test_tools_render_through_the_template(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12,
                                           temperature=0, stream=stream)
        chunks = list(r) if stream else [r]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # forced calls: test_api_structured.py
        client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "not_a_tool"}})


# ---- bad input ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (path, body or raw bytes, status, error param or None)
    ("/v1/completions", b'{"prompt": "x", ', 400, None),
    ("/v1/completions", b'["not", "an", "object"]', 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, 400, "priority"),  # the server schedules fcfs
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),  # no store
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 1100}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": ["x", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[5], [5] * 1100]}, 400, "prompt.1"),
    ("/v1/completions", {"prompt": ["x", [5, 6]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 26},
     400, "top_logprobs"),  # the server's --max-logprobs is 25
    ("/v1/completions", {"prompt": "x", "logprobs": 26}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 26}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", b"{" + b" " * (5 * 2**20) + b"}", 413, None),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=10,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_still_serving_after_bad_input(server, client):
    test_bad_input_gets_an_openai_error(server, *BAD_REQUESTS[0])
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


ODD_VALUES = [None, True, 0, -1, 2, 0.5, -0.5, 1e9, 1e308, "", "x", "1", "(", [], [1], [""], {}, {"a": 1}, 2**64,
              "a" * 3000, [[1, 2]], [None], 21, {"regex": "("}, {"type": "json_schema"}]
VALID_BODIES = {"/v1/completions": {"prompt": "x", "max_tokens": 2},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                "/v1/responses": {"input": "x", "max_output_tokens": 2},
                "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 2}},
                "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [1, 2]}}
FIELDS = ["prompt", "messages", "input", "text", "input_ids", "tokens", "temperature", "top_p", "top_k", "min_p", "n",
          "max_tokens", "stop", "seed", "logprobs", "top_logprobs", "logit_bias", "min_tokens", "stop_token_ids",
          "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "stream", "stream_options", "echo",
          "prompt_logprobs", "structured_outputs", "response_format", "tools", "tool_choice", "sampling_params",
          "return_logprob", "top_logprobs_num", "logprob_start_len", "repetition_penalty", "instructions", "regex",
          "max_new_tokens", "json_schema", "ebnf"]


def test_random_bad_bodies_get_4xx_errors_and_the_server_serves_on(server, client):
    """Seeded random mutations of valid bodies on every generation route (found /generate's 500s on an unusable
    regex and a string max_new_tokens): any answer is a 2xx or an OpenAI-shaped 4xx, never a 5xx."""
    rng = random.Random(0)
    for _ in range(240):
        path = rng.choice(list(VALID_BODIES))
        body = json.loads(json.dumps(VALID_BODIES[path]))
        for _ in range(rng.randint(1, 3)):
            inner = body.get("sampling_params")  # /generate's sampling fields, when still a dict
            target = inner if isinstance(inner, dict) and rng.random() < 0.5 else body
            field = rng.choice(list(target) if target and rng.random() < 0.5 else FIELDS)  # its own, or any
            target[field] = rng.choice(ODD_VALUES)
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["message"] and error["type"], (path, body, r.text)
    test_still_serving_after_bad_input(server, client)


# ---- load, disconnects --------------------------------------------------------------------------
def wait_idle(server, timeout: float = 15) -> dict:
    """/server_info once nothing is in flight, asserting the KV pool is full again."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.info()
        if info["num_requests_in_flight"] == 0 and info["kv_free_blocks"] == info["kv_total_blocks"]:
            return info
        assert time.monotonic() < deadline, f"KV not freed: {info}"
        time.sleep(0.1)


def test_non_streamed_client_that_leaves_aborts(server):
    before = server.info()["stats"]["num_generation_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=0.5,
                   json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True})
    wait_idle(server, timeout=3)  # well before 1000 tokens could have been generated
    assert server.info()["stats"]["num_generation_tokens"] - before < 1000


def test_load_with_disconnects(server, llm):
    """500 streams at concurrency 64. Every tenth client asks for 400 tokens and leaves after two chunks:
    its request must be aborted (far fewer tokens generated) and its KV freed."""
    lengths = [8 + 2 * (i % 9) for i in range(len(PROMPTS))]
    want = [o.text for o in llm.generate(PROMPTS, [greedy(n) for n in lengths])]
    gen_before = metric(httpx.get(server.url + "/metrics").text, "specserve:generation_tokens_total")
    client = server.async_client(timeout=120)
    limit = asyncio.Semaphore(64)

    async def one(i: int):
        p, leaves = i % len(PROMPTS), i % 10 == 0
        async with limit:
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPTS[p], max_tokens=400 if leaves else lengths[p], temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, received, usage = "", 0, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices:
                    text += chunk.choices[0].text
                    received += 1
                    if leaves and received == 2:
                        await stream.close()
                        return "left", received
            assert text == want[p], (i, text, want[p])
            return "done", usage.completion_tokens

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(500)))
        finally:
            await client.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert sum(kind == "left" for kind, _ in results) == 50
    wait_idle(server)
    received = sum(n for _, n in results)
    generated = metric(httpx.get(server.url + "/metrics").text, "specserve:generation_tokens_total") - gen_before
    assert received <= generated < received + 50 * 400 / 2, (received, generated)
    print(f"500 streams at concurrency 64: {elapsed:.1f} s; {received} tokens received, {generated} generated")


def test_speculative_serving_is_lossless_and_counted(tmp_path, model, llm):
    """With an EAGLE-3 draft (random: it rarely guesses right) greedy output still equals plain decoding,
    and the speculation counters reach /metrics and /server_info."""
    from .eagle_utils import make_eagle3_checkpoint

    draft = make_eagle3_checkpoint(str(tmp_path / "draft"), model)
    srv = ServerProcess(tmp_path / "server.log", "--model", model, "--speculative-algorithm",
                        "EAGLE3", "--speculative-draft-model-path", draft, "--speculative-num-steps", "2",
                        "--speculative-policy", "always")
    try:
        srv.wait_ready()
        [ref] = llm.generate([PROMPTS[3]], greedy(20))
        r = srv.client().completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
        text = httpx.get(srv.url + "/metrics").text
        drafts = metric(text, "specserve:spec_decode_num_drafts_total")
        accepted = metric(text, "specserve:spec_decode_num_accepted_tokens_total")
        assert drafts >= 1 and metric(text, "specserve:spec_decode_num_draft_tokens_total") == 2 * drafts
        assert metric(text, "specserve:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert 'position="1"' in text and metric(text, "specserve:spec_decode_k") == 2
        assert srv.info()["avg_spec_accept_length"] == pytest.approx(1 + accepted / drafts)
        controller = srv.info()["spec"]["controller"]
        assert controller["policy"] == "always" and controller["buckets"] == {}  # only adaptive decides per bucket
        assert len(controller["acceptance_per_position"]) == 2
    finally:
        assert srv.stop() == 0, srv.output()


def test_ngram_serving_drafts_a_repeated_request_from_the_first(tmp_path, model, llm):
    """NGRAM through the server: greedy output equals plain decoding, streamed and not, and a request repeating an
    earlier one drafts from that one's output (the history of finished requests)."""
    srv = ServerProcess(tmp_path / "server.log", "--model", model, "--speculative-algorithm", "NGRAM",
                        "--speculative-num-steps", "3", "--speculative-policy", "always")
    try:
        srv.wait_ready()
        [ref] = llm.generate([PROMPTS[2]], greedy(24))
        client = srv.client()

        def accepted() -> float:
            return metric(httpx.get(srv.url + "/metrics").text, "specserve:spec_decode_num_accepted_tokens_total")

        first = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        before, kept = accepted(), srv.info()["spec"]["proposer"]["history_tokens"]
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert first.choices[0].text == "".join(c.choices[0].text for c in stream) == ref.text
        # alone, the second would draft exactly as the first did (the same tokens, the same lookups): 14 of 18
        # possible drafts here; from the first one's output it drafts more (17)
        assert accepted() - before > before
        each = first.usage.prompt_tokens + 24 + 1  # a request's tokens and a separator (the warm-up is salted: none)
        assert kept == each and srv.info()["spec"]["proposer"] == {"history_tokens": 2 * each,
                                                                    "history_capacity": 1 << 20}
    finally:
        assert srv.stop() == 0, srv.output()


# ---- shutdown -----------------------------------------------------------------------------------
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
LLAMA3_CALL = {"type": "object", "properties": {"name": {"const": "add"}, "parameters": ADD},
               "required": ["name", "parameters"]}
QWEN3_CODER_CALL = "<tool_call>\n<function=add>\n<parameter=a>\n[0-9]\n</parameter>\n</function>\n</tool_call>"
PYTHONIC_CALL = r"\[add\(a=[0-9]\)\]"


@pytest.mark.parametrize("parser, constraint", [("llama3_json", {"guided_json": LLAMA3_CALL}),
                                                ("qwen3_coder", {"guided_regex": QWEN3_CODER_CALL}),
                                                ("pythonic", {"guided_regex": PYTHONIC_CALL})])
def test_tool_calls_of_other_formats(tmp_path, model, parser, constraint):
    """--tool-call-parser llama3_json / qwen3_coder / pythonic: an output in Llama 3.1's call JSON, Qwen3-Coder's
    XML or Llama 3.2's Python list (made so here by a constraint, as a random model writes none) comes back as
    tool_calls, streamed or not,
    the argument an integer as the tool's schema says."""
    pytest.importorskip("xgrammar")
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "add"}], tools=tools, max_tokens=200, temperature=0,
              extra_body=constraint)
    with contextlib.closing(serving(tmp_path / "server.log", "--model", model, "--tool-call-parser",
                                    parser)) as server:
        client = next(server).client()
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content is None
        [tool_call] = message.tool_calls
        assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments)["a"] in range(10)
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        args = "".join(t.function.arguments or "" for c in chunks for t in c.delta.tool_calls or [])
        assert args == tool_call.function.arguments and chunks[-1].finish_reason == "tool_calls"
        if parser == "llama3_json":  # a forced call is framed in the server's parser's format: Llama 3.1's JSON
            forced = dict(kw, tool_choice={"type": "function", "function": {"name": "add"}}, extra_body={})
            r = client.chat.completions.create(**forced)
            [tool_call] = r.choices[0].message.tool_calls
            assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments)["a"] in range(10)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model)
            text = tok.apply_chat_template(kw["messages"], tools=tools, add_generation_prompt=True, tokenize=False)
            framed = text + '{"name": "add", "parameters": '  # (hermes would open a <tool_call> block)
            assert r.usage.prompt_tokens == len(tok.encode(framed, add_special_tokens=False))


def test_sigterm_drains_then_aborts_and_exits_0(tmp_path, model):
    """One running stream and two queued ones fill the server (a fourth request gets 429). After SIGTERM
    new requests get 503; the running client leaves, so the first queued stream runs and finishes; the
    second cannot produce its 1000 tokens before the shutdown timeout and is aborted with a final chunk;
    the process exits 0."""
    timeout = 1.0
    srv = ServerProcess(tmp_path / "server.log", "--model", model, "--max-num-seqs", "1",
                        "--max-queued-requests", "2", "--shutdown-timeout", str(timeout))
    try:
        srv.wait_ready()
        client = srv.client(timeout=30)
        leave = threading.Event()
        results: dict[str, list] = {}

        def stream(name: str, max_tokens: int):
            chunks = []
            # with logprobs every token sends a chunk, so "leaves" can leave even while the random model's
            # text is held back (bytes that are not yet UTF-8 send no text: runs of 200+ tokens happen)
            every_token = {"logprobs": 1} if name == "leaves" else {}
            response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 **every_token)
            for chunk in response:
                chunks.append(chunk)
                if name == "leaves" and leave.is_set():
                    response.close()
                    break
            results[name] = chunks

        def start(name: str, max_tokens: int, in_flight: int) -> threading.Thread:
            thread = threading.Thread(target=stream, args=(name, max_tokens))
            thread.start()
            deadline = time.monotonic() + 20
            while srv.info()["num_requests_in_flight"] < in_flight:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            return thread

        threads = [start("leaves", 1000, 1), start("finishes", 10, 2), start("aborted", 1000, 3)]
        with pytest.raises(openai.RateLimitError):  # 1 running + 2 queued: the limit
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        with pytest.raises(openai.APIStatusError) as refused:  # draining: new requests get 503
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        leave.set()
        for t in threads:
            t.join(30)
        rc = srv.proc.wait(30)
        took = time.monotonic() - t0
        assert rc == 0, srv.output()
        assert took < timeout + 8, took
        reasons = {name: chunks[-1].choices[0].finish_reason for name, chunks in results.items()}
        assert reasons == {"leaves": None, "finishes": "length", "aborted": "abort"}, (reasons, took)
        assert len(results["aborted"]) > 2  # it ran until the timeout
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
