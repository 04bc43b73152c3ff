"""LoRA adapters (PEFT's format) against merged checkpoints: an adapter's greedy output equals transformers' on a
copy of the base model whose weights have the adapter merged in (W + scale * B A), token for token, for the
dense families, with requests of two adapters and of the base model in one batch (their prompts shared, so the
prefix cache must keep their KV apart), under chunked prefill and preemption, on two tensor-parallel ranks, and
with EAGLE-3 speculation (lossless: its tokens equal plain decoding's). Adapters the engine cannot serve fail
at load with an error naming the problem."""
from __future__ import annotations

import json
import math
import os

import pytest
from safetensors.torch import load_file, save_file

from specserve import SamplingParams
from specserve.config import ConfigError
from specserve.engine.cuda_graph import ADAPTERS
from specserve.engine.outputs import RequestError
from specserve.models.lora import LoRAError, random_adapter

from .conftest import (
    DEVICE,
    assert_pool_full,
    hf_greedy,
    make_hf_checkpoint,
    make_llm,
    mixed_prompts,
    skip_without_ranks,
)
from .eagle_utils import make_eagle3_checkpoint
from .test_prompt_logprobs import EagerGraphs

TOKENS = 24
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_adapter(path: str, base: str, targets: tuple, rank: int, seed: int, rslora: bool = False,
                 **config) -> str:
    return random_adapter(path, base, targets, rank, seed, use_rslora=rslora, **config)


def merged(path: str, base: str, adapter: str) -> str:
    """A copy of base with the adapter merged into its weights."""
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    weights = load_file(os.path.join(base, "model.safetensors"))
    for name in list(weights):
        a = lora.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is not None:
            b = lora[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            r = a.shape[0]
            scale = config["lora_alpha"] / (math.sqrt(r) if config["use_rslora"] else r)
            weights[name] = weights[name] + scale * (b @ a)
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"))
    for extra in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(base, extra)):
            with open(os.path.join(base, extra)) as src, open(os.path.join(path, extra), "w") as dst:
                dst.write(src.read())
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per family: the base folder and two adapters (attention only, rank 4; everything, rank 8 with rsLoRA), each
    with its merged copy."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, arch in enumerate(("llama", "qwen2", "qwen3")):
        base = make_hf_checkpoint(str(root / arch), arch, seed=10 + i)
        a = make_adapter(str(root / f"{arch}-a"), base, ATTN, 4, seed=1)
        b = make_adapter(str(root / f"{arch}-b"), base, ATTN + MLP, 8, seed=2, rslora=True)
        out[arch] = base, {"a": (a, merged(str(root / f"{arch}-a-merged"), base, a)),
                           "b": (b, merged(str(root / f"{arch}-b-merged"), base, b))}
    return out


def options(adapters: dict, **kw) -> dict:
    return dict(lora_modules=",".join(f"{name}={folder}" for name, (folder, _) in adapters.items()),
                speculative_algorithm="none", **kw)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)


def expected(base: str, adapters: dict, prompts: list, names: list) -> list[list[int]]:
    by_model = {None: base, **{name: m for name, (_, m) in adapters.items()}}
    out = [None] * len(prompts)
    for name, model in by_model.items():
        rows = [i for i, n in enumerate(names) if n == name]
        for i, tokens in zip(rows, hf_greedy(model, [prompts[i] for i in rows], TOKENS)):
            out[i] = tokens
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adapters_equal_their_merged_models_in_one_batch(pairs, arch):
    base, adapters = pairs[arch]
    prompts = mixed_prompts(4, 256, seed=3)
    prompts, names = prompts * 3, [None] * 4 + ["a"] * 4 + ["b"] * 4  # the same prompts under each model
    llm = make_llm(base, **options(adapters))
    outs = llm.generate(prompts, greedy(), lora=names)
    assert [o.token_ids for o in outs] == expected(base, adapters, prompts, names)
    assert_pool_full(llm)


def test_chunked_prefill_preemption_and_cached_prefixes(pairs):
    base, adapters = pairs["llama"]
    prompts = mixed_prompts(6, 256, seed=4, lo=40, hi=90)
    names = ["a", None, "b", "a", "b", None]
    want = expected(base, adapters, prompts, names)
    llm = make_llm(base, **options(adapters, max_num_batched_tokens=48, num_kv_blocks=24, max_model_len=256))
    for _ in range(2):  # the second round starts on the first's cached blocks
        assert [o.token_ids for o in llm.generate(prompts, greedy(), lora=names)] == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.blocks.stats.num_hits > 0
    assert_pool_full(llm)


