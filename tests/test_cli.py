"""The `specserve` command as a user meets it: flags are never abbreviated, start-up mistakes are one line
without a traceback, and a server with `--access-log` logs its requests and reports every request in
/metrics (aborted ones, queue / prefill / decode times and token counts) under vLLM's names."""
from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from specserve import ConfigError
from specserve.assets import make_tiny_checkpoint
from specserve.cli import build_parser, main

MODEL = "tiny"


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("model") / "tiny")
    make_tiny_checkpoint(path)
    return path


# ---- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag, suggestion", [
    (["serve", "--max-num-seq", "4"], "--max-num-seq", "--max-num-seqs"),
    (["serve", "--max-num-seq=4"], "--max-num-seq", "--max-num-seqs"),
    (["generate", "--prompt", "x", "--max-tok", "5"], "--max-tok", "--max-tokens"),
    (["compare", "--requests-per", "3"], "--requests-per", "--requests-per-level"),
])
def test_abbreviated_flags_are_refused_with_a_suggestion(capsys, argv, flag, suggestion):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown flag {flag} (did you mean {suggestion}" in err and len(err.strip().splitlines()) == 1


def test_whole_flags_still_parse(capsys):
    args = build_parser().parse_args(["serve", "--max-num-seqs", "4", "--access-log", "--port", "9"])
    assert (args.max_num_seqs, args.access_log, args.port) == (4, True, 9)
    with pytest.raises(SystemExit):
        main(["bench", "--base-url", "http://x", "stray"])
    assert "unexpected argument 'stray'" in capsys.readouterr().err


def test_vllm_and_sglang_tool_flags_parse():
    """`--enable-auto-tool-choice --tool-call-parser X` as vLLM takes them, SGLang's parser names too."""
    from specserve.server.options import server_options
    from specserve.server.tool_parsers import TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen25"])
    assert server_options(args).tool_call_parser == "qwen25" and TOOL_PARSERS["qwen25"] is HermesToolParser
    assert TOOL_PARSERS["llama3"] is Llama3JsonToolParser
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs tool_call_parser"):
        server_options(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))


# ---- start-up mistakes ----------------------------------------------------------------------------
def one_line_error(result: subprocess.CompletedProcess) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0 and "Traceback" not in output and "startup complete" not in output, output
    assert len(output.splitlines()) == 1, output
    return output


def test_missing_model_folder_is_one_line_before_the_server_starts(tmp_path):
    missing = str(tmp_path / "no-such-model")
    t0 = time.monotonic()
    result = run_cli("serve", "--model", missing, "--port", "0")
    assert time.monotonic() - t0 < 30
    assert missing in one_line_error(result)


def test_runtime_lora_updating_needs_room_for_adapters(model):
    line = one_line_error(run_cli("serve", "--model", model, "--port", "0", "--allow-runtime-lora-updating"))
    assert "--allow-runtime-lora-updating needs room for adapters: --enable-lora" in line


def test_busy_port_names_the_port_and_the_flag(model):
    pytest.importorskip("uvicorn")  # without the server extra `serve` says so before it binds
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("serve", "--model", model, "--port", str(port), "--num-kv-blocks", "64")
    line = one_line_error(result)
    assert f"port {port}" in line and "already in use" in line and "--port" in line


# ---- a live server: access log and /metrics -------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    pytest.importorskip("fastapi")
    from specserve.bench.server_process import ServerProcess

    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(["--model", model, "--served-model-name", MODEL, "--num-kv-blocks", "256",
                         "--access-log"], log)
    try:
        srv.wait_ready(120)
        yield srv
    finally:
        assert srv.stop() == 0, srv.tail()


