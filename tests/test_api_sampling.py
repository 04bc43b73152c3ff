"""The penalty and bias fields of OpenAI and vLLM requests (issue 20): `repetition_penalty`, `presence_penalty`,
`frequency_penalty`, `logit_bias` (string token ids) and `min_tokens` map onto SamplingParams fields of the same
names; out-of-range values and token ids outside the vocabulary get a 400 naming the field. End to end, the
server's output equals the engine's for the same SamplingParams, and a bias of 100 forces its token.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("fastapi")  # the server extra (pydantic with it)
httpx = pytest.importorskip("httpx")

from specserve import SamplingParams  # noqa: E402
from specserve.server.formatting import MIN_LOGPROB, json_logprob  # noqa: E402
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

from .test_server import MODEL, PROMPTS, greedy, llm, model, server  # noqa: E402, F401 (fixtures)

PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60)


def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


# ---- the mapping ----------------------------------------------------------------------------------
def test_fields_map_onto_sampling_params_names():
    req = CompletionRequest.model_validate_json(json.dumps({
        "prompt": "x", "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "logit_bias": {"17": 100, "0042": -5.5}, "min_tokens": 3.0}))
    options = req.sampling_options(16, None)
    assert {k: options[k] for k in PENALTIES} == {"repetition_penalty": 1.3, "presence_penalty": 0.5,
                                                  "frequency_penalty": -0.25, "logit_bias": {17: 100.0, 42: -5.5},
                                                  "min_tokens": 3}


def test_neutral_and_absent_values_are_the_defaults():
    """What `vllm bench serve` sends (repetition_penalty 1.0), OpenAI's defaults, and nothing at all."""
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "min_tokens": 0}
    default = SamplingParams(max_tokens=16)
    for model_cls, base in [(CompletionRequest, {"prompt": "x"}),
                            (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})]:
        for fields in (neutral, {}):
            params = SamplingParams(**model_cls.model_validate({**base, **fields}).sampling_options(16, None))
            assert params == default


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "1.2"}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"), ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"), ({"logit_bias": {"five": 1}}, "logit_bias.five.[key]"),
    ({"logit_bias": {"-5": 1}}, "logit_bias.-5.[key]"), ({"logit_bias": [5]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_values_are_refused_naming_the_field(server, extra, param):  # noqa: F811
    r = post(server, {"prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_logit_bias_outside_the_vocabulary_is_refused(server, model):  # noqa: F811
    vocab = vocab_size(model)
    r = post(server, {"prompt": "x", "logit_bias": {"3": 1, str(vocab): 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert f"token id {vocab}" in r.json()["error"]["message"]
    r = post(server, {"prompt": "x", "allowed_token_ids": [3, vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


# ---- end to end, once the engine has the fields ----------------------------------------------------
def test_a_bias_of_100_forces_its_token(server, llm):  # noqa: F811
    token = llm.tokenizer.encode(" return", add_special_tokens=False)[0]
    r = post(server, {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                      "logit_bias": {str(token): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == llm.tokenizer.decode([token] * 6)


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 2}, {"min_tokens": 10},
    {"logit_bias": {"5": -100, "17": 3.5}},
    {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 4},
])
def test_the_server_samples_as_the_engine_does_with_the_same_params(server, llm, extra):  # noqa: F811
    r = post(server, {"prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    mapped = dict(extra, logit_bias={int(k): v for k, v in extra.get("logit_bias", {}).items()})
    [ref] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=16, **mapped))
    assert r.json()["choices"][0]["text"] == ref.text
    if "min_tokens" in extra:
        assert r.json()["usage"]["completion_tokens"] >= extra["min_tokens"]


def test_allowed_token_ids_are_all_that_is_sampled(server, llm):  # noqa: F811
    allowed = [llm.tokenizer.encode(w, add_special_tokens=False)[0] for w in (" return", " x", " (")]
    r = post(server, {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                      "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    [ref] = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                                      allowed_token_ids=allowed))
    assert r.json()["choices"][0]["text"] == ref.text
    assert set(ref.token_ids) <= set(allowed) and len(set(ref.token_ids)) > 1


def test_truncate_prompt_tokens_keeps_the_last_ones(server, llm):  # noqa: F811
    prompt = "\n".join(PROMPTS)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    [ref] = llm.generate([ids[-10:]], greedy(8))
    r = post(server, {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                      "truncate_prompt_tokens": 10, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 10 and body["choices"][0]["text"] == llm.tokenizer.decode(ids[-10:]) \
        + ref.text
    messages = [{"role": "user", "content": prompt}]
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": messages, "max_tokens": 4, "truncate_prompt_tokens": 12}).json()
    assert chat["usage"]["prompt_tokens"] == 12


def test_logprobs_stay_json():
    """A logprob of -inf or NaN (a token the processed logits rule out) goes out as -9999, as from vLLM:
    JSON has no infinities, and a non-streamed body with one was a 500 (a repetition_penalty of 5e-324,
    found by schemathesis, now refused)."""
    assert [json_logprob(x) for x in (-0.5, float("-inf"), float("nan"))] == [-0.5, MIN_LOGPROB, MIN_LOGPROB]
    json.dumps([json_logprob(float("nan"))], allow_nan=False)


def test_bad_words_are_never_generated(server, llm):  # noqa: F811
    [plain] = llm.generate([PROMPTS[0]], greedy(16))
    word = next(w for w in (llm.tokenizer.decode([t]).strip() for t in plain.token_ids[2:]) if w.isalpha())
    r = post(server, {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                      "bad_words": [word]})
    assert r.status_code == 200, r.text
    params = greedy(16, bad_words=[word])
    [ref] = llm.generate([PROMPTS[0]], params)
    assert r.json()["choices"][0]["text"] == ref.text != plain.text
    banned = {w[0] for w in params.bad_words_token_ids if len(w) == 1}
    assert banned and banned & set(plain.token_ids) and not banned & set(ref.token_ids)
    for blank in (["  "], "word"):
        r = post(server, {"prompt": "x", "bad_words": blank})
        assert r.status_code == 400 and "bad_words" in r.text, r.text


def test_logprobs_name_tokens_by_id_when_asked(server, llm, model):  # noqa: F811
    """vLLM's return_tokens_as_token_ids: 'token_id:N' wherever logprobs name a token, N the token sampled."""
    [ref] = llm.generate([PROMPTS[1]], greedy(6, logprobs=2))
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    by_id = post(server, dict(body, return_tokens_as_token_ids=True)).json()["choices"][0]
    assert by_id["text"] == ref.text
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    tops = [name for top in by_id["logprobs"]["top_logprobs"] for name in top]
    assert len(tops) >= 6 and all(name.startswith("token_id:") and int(name[9:]) < vocab_size(model) for name in tops)
    as_text = post(server, dict(body, return_tokens_as_token_ids=False)).json()["choices"][0]
    assert as_text["logprobs"]["tokens"] == [llm.tokenizer.decode([t]) for t in ref.token_ids]
    chat = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60, json={
        "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()["choices"][0]
    for entry in chat["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["token"].startswith("token_id:")
    ids = [int(entry["token"].split(":")[1]) for entry in chat["logprobs"]["content"]]
    assert llm.tokenizer.decode(ids) == chat["message"]["content"]


def test_the_server_flag_sets_the_default_naming():
    from specserve.server.options import ServerOptions
    from specserve.server.protocol import CompletionRequest
    from specserve.server.state import ServerState

    for flag in (False, True):
        state = ServerState(ServerOptions(return_tokens_as_token_ids=flag), "m")
        for asked, by_id in ((None, flag), (True, True), (False, False)):
            req = CompletionRequest(prompt="x", return_tokens_as_token_ids=asked)
            assert (state.token_names(req) is state.token_ids) == by_id