def test_two_tensor_parallel_ranks_equal_one(pairs):
    base, adapters = pairs["qwen2"]
    prompts, names = mixed_prompts(3, 256, seed=5) * 2, [None, "a", "b", "b", "a", None]
    skip_without_ranks({"tensor_parallel_size": 2})
    one = make_llm(base, **options(adapters)).generate(prompts, greedy(), lora=names)
    llm = make_llm(base, **options(adapters, tensor_parallel_size=2, max_loras=3))
    try:
        two = llm.generate(prompts, greedy(), lora=names)
        llm.engine.load_lora("c", adapters["b"][0])  # at run time, on both ranks
        late = llm.generate(prompts, greedy(), lora=["c" if n == "b" else n for n in names])
    finally:
        llm.engine.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one] == [o.token_ids for o in late]


def test_speculative_decoding_with_adapters_is_lossless(pairs, tmp_path):
    base, adapters = pairs["llama"]
    draft = make_eagle3_checkpoint(str(tmp_path / "draft"), base)
    prompts, names = mixed_prompts(4, 256, seed=6) * 2, ["a", None, "b", "a", "b", None, "a", "b"]
    plain = make_llm(base, **options(adapters)).generate(prompts, greedy(), lora=names)
    spec = make_llm(base, **dict(options(adapters), speculative_algorithm="EAGLE3",
                                 speculative_draft_model_path=draft, speculative_policy="always"))
    outs = spec.generate(prompts, greedy(), lora=names)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.stats.spec.num_drafts > 0


def test_bad_adapters_and_names_are_refused(pairs, tmp_path):
    base, adapters = pairs["llama"]
    folder, _ = adapters["a"]
    llm = make_llm(base, **options({"a": adapters["a"]}))
    with pytest.raises(RequestError, match="unknown LoRA adapter 'b'"):
        llm.generate([[5, 6]], greedy(), lora="b")
    dora = make_adapter(str(tmp_path / "dora"), base, ATTN, 4, seed=1, use_dora=True)
    with pytest.raises(LoRAError, match="use_dora"):
        make_llm(base, lora_modules=f"d={dora}", speculative_algorithm="none")
    head = make_adapter(str(tmp_path / "head"), base, ("lm_head",), 4, seed=1)
    with pytest.raises(LoRAError, match="lm_head is not supported"):
        make_llm(base, lora_modules=f"h={head}", speculative_algorithm="none")
    for value, words in [("a", "not name=folder"), (f"a={folder},a={folder}", "twice"),
                         (f"x={tmp_path}", "no adapter folder")]:
        with pytest.raises(ConfigError, match=words):
            make_llm(base, lora_modules=value, speculative_algorithm="none")


class LoRAEagerGraphs(EagerGraphs):
    lora_slots = 2

    def __init__(self, runner):
        super().__init__(runner)
        self.adapter_keys = []

    def replay(self, key, step, pending):
        assert (key[-1] == ADAPTERS) == bool(step.loras), (key, step.loras)
        self.adapter_keys += [key] if step.loras else []
        return super().replay(key, step, pending)


def test_steps_with_adapter_rows_take_the_adapter_graphs(pairs):
    """The runner's graph branch on the CPU (a stand-in graph runner, as in test_prompt_logprobs): steps with
    adapter rows take the graphs keyed ADAPTERS (decode and mixed), base-only steps the others; tokens equal a run
    without graphs. (tests: --device cuda runs the real graphs.)"""
    base, adapters = pairs["llama"]
    prompts, names = mixed_prompts(4, 256, seed=7), ["a", None, "b", None]
    params = [SamplingParams(temperature=0, max_tokens=8 if name else 24, ignore_eos=True) for name in names]
    llm = make_llm(base, **options(adapters))
    want = llm.generate(prompts, params, lora=names)
    llm.engine.runner.graphs = graphs = LoRAEagerGraphs(llm.engine.runner)
    got = llm.generate(prompts, params, lora=names)
    assert graphs.replays > len(graphs.adapter_keys) > 0 and {k[0] == 0 for k in graphs.adapter_keys} == {0, 1}
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="CUDA graphs")
def test_adapter_graphs_equal_eager_steps(pairs):
    """On CUDA: the adapter twins of the decode and mixed graphs give the eager steps' tokens, with adapters loaded
    before and after the capture."""
    base, adapters = pairs["llama"]
    prompts, names = mixed_prompts(6, 256, seed=9), ["a", None, "b", "b", None, "a"]
    eager = make_llm(base, **options(adapters, enforce_eager=True, max_loras=3))
    graphs = make_llm(base, **options(adapters, max_loras=3))
    for llm in (eager, graphs):
        llm.engine.load_lora("c", adapters["a"][0])
    late = ["c" if n == "a" else n for n in names]
    want = [o.token_ids for o in eager.generate(prompts * 2, greedy(), lora=names + late)]
    runner = graphs.engine.runner.graphs
    before = runner.adapter_replays
    assert [o.token_ids for o in graphs.generate(prompts * 2, greedy(), lora=names + late)] == want
    assert runner.adapter_replays > before and runner.mixed_replays > 0


