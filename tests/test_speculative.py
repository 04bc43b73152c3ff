"""Speculative decoding is lossless: speculative output equals plain output token for token."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams

from .conftest import DEVICE, assert_pool_full, make_hf_checkpoint, make_llm, mixed_prompts
from .eagle_utils import make_eagle3_checkpoint, make_pair

VOCAB = 64
NEW = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec"), VOCAB)


@pytest.fixture(scope="module")
def plain_outputs(pair):
    target, _ = pair
    prompts = mixed_prompts(16, VOCAB, seed=5, lo=2, hi=40)
    llm = make_llm(target)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


CONFIGS = [dict(speculative_num_steps=s, speculative_eagle_topk=1) for s in range(1, 6)] + [
    dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    dict(speculative_num_steps=4, speculative_eagle_topk=3, speculative_num_draft_tokens=8),
    dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
]
ENGINES = {
    "default": {},
    "chunked_preempt": dict(max_num_batched_tokens=24, num_kv_blocks=20, block_size=8, max_model_len=128),
}
if DEVICE["name"] == "cuda":  # on CUDA the default engine replays graphs; check the eager path too
    ENGINES["eager"] = dict(enforce_eager=True)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("spec", CONFIGS, ids=lambda c: f"s{c['speculative_num_steps']}k{c['speculative_eagle_topk']}")
def test_greedy_lossless(pair, plain_outputs, spec, engine):
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_policy="always",
                   **spec, **ENGINES[engine])
    for batch in (prompts[:1], prompts):
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == want[:len(batch)]
    stats = llm.engine.stats.spec
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0, "the random draft should hit sometimes: acceptance paths untested"
    if engine == "chunked_preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    learned = llm.engine.spec.controller.acceptance
    if spec["speculative_eagle_topk"] > 1:  # every tree verify taught the chain's positions and the tree's gain
        assert len(learned.tree_gain) == min(learned.window, stats.num_drafts)
        assert len(learned.positions[0]) == min(learned.window, stats.num_drafts)
    if DEVICE["name"] == "cuda" and engine == "default":
        assert llm.engine.spec.loop.launches > 0, "greedy speculative steps should run in the overlap pipeline"
    assert_pool_full(llm)


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="draft CUDA graphs need CUDA")
@pytest.mark.parametrize("spec", [CONFIGS[2], CONFIGS[-1]], ids=["chain", "tree"])
def test_draft_graphs_propose_what_eager_drafting_proposes(pair, plain_outputs, spec):
    """Replayed drafting (padded catch-up, metadata built on the device) proposes the eager trees."""
    target, draft = pair
    prompts, _ = plain_outputs
    trees = {}
    for engine in ("default", "eager"):
        llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                       speculative_policy="always", **spec, **ENGINES[engine])
        proposer, seen = llm.engine.spec.proposer, []
        llm.engine.spec.loop = None  # every step drafts through propose (tests/test_spec_loop.py: the loop)
        propose = proposer.propose
        proposer.propose = lambda seqs, shape: _record_trees(seen, seqs, propose(seqs, shape))
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        trees[engine] = seen
        if engine == "default":
            assert proposer.graphs is not None and proposer.graphs.replays > 0
    assert trees["default"] == trees["eager"]


def _record_trees(seen, seqs, trees):
    seen.append(sorted((s.request_id, len(s.token_ids), t.batch[t.row].tolist() if t.tokens is None else t.tokens,
                        t.parents) for s, t in zip(seqs, trees)))
    return trees


def test_a_chain_grown_as_a_tree_of_top_one_is_grow_chain(pair):
    """Drafting grows a chain by `grow_chain` (an argmax a depth) where the draft graphs grew it by `grow` at
    top-1 (a log-softmax and a top-k a depth, scores and parents): the same tokens."""
    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=3, speculative_policy="always")
    proposer = llm.engine.spec.proposer
    shape = next(s for s in llm.engine.spec.shapes if s.steps == 3 and s.topk == 1)
    g = torch.Generator().manual_seed(0)
    c = proposer.draft.config
    hidden, vocab = c.hidden_size, c.draft_vocab_size
    dev = proposer.device
    w, e, f = (torch.randn(*size, generator=g).to(dev) for size in ((hidden, vocab), (VOCAB, vocab), (VOCAB, hidden)))

    def expand(depth, tokens, h, ancestors):  # [B, K] target ids, [B, K, H] -> [B * K, vocab], [B * K, H]
        h = h.reshape(-1, hidden)
        return h @ w + e[tokens.reshape(-1)], torch.tanh(h + f[tokens.reshape(-1)])

    logits, h = torch.randn(5, vocab, generator=g).to(dev), torch.randn(5, hidden, generator=g).to(dev)
    chain = proposer.grow_chain(logits, h, 3, expand)  # [5, 3]
    assert chain.shape == (5, 3)
    assert torch.equal(proposer.grow(logits, h, shape, expand)[0], chain)


def test_stops_inside_accepted_run(pair, plain_outputs):
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                   speculative_policy="always")
    for max_tokens in (1, 2, 3, 7, 13):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert [o.token_ids for o in outs] == [w[:max_tokens] for w in want]
    stop_at = [w[9] for w in want]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[t], ignore_eos=True)
                                  for t in stop_at])
    assert [o.token_ids for o in outs] == [w[:w.index(t) + 1] for w, t in zip(want, stop_at)]
    assert_pool_full(llm)


def test_a_cpu_draft_runs_on_int8_weights_unless_told_not_to(pair, plain_outputs):
    """On a CPU the draft's products read int8 weights by default (`speculative_draft_model_quantization`
    auto); "none" keeps them in the model's dtype. Both are lossless, and the int8 draft still hits. The option
    is refused on CUDA, which has no such kernel."""
    import torch

    from specserve.config import ConfigError, SpeculativeConfig

    target, draft = pair
    prompts, want = plain_outputs
    on_cpu = DEVICE["name"] == "cpu"
    for option, dtype in (("auto", torch.int8 if on_cpu else None), ("none", None)):
        llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                       speculative_policy="always", speculative_draft_model_quantization=option)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
        assert llm.engine.stats.spec.num_accepted_tokens > 0
        weights = {m.weight.dtype for m in llm.engine.spec.proposer.draft.modules() if hasattr(m, "weight_scale")}
        assert weights == {dtype or llm.engine.runner.dtype}
    assert SpeculativeConfig().resolved("cpu").speculative_draft_model_quantization == "int8"
    assert SpeculativeConfig().resolved("cuda").speculative_draft_model_quantization == "none"
    with pytest.raises(ConfigError, match="int8' runs on a CPU only"):
        SpeculativeConfig(speculative_draft_model_quantization="int8").resolved("cuda")


def test_bad_drafts_are_refused(pair, tmp_path):
    import json
    import os

    target, draft = pair
    other = make_hf_checkpoint(str(tmp_path / "big"), "llama", seed=3, vocab=96, layers=4)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(other, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                 speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=6)
    cfg = json.load(open(os.path.join(draft, "config.json")))
    cfg["architectures"] = ["MedusaModel"]
    os.makedirs(tmp_path / "medusa")
    json.dump(cfg, open(tmp_path / "medusa" / "config.json", "w"))
    with pytest.raises(ValueError, match="unknown draft architecture"):
        make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "medusa"))


def test_loader_reads_published_format(pair, tmp_path):
    import torch

    from specserve.models import ArchConfig, read_config
    from specserve.speculative.eagle3 import load_eagle3

    target, _ = pair
    arch = ArchConfig.from_dict(read_config(target))
    for fmt in ("safetensors", "bin"):
        path = make_eagle3_checkpoint(str(tmp_path / fmt), target, seed=2, draft_vocab=32, fmt=fmt)
        draft = load_eagle3(path, arch, torch.nn.Embedding(arch.vocab_size, arch.hidden_size), torch.float32,
                            torch.device("cpu"))
        sd = torch.load(path + "/pytorch_model.bin", weights_only=True) if fmt == "bin" else None
        if sd is not None:  # fused q/k/v rows are the published q, k, v in order
            assert torch.equal(draft.midlayer.self_attn.qkv_proj.weight[:64], sd["midlayer.self_attn.q_proj.weight"])
            assert torch.equal(draft.lm_head.weight, sd["lm_head.weight"])
        assert draft.to_target_ids(torch.tensor([0, 1, 31])).tolist() == [0, 2, 62]  # d2t offsets
        assert draft.fc.weight.shape == (64, 192)
    # a mis-shaped tensor is refused with its name
    from safetensors.torch import load_file, save_file

    bad = make_eagle3_checkpoint(str(tmp_path / "bad"), target, seed=2)
    tensors = load_file(bad + "/model.safetensors")
    tensors["midlayer.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # k_proj takes 2H = 128 inputs
    save_file(tensors, bad + "/model.safetensors")
    with pytest.raises(ValueError, match="midlayer.self_attn.k_proj.weight"):
        load_eagle3(bad, arch, torch.nn.Embedding(arch.vocab_size, arch.hidden_size), torch.float32,
                    torch.device("cpu"))
    # and speculation with a draft vocabulary smaller than the target's stays lossless
    small = str(tmp_path / "safetensors")
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=small)
    plain = make_llm(target).generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    spec = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert spec[0].token_ids == plain[0].token_ids


@pytest.mark.parametrize("policy", ["adaptive", "threshold"])
def test_policies_switch_k_mid_request_losslessly(pair, plain_outputs, policy):
    """The controller changes the shape between steps (forced here: adaptive explores every shape, and
    the threshold flips as requests finish); outputs stay identical to plain decoding."""
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_num_steps=3,
                   speculative_policy=policy, speculative_disable_batch_threshold=4)
    controller = llm.engine.spec.controller
    controller.probe_every, controller.exploration_budget = 3, 1.0  # switch often: probes cost nothing
    seen = set()
    original = controller.choose
    controller.choose = lambda b, prefill=None: _record(seen, original(b, prefill))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert len({s.k for s in seen}) >= 2, "the test must see k change"
    assert_pool_full(llm)


def _record(seen, shape):
    seen.add(shape)
    return shape


def test_start_up_calibration_prices_every_shape_and_leaves_the_engine_as_new(pair, plain_outputs):
    """The adaptive controller's step costs are measured before the first request, for every shape at
    batch sizes 1, 2, 4, ... up to max_num_seqs; the dummy requests leave no trace (counters, KV blocks,
    request table) and the output stays that of plain decoding."""
    from specserve.speculative.shapes import bucket

    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=3, max_num_seqs=8, speculative_calibration_s=120)
    spec, engine = llm.engine.spec, llm.engine
    times = spec.calibration.times
    assert sorted({n for n, _ in times}) == [1, 2, 4, 8]
    assert {s for _, s in times} == set(spec.shapes)
    assert all(len(ts) == 6 and min(ts) > 0 for ts in times.values())  # 2 rounds x 3 timed steps
    chain = max(spec.shapes, key=lambda s: s.steps)
    assert list(spec.calibration.token_steps) == [4]  # the host time per emitted token, at batch 4:
    none, every = spec.calibration.token_steps[4]  # the longest chain accepting nothing, then all
    assert none[1] == [4] * 6 and every[1] == [4 * (chain.steps + 1)] * 6
    assert spec.calibration.token_seconds >= 0 and spec.controller.token_seconds == spec.calibration.token_seconds
    assert all(spec.controller._priced(bucket(n), s) for n, s in times)
    extra = spec.calibration.prompt_extra  # a draft's step with a prompt over plain's, below max_num_seqs (8)
    drafts = [s for s in spec.shapes if s.steps]
    assert set(extra) == {(n, s) for n in (1, 2, 4) for s in drafts} and all(len(v) == 3 for v in extra.values())
    assert all(spec.controller.prompt_extra(s, n) is not None for n, s in extra)
    assert spec.controller.prompt_extra(drafts[0], 9) is None  # beyond twice the largest size measured
    explained = spec.controller.explain()["calibration"]
    assert explained["seconds"] > 0 and set(explained["step_ms"]) == {1, 2, 4, 8}
    assert set(explained["prompt_extra_ms"]) == {1, 2, 4}
    assert engine.stats.num_steps == engine.stats.num_prompt_tokens == engine.stats.spec.num_drafts == 0
    assert not engine.requests
    assert_pool_full(llm)
    prompts, want = plain_outputs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert_pool_full(llm)
    off = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_calibration_s=0)
    assert off.engine.spec.calibration is None


def test_calibration_sizes_an_arriving_prompt_to_the_largest_mixed_graph():
    """The step with an arriving prompt that start-up prices is the kind most arrivals take: within the largest
    mixed CUDA graph where the runner has them (past it a step runs eagerly), else the step's token budget."""
    from types import SimpleNamespace

    from specserve.speculative.calibration import _arrival_tokens

    def engine(graphs, budget=2048):
        return SimpleNamespace(config=SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=budget)),
                               runner=SimpleNamespace(graphs=graphs))

    assert _arrival_tokens(engine(SimpleNamespace(mixed_tokens=(32, 64, 512)))) == 512
    assert _arrival_tokens(engine(SimpleNamespace(mixed_tokens=(32, 64, 512)), budget=256)) == 256
    assert _arrival_tokens(engine(SimpleNamespace(mixed_tokens=()))) == 2048  # mixed graphs off
    assert _arrival_tokens(engine(None)) == 2048  # no graphs (CPU, enforce_eager)


