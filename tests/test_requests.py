"""Stop conditions, aborts, bad input, and the async engine."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
import torch

from specserve import ConfigError, RequestError, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.models import UnsupportedModel, WeightError
from specserve.sampling_params import SamplingParamError, StructuredOutputsParams

from .conftest import assert_pool_full, engine_options, hf_greedy, make_llm, mixed_prompts


@pytest.fixture(scope="module")
def llm(hf_models):
    return make_llm(hf_models["qwen3"], max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(llm):
    prompts = mixed_prompts(4, 256, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


def test_stop_token_ids_and_max_tokens(llm, reference):
    prompts, full = reference
    stop_at = [ids[10] for ids in full]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t], ignore_eos=True)
                                  for t in stop_at])
    for out, ids, t in zip(outs, full, stop_at):
        cut = ids.index(t) + 1
        assert out.token_ids == ids[:cut] and out.finish_reason == "stop"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ids[:7] for ids in full]
    assert all(o.finish_reason == "length" for o in outs)
    assert_pool_full(llm)


def test_engine_counts_its_steps_and_their_time(llm):
    """The step counters /metrics exports (engine_steps, engine_step_seconds): time inside the engine's steps,
    at most the wall time around them."""
    import time

    stats = llm.engine.stats
    steps, seconds = stats.num_steps, stats.step_seconds
    start = time.perf_counter()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    wall = time.perf_counter() - start
    assert stats.num_steps - steps >= 5
    assert 0 < stats.step_seconds - seconds <= wall


def test_eos_stops_unless_ignored(hf_models):
    llm = make_llm(hf_models["llama"])
    prompts = mixed_prompts(16, 256, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=200))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "with 16 x 200 sampled tokens over 256 ids, some request should meet eos (id 1)"
    assert all(o.token_ids[-1] == 1 and 1 not in o.token_ids[:-1] for o in stopped)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True))
    assert all(len(o.token_ids) == 200 for o in outs)


def test_stop_strings(tmp_path):
    from specserve.assets import default_model_path

    llm = make_llm(default_model_path())
    base = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 10
    stop = text[5:8]
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert_pool_full(llm)


def test_bad_input_is_refused_before_work(llm, hf_models, tmp_path):
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([[5] * 600])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[5, 9999]])
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]])
    for bad, msg in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                     (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"),
                     (dict(logit_bias={3: 500}), "logit_bias"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
                     (dict(structured_outputs=StructuredOutputsParams(choice=[])), "structured_outputs.choice")]:
        with pytest.raises(SamplingParamError, match=msg) as refused:  # a ValueError that names the field
            SamplingParams(**bad)
        assert refused.value.param == msg
    # one bad prompt among good ones: nothing runs, the pool stays full
    with pytest.raises(RequestError):
        llm.generate([[3, 4, 5], [5] * 600])
    assert_pool_full(llm)
    with pytest.raises(ConfigError, match="unknown option 'max_num_seq'.*max_num_seqs"):
        make_llm(hf_models["llama"], max_num_seq=4)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_llm(str(tmp_path / "nope"))


def _copy(src, dst, edit_config=None, edit_tensors=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        edit_config(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if edit_tensors:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    return str(dst)


def test_bad_checkpoints(hf_models, tmp_path):
    src = hf_models["llama"]
    arch = _copy(src, tmp_path / "arch", edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        make_llm(arch)
    missing = _copy(src, tmp_path / "missing", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match="layers.1.mlp.gate_up_proj"):
        make_llm(missing)
    shaped = _copy(src, tmp_path / "shape", edit_tensors=lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(WeightError, match="model.layers.0.self_attn.o_proj.weight.*expected shape"):
        make_llm(shaped)


def test_async_engine_streams_and_aborts(hf_models):
    engine = AsyncEngine(EngineConfig.from_options(**engine_options(model=hf_models["llama"])))
    prompts = mixed_prompts(3, 256, seed=12)
    want = hf_greedy(hf_models["llama"], prompts, 20)

    async def collect(prompt):
        ids = []
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)):
            ids.extend(out.new_token_ids)
        return ids

    async def abandon(prompt):
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)):
            if len(out.token_ids) >= 3:
                break  # the client goes away: the request is aborted

    async def main():
        results = await asyncio.gather(*(collect(p) for p in prompts), abandon(prompts[0]))
        with pytest.raises(RequestError):
            await collect([5] * 600)
        return results[:3]

    try:
        assert asyncio.run(main()) == want
        for _ in range(100):
            if not engine.engine.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.02))
        blocks = engine.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
        assert engine.healthy
    finally:
        engine.shutdown()


def test_async_engine_builds_its_engine_in_the_thread_that_steps_it(hf_models, tmp_path, monkeypatch):
    """torch's CPU workers belong to the thread that starts them: building in one thread and stepping in another
    leaves two sets, and then all of them sleep between operations."""
    import threading

    from specserve.engine import async_engine

    threads = {}

    class Recording(async_engine.LLMEngine):
        def __init__(self, config):
            threads["built"] = threading.current_thread().name
            super().__init__(config)

        def step(self):
            threads["stepped"] = threading.current_thread().name
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)
    engine = AsyncEngine(EngineConfig.from_options(**engine_options(model=hf_models["llama"])))

    async def one():
        return [out async for out in engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2))]

    try:
        assert asyncio.run(one())[-1].finished
    finally:
        engine.shutdown()
    assert threads == {"built": "specserve-engine", "stepped": "specserve-engine"}
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):  # raised in the engine thread, re-raised here
        AsyncEngine(EngineConfig.from_options(model=str(tmp_path / "empty")))


def test_token_ids_outside_the_vocabulary_in_options_are_refused_before_any_work(tmp_path):
    """logit_bias and stop_token_ids name tokens: one outside the vocabulary is a clear error at
    add_request, not a failure inside a step that other requests share."""
    from .conftest import make_hf_checkpoint, make_llm

    llm = make_llm(make_hf_checkpoint(str(tmp_path / "m"), "llama", vocab=64))
    for params in (SamplingParams(logit_bias={64: 1.0}), SamplingParams(stop_token_ids=[99], min_tokens=2)):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.engine.add_request([1, 2, 3], params)
    assert not llm.engine.has_unfinished()


def test_a_request_add_request_refuses_is_the_callers_error_and_the_engine_serves_on(hf_models):
    """What only add_request checks (here a token id outside the vocabulary) reaches the caller of
    AsyncEngine.generate as its ValueError (a 400 through the server), not as an engine failure, and the next
    request runs."""
    engine = AsyncEngine(EngineConfig.from_options(**engine_options(model=hf_models["llama"])))

    async def run(params):
        return [out async for out in engine.generate([1, 2, 3], params)]

    try:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            asyncio.run(run(SamplingParams(allowed_token_ids=[10**6])))
        assert engine.healthy and asyncio.run(run(SamplingParams(temperature=0, max_tokens=2)))[-1].finished
    finally:
        engine.shutdown()


def test_priority_policy_runs_the_most_urgent_first(hf_models, reference):
    """One request at a time: under the priority policy they finish in order of priority (then arrival), and
    each gives the tokens it gives alone; under fcfs a priority is refused."""
    from specserve.engine.sequence import RequestOptions

    prompts, want = reference
    llm = make_llm(hf_models["qwen3"], scheduling_policy="priority", max_num_seqs=1)
    engine, priorities = llm.engine, [3, 0, 1, 0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, (prompt, priority) in enumerate(zip(prompts, priorities)):
        engine.add_request(prompt, params, f"r{i}", RequestOptions(priority=priority))
    done = []
    while engine.has_unfinished():
        done += [(out.request_id, out.token_ids) for out in engine.step() if out.finished]
    assert [rid for rid, _ in done] == ["r1", "r3", "r2", "r0"]
    assert dict(done) == {f"r{i}": tokens for i, tokens in enumerate(want)}
    assert [o.token_ids for o in llm.generate(prompts, params, priority=priorities)] == want
    with pytest.raises(RequestError, match="needs scheduling_policy 'priority'"):
        make_llm(hf_models["qwen3"]).generate(prompts[:1], params, priority=1)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_more_urgent_arrival_preempts_a_running_request(hf_models, reference, overlap):
    """max_num_seqs 1: a request of priority 0 arriving while one of priority 3 runs takes its place at once (the
    other is preempted and computed again later, vLLM issue 40004); one of equal priority waits. Each gives the
    tokens it gives alone."""
    from specserve.engine.sequence import RequestOptions

    prompts, want = reference
    llm = make_llm(hf_models["qwen3"], scheduling_policy="priority", max_num_seqs=1,
                   disable_overlap_schedule=not overlap)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(prompts[0], params, "low", RequestOptions(priority=3))
    done = []
    for _ in range(6):
        done += [out.request_id for out in engine.step() if out.finished]
    engine.add_request(prompts[1], params, "urgent", RequestOptions(priority=0))
    engine.add_request(prompts[2], params, "same", RequestOptions(priority=3))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done.append(out.request_id)
                tokens[out.request_id] = out.token_ids
    assert done == ["urgent", "low", "same"] and engine.scheduler.num_preemptions == 1
    assert [tokens[r] for r in ("low", "urgent", "same")] == want[:3]
    assert_pool_full(llm)