def test_the_server_serves_adapters_by_model_name(tmp_path):
    """`serve --lora-modules a=... b=...`: /v1/models lists the adapters; completions, chat and /generate run
    the adapter a request names (the offline engine's tokens); other names get 404. vLLM's run-time routes load
    and unload adapters. (The server schedules by priority, which a request may then give.)"""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("openai")
    from specserve.assets import make_tiny_checkpoint

    from .test_server import MODEL, chat_prompt_ids, serving

    base = str(tmp_path / "tiny")
    make_tiny_checkpoint(base)
    folders = {name: make_adapter(str(tmp_path / name), base, targets, rank, seed)
               for name, targets, rank, seed in [("a", ATTN, 4, 1), ("b", ATTN + MLP, 8, 2)]}
    modules = [f"{name}={folder}" for name, folder in folders.items()]
    llm = make_llm(base, lora_modules=",".join(modules), speculative_algorithm="none")
    prompt, messages = "def fibonacci(n):", [{"role": "user", "content": "Sort a list."}]
    for srv in serving(tmp_path / "server.log", "--model", base, "--lora-modules", *modules,
                       "--speculative-algorithm", "none", "--scheduling-policy", "priority",
                       "--allow-runtime-lora-updating", "--max-loras", "4"):
        client = srv.client()
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {MODEL, "a", "b"} and cards["a"].model_extra["parent"] == MODEL
        assert cards["b"].model_extra["root"] == folders["b"]
        outputs = set()
        for name in ("a", "b", None):
            [want] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora=name)
            r = client.completions.create(model=name or MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True, "priority": -2})
            assert r.choices[0].text == want.text
            outputs.add(tuple(want.token_ids))
            [want] = llm.generate([chat_prompt_ids(llm, messages)], greedy(), lora=name)
            r = client.chat.completions.create(model=name or MODEL, messages=messages, max_tokens=TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert r.choices[0].message.content == want.text
        assert len(outputs) == 3  # the adapters change the output
        with client.completions.create(model="b", prompt=prompt, max_tokens=500, stream=True,
                                       extra_body={"ignore_eos": True}) as stream:
            next(iter(stream))  # running now: /metrics names its adapter (vLLM's lora_requests_info)
            text = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'max_lora="4",running_lora_adapters="b",waiting_lora_adapters=""' in text, text
        [want] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora="a")
        r = httpx.post(srv.url + "/generate", json={"text": prompt, "lora_path": "a", "sampling_params": {
            "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}, timeout=60)
        assert r.json()["output_ids"] == want.token_ids
        r = httpx.post(srv.url + "/v1/completions", json={"model": "c", "prompt": "x"}, timeout=30)
        assert r.status_code == 404 and "'a', 'b'" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/generate", json={"text": "x", "lora_path": "c"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        post = lambda path, body: httpx.post(srv.url + path, json=body, timeout=60)  # noqa: E731
        r = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": folders["a"]})
        assert r.status_code == 200 and "added" in r.text
        assert {m.id for m in client.models.list().data} == {MODEL, "a", "b", "c"}
        [want] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora="a")
        assert client.completions.create(model="c", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text == want.text
        for body, param in [({"lora_name": "c", "lora_path": folders["b"]}, "lora_name"),
                            ({"lora_name": "d", "lora_path": str(tmp_path / "nowhere")}, "lora_path"),
                            ({"lora_name": "d", "lora_path": str(tmp_path)}, "lora_path")]:
            r = post("/v1/load_lora_adapter", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        from .test_bench import bench

        result = bench(tmp_path, srv.url, "--lora-modules", "a", "b", "--concurrency", "2", "--requests-per-level",
                       "6", "--max-tokens", "4", "--ignore-eos", "--warmup", "0")
        [level] = result["levels"]
        assert level["completed"] == 6 and {r["model"] for r in level["requests"]} == {"a", "b"}
        assert result["options"]["lora_modules"] == ["a", "b"]
        assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
        assert post("/v1/completions", {"model": "c", "prompt": "x"}).status_code == 404
        assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 404


def test_adapters_load_and_unload_at_run_time(pairs, tmp_path):
    """An adapter loaded at run time gives what it gives loaded at start-up; one loaded again under a name gives
    the new adapter's tokens (the prefix cache keeps each load's KV apart); an adapter in use is not unloaded;
    one that fails to load leaves nothing behind."""
    from specserve.engine.sequence import RequestOptions

    base, adapters = pairs["llama"]
    prompts = mixed_prompts(3, 256, seed=8, lo=40, hi=60)
    static = make_llm(base, **options(adapters))
    want = {name: [o.token_ids for o in static.generate(prompts, greedy(), lora=name)] for name in ("a", "b")}
    llm = make_llm(base, speculative_algorithm="none", enable_lora=True)
    engine = llm.engine
    for name in ("a", "b"):
        engine.load_lora("x", adapters[name][0])
        assert [o.token_ids for o in llm.generate(prompts, greedy(), lora="x")] == want[name]
        seq = engine.add_request(prompts[0], greedy(), options=RequestOptions(lora="x"))
        with pytest.raises(RequestError, match="in use by 1"):
            engine.unload_lora("x")
        engine.abort(seq.request_id)
        engine.unload_lora("x")
    assert engine.blocks.stats.num_hits == 0  # the second load computed its prompts again: no hits of the first's KV
    with pytest.raises(RequestError, match="unknown LoRA adapter 'x'"):
        llm.generate(prompts[:1], greedy(), lora="x")
    dora = make_adapter(str(tmp_path / "dora"), base, ATTN, 4, seed=1, use_dora=True)
    with pytest.raises(LoRAError, match="use_dora"):
        engine.load_lora("d", dora)
    head = make_adapter(str(tmp_path / "late-head"), base, ATTN + ("lm_head",), 4, seed=1)
    with pytest.raises(LoRAError, match="lm_head"):
        engine.load_lora("h", head)
    stacks = [m.lora for m in engine.runner.model.modules() if getattr(m, "lora", None) is not None]
    assert not engine.loras and stacks and not any(s.a.any() or s.bt.any() for s in stacks)
    assert_pool_full(llm)



def test_generate_command_runs_an_adapter(tmp_path, capsys):
    """`specserve generate --lora-modules a=FOLDER --lora a`: the offline engine's text with that adapter."""
    from specserve.assets import make_tiny_checkpoint
    from specserve.cli import main

    base = str(tmp_path / "tiny")
    make_tiny_checkpoint(base)
    folder = make_adapter(str(tmp_path / "a"), base, ATTN + MLP, 8, seed=3)
    prompt = "def fibonacci(n):"
    [want] = make_llm(base, lora_modules=f"a={folder}", speculative_algorithm="none").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora="a")
    capsys.readouterr()
    assert main(["generate", "--model", base, "--lora-modules", f"a={folder}", "--lora", "a", "--prompt", prompt,
                 "--max-tokens", "12", "--ignore-eos", "--speculative-algorithm", "none", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == want.text + "\n"


def test_room_for_adapters_is_reserved_and_its_limits_named(pairs, tmp_path):
    """Adapters load only into room reserved at start-up (vLLM's enable_lora, max_loras, max_lora_rank): beyond it
    a load is refused with the option to change, and the engine keeps serving."""
    base, adapters = pairs["llama"]
    llm = make_llm(base, speculative_algorithm="none")
    with pytest.raises(RequestError, match="enable_lora"):
        llm.engine.load_lora("a", adapters["a"][0])
    llm = make_llm(base, speculative_algorithm="none", enable_lora=True, max_lora_rank=4)
    with pytest.raises(LoRAError, match="rank 8, more than max_lora_rank 4"):
        llm.engine.load_lora("b", adapters["b"][0])  # rank 8
    llm.engine.load_lora("a", adapters["a"][0])  # rank 4 fits
    with pytest.raises(RequestError, match="as many as max_loras"):
        llm.engine.load_lora("a2", adapters["a"][0])
    assert llm.generate([[5, 6, 7]], greedy(), lora="a")[0].token_ids
    with pytest.raises(ConfigError, match="more than max_loras 1"):
        make_llm(base, **options(adapters, max_loras=1))
    big = make_adapter(str(tmp_path / "big"), base, ATTN, 24, seed=4)
    llm = make_llm(base, lora_modules=f"big={big}", speculative_algorithm="none")  # the rank room follows it
    assert llm.engine.config.lora.max_lora_rank == 24 and llm.engine.config.lora.max_loras == 1