def test_a_calibration_budget_too_short_for_one_size_times_one_round(pair):
    """Steps slow enough (a slow link, a busy host) that the first batch size alone outlasts the budget:
    that size gets one round of every shape instead of two, and no other size is timed."""
    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=3, max_num_seqs=8, speculative_calibration_s=0.01)
    c = llm.engine.spec.calibration
    assert {n for n, _ in c.times} == {1}
    assert all(len(times) == 3 for times in c.times.values()), c.times  # `timed` steps, one round
    assert not llm.engine.requests
    assert_pool_full(llm)


def test_calibration_keeps_every_batch_full_when_requests_reach_max_model_len(pair):
    """With a short max_model_len the dummy requests outgrow it within a batch size's measurement; they
    are replaced before each shape's steps, so a step timed at batch size n ran n requests (a plain step
    emits n tokens), and the pool is whole afterwards."""
    from specserve.speculative.shapes import PLAIN

    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=3, max_num_seqs=8, max_model_len=128, speculative_calibration_s=120)
    c = llm.engine.spec.calibration
    sizes = sorted(n for n, s in c.times if s == PLAIN)
    assert sizes[:3] == [1, 2, 4] and len(sizes) == 4  # the last: as many as the KV pool holds
    assert all(c.tokens[(n, PLAIN)] == [n] * 6 for n in sizes), {n: c.tokens[(n, PLAIN)] for n in sizes}
    assert not llm.engine.requests
    assert_pool_full(llm)


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="plain-decode CUDA graphs need CUDA")
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_draft_follows_plain_decode_graphs_as_eager_observing_does(pair, plain_outputs, prefix):
    """Plain-decode graphs store the draft's pairs on the device (eagle3_follow.py); eager steps keep the
    target's features and catch the draft up when it drafts. Alternating plain phases of several lengths
    with chain steps, both must propose the same trees (they depend on every stored pair) and decode
    what plain decoding does; a second pass starts on blocks the first one cached."""
    from specserve.speculative.shapes import PLAIN

    target, draft = pair
    prompts, want = plain_outputs
    trees = {}
    for engine in ("default", "eager"):
        llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                       speculative_num_steps=3, speculative_policy="always", enable_prefix_caching=prefix,
                       **ENGINES[engine])
        spec, seen, steps = llm.engine.spec, [], [0]
        spec.loop = None  # every chain step drafts through propose
        chain = next(s for s in spec.shapes if s.steps == 3)

        def choose(batch_size, prefill=None, running=None, *, steps=steps, chain=chain):
            steps[0] += 1
            return chain if steps[0] % 11 in (0, 4, 5) else PLAIN  # plain runs of 1, 3 and 5 steps

        spec.choose = choose
        propose = spec.proposer.propose
        spec.proposer.propose = lambda seqs, shape, seen=seen, propose=propose: _record_trees(
            seen, seqs, propose(seqs, shape))
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
            assert [o.token_ids for o in outs] == want
        trees[engine] = seen
        assert_pool_full(llm)
        if engine == "default":
            assert llm.engine.runner.graphs.follow is not None
    assert len(trees["default"]) > 10
    assert trees["default"] == trees["eager"]


