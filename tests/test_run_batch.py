"""`specserve run-batch`: OpenAI batch files through the server's routes. Greedy outputs equal the offline
engine's, output lines keep input order, and every bad line gets its own error line while the others run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from specserve.cli import main  # noqa: E402

from .test_server import chat_prompt_ids, greedy, llm, model  # noqa: E402,F401 (fixtures)

MESSAGES = [{"role": "user", "content": "Sort a list."}]


def line(custom_id, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def run(model_path: str, lines: list[str], tmp_path, *flags: str) -> list[dict]:  # noqa: F811
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(out), "--model", model_path, "--served-model-name",
                 "tiny", *flags]) == 0
    return [json.loads(text) for text in out.read_text().splitlines()]


def test_outputs_equal_offline_in_input_order(tmp_path, model, llm):  # noqa: F811
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def"]
    lines = [line(f"c{i}", "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 28 - 8 * i,
                                               "temperature": 0, "ignore_eos": True})
             for i, p in enumerate(prompts)]
    lines.append(line("chat", "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 10,
                                                       "temperature": 0, "ignore_eos": True}))
    lines.append(line("two", "/v1/completions", {"prompt": prompts[0], "max_tokens": 6, "n": 2, "temperature": 0}))
    lines.append(line("resp", "/v1/responses", {"model": "tiny", "input": MESSAGES, "max_output_tokens": 10,
                                                "temperature": 0, "ignore_eos": True}))
    got = run(model, lines, tmp_path)
    assert [g["custom_id"] for g in got] == ["c0", "c1", "c2", "chat", "two", "resp"]
    assert all(g["error"] is None and g["response"]["status_code"] == 200 for g in got)
    want = llm.generate(prompts, [greedy(28 - 8 * i) for i in range(3)])
    assert [g["response"]["body"]["choices"][0]["text"] for g in got[:3]] == [w.text for w in want]
    [chat] = llm.generate([chat_prompt_ids(llm, MESSAGES)], greedy(10))
    assert got[3]["response"]["body"]["choices"][0]["message"]["content"] == chat.text
    assert got[3]["response"]["request_id"] == got[3]["response"]["body"]["id"]
    assert [c["index"] for c in got[4]["response"]["body"]["choices"]] == [0, 1]
    assert got[5]["response"]["body"]["output"][0]["content"][0]["text"] == chat.text
    assert len({g["id"] for g in got}) == len(got)


@pytest.mark.parametrize("bad, code, words", [
    ("not json", "invalid_json", "line 2: the line is not JSON"),
    (line("", "/v1/completions", {"prompt": "x"}), "invalid_request", "custom_id must be"),
    (line("x", "/v1/embeddings", {"input": "x"}), "invalid_request", "url '/v1/embeddings' is not served"),
    (line("x", "/v1/completions", {"prompt": "x"}, method="GET"), "invalid_request", "method must be POST"),
    (line("x", "/v1/completions", {"prompt": "x", "stream": True}), "invalid_request", "body.stream must be false"),
    (line("first", "/v1/completions", {"prompt": "x"}), "duplicate_custom_id", "used by an earlier line"),
])
def test_a_bad_line_gets_its_error_and_the_others_run(tmp_path, model, bad, code, words):  # noqa: F811
    good = line("first", "/v1/completions", {"prompt": "x", "max_tokens": 3})
    after = line("after", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})
    first, middle, last = run(model, [good, bad, "", after], tmp_path)
    assert first["error"] is None and last["error"] is None and last["custom_id"] == "after"
    assert middle["error"]["code"] == code and words in middle["error"]["message"], middle
    assert middle["response"]["status_code"] == 400 and middle["response"]["body"] is None


def test_a_refused_request_carries_the_servers_error(tmp_path, model):  # noqa: F811
    lines = [line("neg", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
             line("other", "/v1/chat/completions", {"model": "other", "messages": MESSAGES})]
    neg, other = run(model, lines, tmp_path)
    assert neg["response"]["status_code"] == 400 and neg["response"]["body"]["error"]["param"] == "max_tokens"
    assert neg["error"]["message"] == neg["response"]["body"]["error"]["message"]
    assert other["response"]["status_code"] == 404 and other["error"]["code"] == "model_not_found"


def test_lines_beyond_the_queue_wait_instead_of_failing(tmp_path, model, llm):  # noqa: F811
    """Two slots and no queue: each line of two choices fills the server, so the later ones get 429 from it
    and must wait for the earlier ones."""
    prompts = ["while True:", "print(", "x = [", "return x +"]
    lines = [line(f"r{i}", "/v1/completions", {"prompt": p, "max_tokens": 8, "n": 2, "temperature": 0,
                                               "ignore_eos": True}) for i, p in enumerate(prompts)]
    got = run(model, lines, tmp_path, "--max-num-seqs", "2", "--max-queued-requests", "0")
    assert [g["response"]["status_code"] for g in got] == [200] * 4
    want = llm.generate(prompts, greedy(8))
    assert [[c["text"] for c in g["response"]["body"]["choices"]] for g in got] == [[w.text] * 2 for w in want]


def test_standard_input_to_standard_output(model):  # noqa: F811
    lines = [line("a", "/v1/completions", {"prompt": "x", "max_tokens": 2}), "{"]
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "run-batch", "-i", "-", "-o", "-", "--model",
                           model], input="\n".join(lines), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(text) for text in proc.stdout.splitlines()]
    assert [o["custom_id"] for o in out] == ["a", None]
    assert out[0]["response"]["status_code"] == 200 and out[1]["error"]["code"] == "invalid_json"
    assert "2 lines" in proc.stderr and "1 succeeded, 1 failed" in proc.stderr


def test_a_missing_input_file_is_named(tmp_path, model, capsys):  # noqa: F811
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o"), "--model", model]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_a_running_batch_logs_how_far_it_is(tmp_path, model, monkeypatch, caplog):  # noqa: F811
    from specserve.server import batch

    monkeypatch.setattr(batch, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="specserve.server.batch"):
        run(model, [line("a", "/v1/completions", {"prompt": "x", "max_tokens": 2}), "{"], tmp_path)
    assert "2 lines done (1 failed), 2 written" in caplog.text
