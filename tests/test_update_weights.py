"""Weights updated in a running engine (SGLang's update_weights_from_disk): after the update the engine gives the
tokens a fresh engine of the new checkpoint gives (plain, speculative with the old drafter, two ranks), with no
prefix cached from the old weights; a checkpoint of other shapes is refused before anything changes, one that
fails to load leaves the weights served before, and a busy engine refuses. Through the server: the route, its
answers, and /get_model_info."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import SamplingParams
from specserve.assets import make_tiny_checkpoint
from specserve.engine.outputs import EngineBusy, RequestError
from specserve.models import WeightError

from .conftest import assert_pool_full, make_hf_checkpoint, make_llm, mixed_prompts, skip_without_ranks
from .eagle_utils import make_pair

VOCAB = 64
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A (with an EAGLE-3 drafter), B (other weights, A's shapes), C (one layer more), broken (B without a
    tensor)."""
    root = tmp_path_factory.mktemp("weights")
    a, draft = make_pair(root / "a", VOCAB)
    b = make_hf_checkpoint(str(root / "b"), "llama", seed=9, vocab=VOCAB, layers=4)
    c = make_hf_checkpoint(str(root / "c"), "llama", seed=9, vocab=VOCAB, layers=5)
    broken = str(root / "broken")
    shutil.copytree(b, broken)
    [weights] = [f for f in os.listdir(broken) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(broken, weights))
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, os.path.join(broken, weights), metadata={"format": "pt"})
    return {"a": a, "draft": draft, "b": b, "c": c, "broken": broken}


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(4, VOCAB, seed=21, lo=3, hi=20)


@pytest.fixture(scope="module")
def want(folders, prompts):
    """Each checkpoint's greedy tokens from a fresh engine."""
    return {name: [o.token_ids for o in make_llm(folders[name]).generate(prompts, GREEDY)] for name in ("a", "b")}


def tokens(llm, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_a_running_engine_takes_new_weights(folders, prompts, want):
    assert want["a"] != want["b"]
    llm = make_llm(folders["a"], enable_prefix_caching=True)
    assert tokens(llm, prompts) == want["a"]
    hits = llm.engine.stats.prefix_cache.num_hits
    llm.update_weights(folders["b"])
    assert tokens(llm, prompts) == want["b"]
    assert llm.engine.stats.prefix_cache.num_hits == hits  # nothing cached under A's weights was reused
    assert llm.engine.weights == (folders["b"], "safetensors")
    assert_pool_full(llm)


def test_refusals_leave_the_served_weights(folders, prompts, want):
    llm = make_llm(folders["a"])
    with pytest.raises(RequestError, match="num_layers differ"):
        llm.update_weights(folders["c"])
    with pytest.raises(RequestError, match="cannot read"):
        llm.update_weights(folders["c"] + "-nowhere")
    with pytest.raises(WeightError, match="did not load .*down_proj.*the weights from .* are back"):
        llm.update_weights(folders["broken"])
    assert tokens(llm, prompts) == want["a"]
    llm.engine.add_request(prompts[0], GREEDY)
    llm.engine.step()
    with pytest.raises(EngineBusy, match="1 request\\(s\\) hold KV blocks: update the weights when none runs"):
        llm.update_weights(folders["b"])
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.update_weights(folders["b"])
    assert tokens(llm, prompts) == want["b"]


def test_speculation_stays_lossless_on_new_weights(folders, prompts, want):
    llm = make_llm(folders["a"], speculative_algorithm="EAGLE3", speculative_draft_model_path=folders["draft"],
                   speculative_num_steps=3, speculative_policy="always")
    assert tokens(llm, prompts) == want["a"]
    llm.update_weights(folders["b"])
    assert tokens(llm, prompts) == want["b"]
    assert llm.engine.stats.spec.num_drafts > 0
    assert_pool_full(llm)


def test_two_ranks_take_new_weights(folders, prompts, want):
    skip_without_ranks({"tensor_parallel_size": 2})
    llm = make_llm(folders["a"], tensor_parallel_size=2, speculative_algorithm="EAGLE3",
                   speculative_draft_model_path=folders["draft"], speculative_num_steps=2, speculative_policy="always")
    try:
        llm.update_weights(folders["b"])
        assert tokens(llm, prompts) == want["b"]
        [weights] = [f for f in os.listdir(folders["b"]) if f.endswith(".safetensors")]
        embedding = load_file(os.path.join(folders["b"], weights))["model.embed_tokens.weight"]
        assert torch.equal(llm.engine.runner.draft_embedding.weight.float(), embedding.float())  # the draft's copy
        with pytest.raises(WeightError):
            llm.update_weights(folders["broken"])
        assert tokens(llm, prompts) == want["b"]
    finally:
        llm.engine.close()


# ---- the server ---------------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from .test_server import serving

    root = tmp_path_factory.mktemp("served")
    a, b = str(root / "a"), str(root / "b")
    make_tiny_checkpoint(a, seed=0)
    make_tiny_checkpoint(b, seed=1)
    for srv in serving(root / "server.log", "--model", a):
        yield srv, root, a, b


def test_the_route_updates_and_says_so(served):
    srv, root, a, b = served
    post = lambda path, body: httpx.post(srv.url + path, json=body, timeout=60)  # noqa: E731
    body = {"text": "def f(x):", "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    before = post("/generate", body).json()["output_ids"]
    r = post("/update_weights_from_disk", {"model_path": b, "flush_cache": True})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    offline = make_llm(b).generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert post("/generate", body).json()["output_ids"] == offline[0].token_ids != before
    assert httpx.get(srv.url + "/get_model_info").json() == {"model_path": b, "tokenizer_path": a,
                                                            "is_generation": True}
    mismatch = str(root / "other")
    make_hf_checkpoint(mismatch, "llama", vocab=VOCAB)
    r = post("/update_weights_from_disk", {"model_path": mismatch})
    assert r.status_code == 400 and r.json()["success"] is False and "differ" in r.json()["message"]
    for bad, param in (({"model_path": mismatch + "-none"}, "model_path"),
                       ({"model_path": b, "abort_all_requests": True}, "abort_all_requests")):
        r = post("/update_weights_from_disk", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with httpx.stream("POST", srv.url + "/generate", timeout=60, json={
            "text": "x", "stream": True, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}) as stream:
        lines = stream.iter_lines()
        next(lines)
        r = post("/update_weights_from_disk", {"model_path": a})
        assert r.status_code == 409 and "hold KV blocks" in r.json()["message"]
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream ran to its end
    assert post("/generate", body).json()["output_ids"] == offline[0].token_ids  # the refusals changed nothing