@pytest.mark.skipif(DEVICE["name"] != "cuda", reason="mixed CUDA graphs need CUDA")
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_mixed_graphs_store_the_draft_pairs_eager_steps_store(pair, plain_outputs, prefix):
    """Four slots for 16 requests of staggered lengths: prompts are admitted beside chains being verified, in
    mixed graphs that verify the chains and store the draft pairs within the prompt chunks (the pairs before
    them, after a cached prefix, eagerly). Both engines must propose the same trees (they depend on every
    stored pair) and decode what plain decoding does."""
    target, draft = pair
    prompts, want = plain_outputs
    params = [SamplingParams(temperature=0, max_tokens=NEW - 5 * (i % 7), ignore_eos=True)
              for i in range(len(prompts))]
    trees = {}
    for engine in ("default", "eager"):
        llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                       speculative_num_steps=3, speculative_policy="always", enable_prefix_caching=prefix,
                       max_num_seqs=4, **ENGINES[engine])
        spec, seen = llm.engine.spec, []
        spec.loop = None  # every chain step drafts through propose
        propose = spec.proposer.propose
        spec.proposer.propose = lambda seqs, shape, seen=seen, propose=propose: _record_trees(
            seen, seqs, propose(seqs, shape))
        for _ in range(2):
            outs = llm.generate(prompts, params)
            assert [o.token_ids for o in outs] == [w[:p.max_tokens] for w, p in zip(want, params)]
        trees[engine] = seen
        assert_pool_full(llm)
        if engine == "default":
            assert llm.engine.runner.graphs.mixed_replays > 10
    assert trees["default"] == trees["eager"]


