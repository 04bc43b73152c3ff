"""What a model folder says about generation, and vLLM's options over it. generation_config.json, read as vLLM
reads it: its eos_token_id ends requests too (Llama 3 instruct models end turns with a token config.json does
not name), and its sampling fields are the defaults of what a request leaves out, offline and through the
server; `generation_config='vllm'` ignores the file. `chat_template` replaces the tokenizer's template."""
from __future__ import annotations

import contextlib
import json
import os

import pytest

from specserve import ConfigError, SamplingParams
from specserve.assets import make_tiny_checkpoint

from .conftest import make_llm
from .test_server import MODEL, serving

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPTS = ["def add(a, b):", "import os\n", "class Point:"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny random Llama with a tokenizer (and no generation_config.json yet)."""
    path = str(tmp_path_factory.mktemp("gen") / "tiny")
    make_tiny_checkpoint(path)
    return path


def write(folder: str, **fields) -> None:
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(fields, f)


@pytest.fixture(scope="module")
def greedy(folder):
    llm = make_llm(folder, speculative_algorithm="none")
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))


def test_its_eos_token_ids_end_requests(folder, greedy):
    stop = greedy[0].token_ids[5]
    first = greedy[0].token_ids.index(stop)
    write(folder, eos_token_id=[stop, 99999])
    for option, ends in (("auto", True), ("vllm", False)):
        llm = make_llm(folder, speculative_algorithm="none", generation_config=option)
        [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16))
        if ends:
            assert out.finish_reason == "stop" and out.token_ids == greedy[0].token_ids[:first + 1]
        else:
            assert out.finish_reason == "length" and out.token_ids == greedy[0].token_ids


def test_its_sampling_fields_are_the_defaults(folder, greedy):
    write(folder, top_k=1, temperature=1.3, max_new_tokens=16)  # top_k 1: whatever the temperature, the argmax
    llm = make_llm(folder, speculative_algorithm="none")
    assert llm.engine.default_params().top_k == 1 and llm.engine.default_params().max_tokens == 16
    outs = llm.generate(PROMPTS, [llm.engine.default_params(ignore_eos=True)] * len(PROMPTS))
    assert [o.token_ids for o in outs] == [g.token_ids for g in greedy]
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True, seed=3))
    assert [o.token_ids for o in sampled] != [g.token_ids for g in greedy], "a request's own values win"
    plain = make_llm(folder, speculative_algorithm="none", generation_config="vllm")
    assert plain.engine.default_params() == SamplingParams()


def test_the_server_takes_them_for_what_a_request_leaves_out(folder, greedy, tmp_path):
    write(folder, top_k=1, max_new_tokens=7)
    with contextlib.closing(serving(tmp_path / "server.log", "--model", folder, "--speculative-algorithm", "none")
                            ) as server:
        srv = next(server)
        client = srv.client()
        texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, extra_body={"ignore_eos": True})
                 .choices[0].text for p in PROMPTS]
        assert texts == [g.text for g in greedy]
        own = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, seed=1, extra_body={
            "ignore_eos": True, "top_k": 0}).choices[0].text for p in PROMPTS]
        assert own != texts, "top_k 0 asked for: sampled from the whole vocabulary"
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 7  # max_new_tokens: chat's default length
        sglang = httpx.post(srv.url + "/generate", json={"text": PROMPTS[0], "sampling_params": {"ignore_eos": True}},
                            timeout=60).json()  # SGLang's /generate takes them too
        assert greedy[0].text.startswith(sglang["text"]) and sglang["meta_info"]["completion_tokens"] == 7


def test_a_folder_without_one_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="generation_config"):
        make_llm(None, generation_config=str(tmp_path))


TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")


def test_a_chat_template_replaces_the_tokenizers(folder, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    with contextlib.closing(serving(tmp_path / "server.log", "--model", folder, "--speculative-algorithm", "none",
                                    "--chat-template", str(path))) as server:
        srv = next(server)
        llm = make_llm(folder, speculative_algorithm="none", chat_template=TEMPLATE)
        want = llm.tokenizer.encode("<<user: hi>>A:", add_special_tokens=False)
        assert llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            "<<user: hi>>A:"
        r = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert r.usage.prompt_tokens == len(want)
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        make_llm(folder, chat_template=str(tmp_path / "missing.jinja"))
