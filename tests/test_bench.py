"""`specserve bench` and `specserve compare` against real servers on a tiny model.

The bench's numbers must be what the server really returned: per-request token counts equal a direct
request's usage, totals are sums of the records, throughput is tokens over the level's wall time. A server
that dies mid-run gives failures, never tokens or a crash. `compare` runs each configuration's server,
writes its table and plot, and leaves no process behind.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from specserve.assets import make_tiny_checkpoint  # noqa: E402
from specserve.bench import compare, runner  # noqa: E402
from specserve.bench.client import BenchError, Endpoint, acceptance_length, parse_spec_counters, send_request  # noqa: E402
from specserve.bench.datasets import builtin, load_dataset  # noqa: E402
from specserve.bench.options import SweepOptions, add_sweep_args, sweep_options  # noqa: E402
from specserve.bench.server_process import ServerProcess  # noqa: E402
from specserve.cli import main  # noqa: E402

MODEL = "tiny"
KV = "--num-kv-blocks 256"  # plenty here, and quicker to allocate than the default 1 GiB


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("model") / "tiny")
    make_tiny_checkpoint(path)
    return path


def start_server(model: str, log_path) -> ServerProcess:
    server = ServerProcess(["--model", model, "--served-model-name", MODEL, *KV.split()], log_path)
    try:
        server.wait_ready(120)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    srv = start_server(model, tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.tail()


def bench(tmp_path, url: str, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", "--base-url", url, "--out", str(out), *flags]) == 0
    return json.loads(out.read_text())


def check_totals(level: dict) -> None:
    """Totals are sums over completed requests; throughputs are those totals over the level's duration."""
    done = [r for r in level["requests"] if r["ok"]]
    assert level["completed"] == len(done) and level["failed"] == len(level["requests"]) - len(done)
    assert level["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert level["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    duration = level["duration"]
    assert level["output_throughput"] == pytest.approx(level["total_output_tokens"] / duration, rel=1e-9)
    assert level["total_token_throughput"] == pytest.approx(
        (level["total_input_tokens"] + level["total_output_tokens"]) / duration, rel=1e-9)
    assert level["request_throughput"] == pytest.approx(len(done) / duration, rel=1e-9)
    assert all(r["output_tokens"] == r["prompt_tokens"] == 0 for r in level["requests"] if not r["ok"])


# ---- bench against a live server ------------------------------------------------------------------
def test_bench_numbers_are_what_the_server_returned(tmp_path, server):
    result = bench(tmp_path, server.url, "--concurrency", "1,3", "--requests-per-level", "6", "--max-tokens", "8",
                   "--warmup", "1", "--ignore-eos", "--goodput", "e2el:600000", "--metric-percentiles", "50,99")
    assert result["model"] == MODEL and [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    prompts = builtin()
    for level in result["levels"]:
        assert (level["completed"], level["failed"]) == (6, 0), level["errors"]
        check_totals(level)
        assert level["mean_accept_length"] is None  # no speculation on this server
        assert 0 < level["mean_ttft_ms"] <= level["mean_e2el_ms"] and level["p99_itl_ms"] > 0
        assert level["request_goodput"] == level["request_throughput"]  # ten minutes: every request meets it
        assert level["p50_e2el_ms"] <= level["p99_e2el_ms"]
        for record in level["requests"]:
            r = client.completions.create(model=MODEL, prompt=prompts[record["prompt_index"]].text, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 8
            assert (record["output_tokens"], record["prompt_tokens"]) == (8, r.usage.prompt_tokens)
            assert 0 < record["ttft"] <= record["latency"] and len(record["itl"]) <= 7


def test_flush_cache_keeps_levels_from_reusing_each_others_kv(tmp_path, server):
    hits = lambda: httpx.get(server.url + "/server_info").json()["prefix_cache"]["num_hits"]  # noqa: E731
    flags = ("--concurrency", "1,1", "--requests-per-level", "3", "--max-tokens", "2", "--warmup", "0")
    before = hits()
    bench(tmp_path, server.url, *flags)
    repeated = hits() - before  # the second level's prompts are the first's
    before = hits()
    result = bench(tmp_path, server.url, *flags, "--flush-cache")
    assert repeated > 0 and hits() - before < repeated and result["options"]["flush_cache"]


def test_flush_cache_tries_sglang_then_vllm_and_waits_out_a_refusal():
    from specserve.bench.client import flush_cache

    def server(answers: dict):
        calls = []

        def handle(request):
            calls.append(request.url.path)
            status = answers[request.url.path].pop(0) if answers.get(request.url.path) else 404
            return httpx.Response(status, json={"error": {"message": f"status {status}"}})
        return httpx.AsyncClient(transport=httpx.MockTransport(handle)), calls

    async def flush(answers: dict):
        client, calls = server(answers)
        async with client:
            await flush_cache(client, "http://s", None)
        return calls

    assert asyncio.run(flush({"/reset_prefix_cache": [200]})) == ["/flush_cache", "/reset_prefix_cache"]
    assert asyncio.run(flush({"/flush_cache": [409, 409, 200]})) == ["/flush_cache"] * 3
    with pytest.raises(BenchError, match="could not be emptied.*flush_cache: HTTP 404.*reset_prefix_cache: HTTP 404"):
        asyncio.run(flush({}))


def test_range_ratio_asks_each_prompt_its_own_length(tmp_path, server):
    """With --max-tokens-range-ratio and --ignore-eos every request returns the length drawn for its prompt,
    the same in every level; the lengths differ between prompts and stay inside the range."""
    result = bench(tmp_path, server.url, "--concurrency", "2,4", "--requests-per-level", "8", "--max-tokens", "12",
                   "--max-tokens-range-ratio", "0.25", "--warmup", "0", "--ignore-eos", "--seed", "5")
    endpoint = Endpoint(server.url, "completions", MODEL, 12, range_ratio=0.25, seed=5)
    seen = {}
    for level in result["levels"]:
        assert (level["completed"], level["failed"]) == (8, 0), level["errors"]
        for record in level["requests"]:
            assert record["output_tokens"] == endpoint.max_tokens_for(record["prompt_index"])
            seen[record["prompt_index"]] = record["output_tokens"]
    assert min(seen.values()) >= 3 and max(seen.values()) <= 12 and len(set(seen.values())) > 2
    assert result["options"]["max_tokens_range_ratio"] == 0.25
    fixed = Endpoint(server.url, "completions", MODEL, 12)
    assert {fixed.max_tokens_for(i) for i in range(20)} == {12}
    assert fixed.body(builtin()[0], 3)["max_tokens"] == 12
    loras = Endpoint(server.url, "completions", MODEL, 12, seed=5, loras=("a", "b"))
    assert [loras.model_for(i) for i in range(12)] == [loras.body(builtin()[0], i)["model"] for i in range(12)]
    assert {loras.model_for(i) for i in range(12)} == {"a", "b"} and fixed.model_for(3) == MODEL
    with pytest.raises(ValueError, match="max_tokens_range_ratio"):
        SweepOptions(max_tokens_range_ratio=0.0)


def test_bench_chat_counts_tokens_like_the_server(tmp_path, server):
    """Chat messages, no ignore_eos: the counts still equal a direct request's usage."""
    result = bench(tmp_path, server.url, "--endpoint", "chat", "--concurrency", "2", "--requests-per-level", "4",
                   "--max-tokens", "12", "--warmup", "0", "--seed", "3")
    [level] = result["levels"]
    assert (level["completed"], level["failed"]) == (4, 0), level["errors"]
    check_totals(level)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for record in level["requests"]:
        messages = builtin()[record["prompt_index"]].chat_messages()
        r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
        usage = r.usage
        assert (record["output_tokens"], record["prompt_tokens"]) == (usage.completion_tokens, usage.prompt_tokens)


def test_a_server_that_dies_mid_run_gives_failures(tmp_path, model):
    srv = start_server(model, tmp_path / "dying.log")
    killed = threading.Event()

    def kill_after_a_few_completions():
        while srv.proc.poll() is None:
            try:
                text = httpx.get(srv.url + "/metrics", timeout=2).text
            except httpx.HTTPError:
                break
            done = sum(float(v) for v in re.findall(r"^specserve:request_success_total{[^}]*} (\S+)$", text, re.M))
            if done >= 5:  # the server's warm-up, the bench's warm-up, three of the level's requests
                srv.proc.kill()
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_a_few_completions)
    killer.start()
    try:
        result = bench(tmp_path, srv.url, "--concurrency", "2", "--requests-per-level", "40", "--max-tokens", "32",
                       "--warmup", "1", "--ignore-eos")
    finally:
        killer.join(30)
        srv.stop()
    assert killed.is_set()
    [level] = result["levels"]
    check_totals(level)
    assert level["failed"] > 0 and level["completed"] >= 1 and level["completed"] + level["failed"] == 40
    assert all(r["error"] for r in level["requests"] if not r["ok"]) and level["errors"]
    assert level["mean_accept_length"] is None  # /metrics is gone after the level


def test_bench_auto_levels_and_rounds(tmp_path, server):
    """--requests-per-level auto sends max(8, 2C) requests at level C; --rounds 3 runs the sweep three times
    and keeps each level's median round, whole, with every round's summary."""
    result = bench(tmp_path, server.url, "--concurrency", "1,6", "--requests-per-level", "auto", "--rounds", "3",
                   "--max-tokens", "3", "--warmup", "0", "--ignore-eos")
    assert result["options"]["requests_per_level"] == "auto" and result["options"]["rounds"] == 3
    for level, expected in zip(result["levels"], (8, 12)):
        assert (level["completed"], level["failed"]) == (expected, 0), level["errors"]
        check_totals(level)  # the kept round's records are that round's
        assert [r["completed"] for r in level["rounds"]] == [expected] * 3
        throughputs = [r["output_throughput"] for r in level["rounds"]]
        assert level["output_throughput"] == sorted(throughputs)[1] == throughputs[level["round"]]
    spec = result["server_spec"]  # /server_info's speculation part: none on this server
    assert spec["num_drafts"] == 0 and spec["controller"] is None


# ---- compare ----------------------------------------------------------------------------------------
def test_compare_runs_each_configuration_and_leaves_nothing_behind(tmp_path, model, monkeypatch, capsys):
    """Plain, speculative (a random EAGLE-3 draft: acceptance is measured, not good) and one whose server
    cannot start: the first two run, the third is reported, and no server process is left. The tables are
    whole though the output is not a terminal; the temporary log folder is kept for the failed server."""
    from .eagle_utils import make_eagle3_checkpoint

    draft = make_eagle3_checkpoint(str(tmp_path / "draft"), model)
    # policy always: a random draft accepts nothing, so the adaptive controller may rightly never speculate
    spec_flags = f"{KV} --speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} " \
                 "--speculative-num-steps 2 --speculative-policy always"
    out, md, png = tmp_path / "compare.json", tmp_path / "compare.md", tmp_path / "compare.png"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    rc = main(["compare", "--config", f"plain={KV}", "--config", f"spec={spec_flags}",
               "--config", "bad=--no-such-flag",
               "--model", model, "--concurrency", "1,2", "--requests-per-level", "3", "--max-tokens", "6",
               "--warmup", "0", "--ignore-eos", "--out", str(out), "--markdown", str(md), "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    plain, spec, bad = result["configurations"]
    assert (plain["status"], spec["status"], bad["status"]) == ("ok", "ok", "failed")
    assert "exited with code 2" in bad["error"] and "--no-such-flag" in bad["error"]
    for c in (plain, spec):
        assert [lv["completed"] for lv in c["result"]["levels"]] == [3, 3]
        assert [lv["total_output_tokens"] for lv in c["result"]["levels"]] == [18, 18]
    assert all(lv["mean_accept_length"] is None for lv in plain["result"]["levels"])
    assert all(1 <= lv["mean_accept_length"] <= 3 for lv in spec["result"]["levels"])
    assert [lv["spec_drafts"] for lv in plain["result"]["levels"]] == [0, 0]
    for lv in spec["result"]["levels"]:  # policy always: a verify each step of each request after its first token
        assert 3 <= lv["spec_drafts"] <= 3 * 5 and lv["mean_accept_length"] == pytest.approx(
            1 + lv["spec_accepted"] / lv["spec_drafts"])
    pids = [c["pid"] for c in result["configurations"]]
    assert len(set(pids)) == 3
    for pid in pids:  # each server led its own process group: neither it nor any member is left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    text = md.read_text()
    assert "| concurrency | plain tok/s | spec tok/s | spec / plain |" in text and "bad (failed)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "…" not in printed.out + printed.err
    for c in (plain, spec):  # every level's throughput in the side-by-side table and in its own table
        for lv in c["result"]["levels"]:
            assert f"{lv['output_throughput']:.1f}" in printed.out
            assert f"{lv['total_token_throughput']:.1f}" in printed.err
    [kept] = os.listdir(temp)  # the bad server failed: its log is kept and the folder named
    assert os.path.isfile(temp / kept / "bad.log") and f"logs are kept in {temp / kept}\n" in printed.err


def test_compare_side_by_side_rounds(tmp_path, model, capsys):
    """--rounds 2: both servers up at once, every level run on each in both rounds; a server that cannot start
    is reported and the others still run; the ratio is the median of the rounds' ratios; nothing is left."""
    out, logs = tmp_path / "compare.json", tmp_path / "logs"
    rc = main(["compare", "--config", f"a={KV}", "--config", "bad=--no-such-flag",
               "--config", f"b={KV} --max-num-seqs 4", "--model", model, "--concurrency", "1,5",
               "--requests-per-level", "auto", "--rounds", "2", "--max-tokens", "3", "--warmup", "1",
               "--ignore-eos", "--out", str(out), "--log-dir", str(logs)])
    assert rc == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    a, bad, b = result["configurations"]
    assert (a["status"], bad["status"], b["status"]) == ("ok", "failed", "ok")
    assert "--no-such-flag" in bad["error"]
    for c in (a, b):
        assert [lv["completed"] for lv in c["result"]["levels"]] == [8, 10]
        assert all([r["completed"] for r in lv["rounds"]] == [lv["completed"]] * 2 for lv in c["result"]["levels"])
    for level_a, level_b in zip(a["result"]["levels"], b["result"]["levels"]):
        ratio = compare.level_ratio(level_b, level_a)
        per_round = [y["output_throughput"] / x["output_throughput"] for x, y in zip(level_a["rounds"],
                                                                                     level_b["rounds"])]
        assert ratio == pytest.approx(sum(per_round) / 2)  # the median of two
        assert f"{ratio:.2f}" in printed.out
    for c in result["configurations"]:  # no server process left
        with pytest.raises(ProcessLookupError):
            os.killpg(c["pid"], 0)
    requests_a = (logs / "a.log").read_text().count("POST /v1/completions")
    requests_b = (logs / "b.log").read_text().count("POST /v1/completions")
    assert requests_a == requests_b == 1 + 2 * (8 + 10)  # the warm-up, then two rounds of both levels


def test_interleaved_runs_each_level_on_each_server_in_turn(monkeypatch):
    """Rounds alternate the servers' order; each level keeps its median round; a server whose set-up fails
    gets its BenchError and no level."""
    calls = []
    speeds = {"a": [30.0, 10.0, 20.0], "b": [5.0, 50.0, 40.0]}  # output tok/s of each round, any level

    async def model(client, url, api_key):
        if url == "http://broken":
            raise BenchError("unreachable")
        return "m"

    async def warm_up(*args):
        return 0

    async def spec(url, api_key):
        return {"url": url}

    async def level(client, endpoint, prompts, concurrency, options, rng, progress, title):
        name = endpoint.base_url.removeprefix("http://")
        calls.append((name, concurrency, len(prompts)))
        rnd = sum(1 for n, c, _ in calls if (n, c) == (name, concurrency)) - 1
        return {"concurrency": concurrency, "output_throughput": speeds[name][rnd] * concurrency, "completed": 1,
                **{key: 0 for key in runner.ROUND_KEYS if key not in ("output_throughput", "completed")}}

    for name, fake in (("served_model", model), ("_warm_up", warm_up), ("server_spec", spec), ("_run_level", level)):
        monkeypatch.setattr(runner, name, fake)
    options = SweepOptions(concurrency=(1, 16), requests_per_level="auto", rounds=3, dataset="builtin")
    results = asyncio.run(runner.run_interleaved([("a", "http://a"), ("x", "http://broken"), ("b", "http://b")],
                                                 options))
    a, broken, b = results
    assert isinstance(broken, BenchError)
    assert calls == [("a", 1, 8), ("b", 1, 8), ("a", 16, 32), ("b", 16, 32),
                     ("b", 1, 8), ("a", 1, 8), ("b", 16, 32), ("a", 16, 32),
                     ("a", 1, 8), ("b", 1, 8), ("a", 16, 32), ("b", 16, 32)]
    for result, median_round, speed in ((a, 2, 20.0), (b, 2, 40.0)):
        assert [lv["round"] for lv in result["levels"]] == [median_round, median_round]
        assert [lv["output_throughput"] for lv in result["levels"]] == [speed, 16 * speed]
        assert [len(lv["rounds"]) for lv in result["levels"]] == [3, 3]
    assert a["server_spec"] == {"url": "http://a"}


def test_fresh_prompts_do_not_repeat_until_the_dataset_runs_out():
    from dataclasses import replace

    dataset = load_dataset("random")  # 200 prompts
    options = SweepOptions(concurrency=(1, 16), requests_per_level="auto", rounds=3, fresh_prompts=True)
    levels = runner.level_prompts(dataset, options)
    assert [len(lv) for lv in levels] == [8, 32] * 3
    indices = [i for lv in levels for i, _ in lv]
    assert len(set(indices)) == len(indices) == 120 and all(dataset[i] is p for lv in levels for i, p in lv)
    wrapped = [i for lv in runner.level_prompts(dataset[:50], options) for i, _ in lv]
    assert len(set(wrapped[:50])) == 50 and wrapped[50:100] == wrapped[:50]  # the same shuffle again
    every = runner.level_prompts(dataset, replace(options, fresh_prompts=False))  # the default
    assert all(lv == every[1][:len(lv)] for lv in every)  # every level: the first N of one shuffle


def test_ratios_of_rounds_are_medians_of_the_rounds_ratios():
    def ran(name, *levels):
        return {"name": name, "result": {"levels": list(levels)}}

    def level(c, value, rounds=None):
        out = {"concurrency": c, "output_throughput": value}
        if rounds:
            out["rounds"] = [{"output_throughput": v} for v in rounds]
        return out

    base = ran("plain", level(1, 100.0, [100.0, 90.0, 200.0]), level(4, 200.0))
    other = ran("spec", level(1, 150.0, [100.0, 150.0, 210.0]), level(4, 300.0))
    header, rows = compare.throughput_rows({"configurations": [base, other]})
    assert header == ["concurrency", "plain tok/s", "spec tok/s", "spec / plain"]
    assert rows == [["1", "100.0", "150.0", "1.05"], ["4", "200.0", "300.0", "1.50"]]  # not 150 / 100


def test_goodput_counts_the_requests_that_meet_every_slo():
    """A worked example: four completed requests, one failed, over 2 s."""
    from specserve.bench.client import RequestResult
    from specserve.bench.report import summarize_level

    def done(ttft, latency, tokens):
        return RequestResult(0, ok=True, ttft=ttft, latency=latency, prompt_tokens=3, output_tokens=tokens)

    results = [done(0.05, 0.25, 11),  # TPOT 20 ms: meets ttft:100 tpot:20
               done(0.05, 0.35, 11),  # TPOT 30 ms: too slow a token
               done(0.20, 0.20, 1),  # one token (TPOT 0): TTFT too late
               done(0.08, 0.08, 1),  # meets both
               RequestResult(0, ok=False, error="boom")]
    level = summarize_level(results, 2.0, 4, None, None, (50.0, 90.0), (("ttft", 100.0), ("tpot", 20.0)))
    assert level["request_goodput"] == pytest.approx(2 / 2.0) and level["request_throughput"] == 2.0
    assert level["p50_ttft_ms"] == pytest.approx(65.0) and level["p90_ttft_ms"] == pytest.approx(164.0)
    assert "p99_ttft_ms" not in level
    assert summarize_level(results, 2.0, 4, None, None, goodput=(("e2el", 300.0),))["request_goodput"] == 1.5
    assert summarize_level(results, 2.0, 4, None, None)["request_goodput"] is None


def test_goodput_and_percentile_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_sweep_args(parser)
    options = sweep_options(parser.parse_args(["--goodput", "ttft:500", "tpot:50", "--metric-percentiles",
                                               "50,99.9"]))
    assert options.goodput == (("ttft", 500.0), ("tpot", 50.0)) and options.metric_percentiles == (50.0, 99.9)
    for bad in (["--goodput", "itl:5"], ["--goodput", "ttft"], ["--goodput", "ttft:-1"],
                ["--metric-percentiles", "0"], ["--metric-percentiles", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(ValueError, match="goodput"):
        SweepOptions(goodput=(("itl", 5.0),))


def test_sweep_options_auto_and_rounds():
    import argparse

    parser = argparse.ArgumentParser()
    add_sweep_args(parser)
    options = sweep_options(parser.parse_args(["--requests-per-level", "auto", "--rounds", "3"]))
    assert (options.requests_per_level, options.rounds) == ("auto", 3)
    assert [options.requests_at(c) for c in (1, 4, 5, 16, 64)] == [8, 8, 10, 32, 128]
    fixed = sweep_options(parser.parse_args(["--requests-per-level", "5"]))
    assert [fixed.requests_at(c) for c in (1, 64)] == [5, 5] and fixed.rounds == 1
    assert sweep_options(parser.parse_args([])) == SweepOptions()  # defaults unchanged: 30 a level, one round
    assert sweep_options(parser.parse_args(["--fresh-prompts"])).fresh_prompts and not SweepOptions().fresh_prompts
    for bad in (["--requests-per-level", "0"], ["--requests-per-level", "many"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(ValueError, match="requests_per_level"):
        SweepOptions(requests_per_level="many")
    with pytest.raises(ValueError, match="rounds"):
        SweepOptions(rounds=0)


def test_compare_removes_its_log_folder_when_every_server_ran(tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def fake_run(config, options, model, log_dir, startup_timeout, console):
        with open(os.path.join(log_dir, f"{config.name}.log"), "w") as f:
            f.write("server log\n")
        status = "skipped" if config.name == "skipped" else "ok"
        return {"name": config.name, "status": status, "log": f.name, "result": None}

    monkeypatch.setattr(compare, "run_configuration", fake_run)
    configs = [compare.Configuration("a", ""), compare.Configuration("skipped", "")]
    result = compare.run_compare(configs, compare.SMALL_CPU_SWEEP)
    assert os.listdir(temp) == [] and [c["log"] for c in result["configurations"]] == [None, None]


def test_plot_labels_the_measured_levels():
    def ran(name, levels):
        return {"name": name, "result": {"levels": [{"concurrency": c, "output_throughput": 10.0 * c}
                                                    for c in levels]}}

    comparison = {"configurations": [ran("a", [1, 2, 5, 10]), ran("b", [1, 3]), {"name": "c", "result": None}]}
    [ax] = compare.throughput_figure(comparison).axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3", "5", "10"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True)] == []


def test_default_speculative_configurations_need_the_shipped_drafter(monkeypatch):
    plain, chain, adaptive = compare.DEFAULT_CONFIGURATIONS
    monkeypatch.setattr(compare, "default_draft_path", lambda: None)
    assert compare.skip_reason(plain, None) is None
    assert "drafter" in compare.skip_reason(chain, None) and "drafter" in compare.skip_reason(adaptive, None)
    assert compare.skip_reason(chain, "some/model") is None  # another model: its server says what is missing
    monkeypatch.setattr(compare, "default_draft_path", lambda: "shipped/eagle3")
    assert compare.skip_reason(chain, None) is None


def test_configuration_parsing():
    c = compare.Configuration.parse("chain=--speculative-algorithm EAGLE3 --speculative-num-steps '3'")
    assert c.name == "chain" and c.args == ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"]
    assert compare.Configuration.parse("plain=").args == []
    with pytest.raises(ValueError, match="NAME='FLAGS'"):
        compare.Configuration.parse("--max-num-seqs 2")


# ---- pieces -----------------------------------------------------------------------------------------
METRICS = """# HELP specserve:spec_decode_num_drafts_total Speculative verifies
specserve:spec_decode_num_drafts_total{model_name="m"} 10.0
specserve:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0
specserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
"""


def test_acceptance_length_from_metrics_deltas():
    before = parse_spec_counters(METRICS)
    assert before == (10.0, 15.0)
    after = parse_spec_counters(METRICS.replace("10.0", "30.0").replace("15.0", "45.0"))
    assert acceptance_length(before, after) == pytest.approx(1 + 30 / 20)
    assert acceptance_length(before, before) is None  # no drafts in the interval
    vllm = ('vllm:spec_decode_num_drafts_total{engine="0"} 4\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 6\n')
    assert parse_spec_counters(vllm) == (4.0, 6.0)
    assert parse_spec_counters("specserve:num_requests_running 0\n") is None


def sse_body(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def chunk(text: str, finish_reason=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
STREAMS = [  # (SSE body, status, ok, output tokens, error fragment)
    (sse_body(chunk("a"), chunk("bc"), chunk("d", "length"), USAGE, "[DONE]"), 200, True, 7, None),
    (sse_body(chunk("a"), chunk("bc"), chunk("d", "stop"), "[DONE]"), 200, True, 3, None),  # no usage: chunks
    (sse_body(chunk("a"), chunk("b")), 200, False, 0, "without [DONE]"),
    (sse_body(chunk("a"), chunk("", "abort"), USAGE, "[DONE]"), 200, False, 0, "aborted"),
    (sse_body(chunk("a"), {"error": {"message": "engine died"}}, "[DONE]"), 200, False, 0, "engine died"),
    (sse_body("not json"), 200, False, 0, "bad SSE event"),
    (json.dumps({"error": {"message": "too many"}}).encode(), 429, False, 0, "HTTP 429: too many"),
]


@pytest.mark.parametrize("body, status, ok, tokens, error", STREAMS)
def test_stream_outcomes(body, status, ok, tokens, error):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    endpoint = Endpoint("http://bench.invalid", "completions", "m", max_tokens=7)

    async def run():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, endpoint, builtin()[0], 0)

    r = asyncio.run(run())
    assert (r.ok, r.output_tokens) == (ok, tokens)
    assert (r.error is None) if ok else (error in r.error)
    if ok:
        assert r.ttft is not None and len(r.itl) == 2 and r.prompt_tokens == (5 if tokens == 7 else 0)


def test_datasets(tmp_path):
    assert 40 <= len(builtin()) <= 60 and len({p.text for p in builtin()}) == len(builtin())
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Sort a list."}, {"from": "gpt", "value": "sorted(xs)"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    [p] = load_dataset(f"sharegpt:{sharegpt}")
    assert p.text == "Sort a list." and p.chat_messages() == [{"role": "user", "content": "Sort a list."}]
    rows = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse a string."}]
    rows.write_text(json.dumps({"prompt": "def f():"}) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    a, b = load_dataset(f"jsonl:{rows}")
    assert a.text == "def f():" and b.text == "Reverse a string." and b.chat_messages() == messages
    rand = load_dataset("random", seed=1)
    assert rand == load_dataset("random", seed=1) and rand != load_dataset("random", seed=2)
    for bad in ("nope", "jsonl:", "builtin:x"):
        with pytest.raises(ValueError, match="unknown dataset"):
            load_dataset(bad)
    rows.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        load_dataset(f"jsonl:{rows}")