def test_adaptive_decodes_plain_in_steps_that_compute_prompt_tokens(pair, plain_outputs):
    """Requests of different lengths through two slots: later prompts are admitted while others decode.
    Every step that computes prompt tokens is chosen with prefill=True and decodes plain (k = 0: also one
    whose drained predecessor freed the slot a prompt then takes, chosen again); the
    decode-only steps between them are the controller's to decide; the text is plain decoding's."""
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_num_steps=3,
                   speculative_policy="adaptive", speculative_calibration_s=0, max_num_seqs=2)
    engine, flags = llm.engine, []
    choose = engine.spec.controller.choose
    engine.spec.controller.choose = lambda b, prefill=None: flags.append(prefill()) or choose(b, prefill)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    prefills = decodes = 0
    while engine.has_unfinished():
        before, chosen = engine.stats.num_prompt_tokens, len(flags)
        engine.step()
        if engine.stats.num_prompt_tokens > before:  # the step's last choice is the one it ran
            prefills += 1
            assert flags[-1] and engine.stats.spec.last_k == 0
        elif len(flags) > chosen:
            decodes += not flags[-1]
    assert prefills >= 2 and decodes > 0
    assert [s.output_token_ids for s in seqs] == want


def test_batches_off_the_loop_are_priced_by_their_own_controller(pair, plain_outputs):
    """Where there is a speculative loop (CUDA graphs), steps of a batch that cannot run in it (here a request
    that wants logprobs) take the step path at prices start-up did not measure: `off_loop` chooses and learns
    them, while the loop's batches stay with the calibrated controller. Here the off-loop controller is made as
    `capture_graphs` makes it beside a loop, on an engine whose steps all run eagerly."""
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_num_steps=3,
                   speculative_policy="adaptive")
    spec = llm.engine.spec
    assert spec.off_loop is None or DEVICE["name"] == "cuda"
    spec.off_loop = spec._controller()
    chose = {"loop": 0, "off": 0}
    for name, controller in (("loop", spec.controller), ("off", spec.off_loop)):
        original = controller.choose
        controller.choose = lambda b, prefill=None, original=original, name=name: (
            chose.__setitem__(name, chose[name] + 1), original(b, prefill))[1]
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    assert chose["loop"] > 0 and chose["off"] == 0
    logprobs = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, [logprobs] + [greedy] * (len(prompts) - 1))
    assert [o.token_ids for o in outs] == want
    assert chose["off"] > 0
    assert spec.off_loop.records > 0  # its steps were timed into it
    assert_pool_full(llm)