def scrape(server, name: str, **labels) -> float:
    import httpx

    text = httpx.get(server.url + "/metrics", timeout=5).text
    total = 0.0
    for label_text, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def test_access_log_has_a_line_per_request(server):
    import httpx

    assert httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                      timeout=30).status_code == 200
    assert httpx.get(server.url + "/no-such-path", timeout=5).status_code == 404
    time.sleep(0.2)
    log = server.tail(200)
    assert re.search(r"127\.0\.0\.1:\d+ POST /v1/completions 200 \d+\.\d{3}s$", log, re.M), log
    assert re.search(r"GET /no-such-path 404 \d+\.\d{3}s$", log, re.M), log
    assert re.search(r"GET /health 200 ", log, re.M), log


def test_an_aborted_stream_is_counted_as_abort(server):
    import httpx

    before = scrape(server, "specserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "logprobs": 1}  # logprobs: a chunk for every token, even while the text is held back
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break  # the client leaves: the stream is closed with 998 tokens to go
    deadline = time.monotonic() + 15
    while scrape(server, "specserve:request_success_total", finished_reason="abort") < before + 1:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.1)
    assert scrape(server, "specserve:request_success_total", finished_reason="abort") == before + 1


def test_request_histograms_count_each_request(server):
    import httpx

    names = ["request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
             "request_prompt_tokens", "request_generation_tokens", "time_to_first_token_seconds"]
    time.sleep(0.5)  # what earlier tests aborted has ended
    before = {n: (scrape(server, f"specserve:{n}_count"), scrape(server, f"specserve:{n}_sum")) for n in names}
    prompt_tokens = 0
    for prompt in ("def f(x):", "import os\n", "class Stack:"):
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5
        prompt_tokens += r["usage"]["prompt_tokens"]
    delta = {n: (scrape(server, f"specserve:{n}_count") - before[n][0],
                 scrape(server, f"specserve:{n}_sum") - before[n][1]) for n in names}
    assert all(count == 3 for count, _ in delta.values()), delta
    assert delta["request_generation_tokens"][1] == 15 and delta["request_prompt_tokens"][1] == prompt_tokens
    queue, prefill, ttft = (delta[n][1] for n in names[:2] + names[-1:])
    assert queue >= 0 and prefill > 0 and queue + prefill == pytest.approx(ttft)
    assert delta["request_decode_time_seconds"][1] > 0


# ---- when a request left the queue, from the engine's outputs -------------------------------------
def test_queue_and_prefill_split_at_the_step_before_the_first_token():
    """A arrives at an idle engine; B arrives while A decodes and gets its first token one step later: B
    was scheduled when the step before it ended (1.5), not at its arrival (1.2) nor its first token (2.0)."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("fastapi")  # the server package's modules import pydantic
    from specserve.engine.outputs import RequestOutput
    from specserve.server.metrics import ServerMetrics
    from specserve.server.streams import RequestTimes

    now = [0.0]
    metrics = ServerMetrics("m", lambda: None, clock=lambda: now[0])
    a = SimpleNamespace(num_prompt_tokens=4, times=RequestTimes(arrival=0.0))
    b = SimpleNamespace(num_prompt_tokens=6, times=RequestTimes(arrival=1.2))

    def out(tokens: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [], [7] * tokens, "", [7], "", finished, "length" if finished else None)

    async def steps():
        for t, outputs in ((1.0, [(a, out(1))]), (1.5, [(a, out(2))]), (2.0, [(a, out(3, True)), (b, out(1))]),
                           (2.5, [(b, out(2, True))])):
            now[0] = t
            for stream, output in outputs:  # one engine step's outputs arrive together
                metrics.on_output(stream, output)
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    asyncio.run(steps())

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(f"specserve:{name}", {"model_name": "m"})

    assert (a.times.scheduled, b.times.scheduled) == (0.0, 1.5)
    assert value("request_queue_time_seconds_sum") == pytest.approx(0.3)
    assert value("request_prefill_time_seconds_sum") == pytest.approx(1.0 + 0.5)
    assert value("request_decode_time_seconds_sum") == pytest.approx(1.0 + 0.5)
    assert value("request_prompt_tokens_sum") == 10 and value("request_generation_tokens_sum") == 5
    assert metrics.registry.get_sample_value("specserve:request_success_total",
                                             {"model_name": "m", "finished_reason": "length"}) == 2