def test_the_loop_mode_is_judged_once_per_set_of_running_sequences(pair, monkeypatch):
    """`SpecDecoder.loop_mode`: a step asks it up to three times (the controller's choice, whether a run fits, its
    start) and `run_mode` reads every row, so it judges a set of sequences once; a sequence replaced by another
    (here one that wants logprobs, which cannot loop) is judged anew, and so is the old set when it returns."""
    from specserve.engine.sequence import Sequence
    from specserve.speculative import decoder
    from specserve.speculative.eagle3_loop import GREEDY, SAMPLED, run_mode

    target, draft = pair
    spec = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft).engine.spec
    judged = []
    monkeypatch.setattr(decoder, "run_mode", lambda seqs: judged.append(len(seqs)) or run_mode(seqs))

    def seq(**params):
        return Sequence("r", [1, 2], SamplingParams(**params), set(), 64, None)

    a, b, c = seq(temperature=0), seq(temperature=0.8), seq(temperature=0, logprobs=1)
    running = [a, b]
    assert [spec.loop_mode(running) for _ in range(3)] == [SAMPLED] * 3 and judged == [2]
    running[1] = c  # the scheduler's list changes in place
    assert spec.loop_mode(running) is None and spec.loop_mode([a, b]) == SAMPLED and spec.loop_mode([a]) == GREEDY
    assert judged == [2, 2, 2, 1]
