"""Greedy speculative steps in the overlap pipeline (speculative/eagle3_loop.py): the host reads each step's
verdicts one step late. Output equals plain decoding and every verdict equals the synchronous path's
(the drafts depend on every pair the loop caught up on and every block feature it kept), through stops
inside accepted runs, requests that arrive, finish and are aborted mid-run, and prefix-cache hits."""
from __future__ import annotations

import pytest

from specserve import SamplingParams

from .conftest import DEVICE, assert_pool_full, make_llm, mixed_prompts
from .eagle_utils import make_pair

pytestmark = pytest.mark.skipif(DEVICE["name"] != "cuda", reason="the speculative loop runs in CUDA graphs")

VOCAB = 64
NEW = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("loop"), VOCAB)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(12, VOCAB, seed=7, lo=2, hi=40)


@pytest.fixture(scope="module")
def plain(pair, prompts):
    outs = make_llm(pair[0]).generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    return [o.token_ids for o in outs]


SHAPES = {"chain": dict(speculative_num_steps=3),
          "tree": dict(speculative_num_steps=4, speculative_eagle_topk=3, speculative_num_draft_tokens=8)}


def speculative(pair, loop: bool, shape: str = "chain", **options):
    """An engine speculating every step (a chain of 3 or a tree of 8); recording each step's accepted
    drafts per request, and how many of them its tree's spine shares."""
    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_policy="always", **SHAPES[shape], **options)
    spec, seen = llm.engine.spec, []
    if not loop:
        spec.loop = None
    record = spec.record_accepted


    def recording(shape, accepted, spines, looped=False):  # per request: drafts accepted, (of its spine, its length)
        seen.append([(a, tuple(s)) for a, s in zip(accepted, spines)])
        record(shape, accepted, spines, looped=looped)

    spec.record_accepted = recording
    return llm, seen


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix_cache", "prefix_cache"])
def test_loop_verdicts_equal_the_synchronous_steps(pair, prompts, plain, prefix, shape):
    """Two passes (the second starts on the first's cached blocks when the prefix cache is on), then
    stops at many points inside accepted runs: the same verdicts, step by step, with and without the loop."""
    stops = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
             for m in (1, 2, 3, 5, 7, 8, 11, 13, 17, 23, 29, 40)]
    seen = {}
    for loop in (True, False):
        llm, seen[loop] = speculative(pair, loop, shape, enable_prefix_caching=prefix, block_size=8)
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
            assert [o.token_ids for o in outs] == plain
        outs = llm.generate(prompts, stops)
        assert [o.token_ids for o in outs] == [w[:p.max_tokens] for w, p in zip(plain, stops)]
        stop_at = [w[9] for w in plain]
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[t],
                                                     ignore_eos=True) for t in stop_at])
        assert [o.token_ids for o in outs] == [w[:w.index(t) + 1] for w, t in zip(plain, stop_at)]
        assert_pool_full(llm)
        if loop:
            assert llm.engine.spec.loop.launches > 20
            if prefix:
                assert llm.engine.stats.prefix_cache.num_hits > 0
    assert sum(a for step in seen[True] for a, _ in step) > 0, "the random draft should hit sometimes: untested"
    assert seen[True] == seen[False]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_requests_arrive_finish_and_abort_mid_run(pair, prompts, plain, shape):
    """Requests join while others speculate, finish at different steps, and one is aborted mid-run: every
    other request's text is plain decoding's, and the engine ends with every KV block free."""
    llm, _ = speculative(pair, True, shape, max_num_seqs=6)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    done, ids = {}, {}
    step = 0
    queue = list(enumerate(prompts))
    while queue or engine.has_unfinished():
        if queue and step % 7 == 0:
            for i, p in queue[:3]:
                ids[engine.add_request(p, params).request_id] = i
            queue = queue[3:]
        if step == 12:
            engine.abort(next(iter(engine.requests)))
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = (out.token_ids, out.finish_reason)
        step += 1
    aborted = [i for i, (_, reason) in done.items() if reason == "abort"]
    assert len(aborted) <= 1
    assert all(tokens == plain[i] for i, (tokens, reason) in done.items() if reason != "abort")
    assert len(done) >= len(prompts) - 1
    assert engine.spec.loop.launches > 10
    assert_pool_full(llm)


def test_shape_switches_inside_a_run(pair, prompts, plain):
    """The controller's shape changes every few steps (chains of 1-4 and the tree; plain now and then, which
    ends a run): runs go on across the switches without draining, and every verdict equals the
    synchronous path's."""
    from specserve.speculative.shapes import PLAIN

    seen = {}
    for loop in (True, False):
        llm, seen[loop] = speculative(pair, loop, "tree")
        spec, steps = llm.engine.spec, [0]
        cycle = [s for s in spec.shapes if s.steps] * 2 + [PLAIN]

        def choose(batch_size, prefill=None, running=None, *, steps=steps, cycle=cycle):
            steps[0] += 1
            return cycle[steps[0] // 3 % len(cycle)]

        spec.choose = choose
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == plain
        assert_pool_full(llm)
        if loop:
            assert spec.loop.launches > 20
    assert seen[True] == seen[False]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sampling_rows_run_in_the_loop(pair, prompts, plain, shape):
    """Chains and trees whose rows sample (by temperature; by top-k and top-p beside it; seeded) run in the
    loop's graphs: their greedy rows still emit plain decoding's text, every row emits what it asked for, a
    seeded row exactly what plain decoding samples for it, and KV ends free."""
    from .test_speculative_sampling import looped_modes

    llm, _ = speculative(pair, True, shape)
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    cases = [("sampled", dict(temperature=0.8)), ("filtered", dict(temperature=0.8, top_p=0.9, top_k=20)),
             ("filtered", dict(temperature=0.8, seed=5)), ("filtered", dict(temperature=1.0, top_k=9, seed=7))]
    for mode, sampled in cases:
        modes = looped_modes(llm)
        seed = sampled.get("seed")  # seeded cases: request i has seed + i
        params = [greedy if i % 2 else SamplingParams(max_tokens=NEW, ignore_eos=True, **{**sampled, "seed": (
            None if seed is None else seed + i)}) for i in range(len(prompts))]
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        assert outs[1::2] == plain[1::2]
        assert all(len(o) == NEW for o in outs)
        if seed is not None:
            assert outs == [o.token_ids for o in make_llm(pair[0]).generate(prompts, params)]
        # the greedy rows that outlive the sampling ones run on in greedy runs
        assert mode in modes and modes <= {mode, "greedy"}, modes
        del llm.engine.spec.loop._launch  # looped_modes' recorder: the class's method again
        assert_pool_full(llm)
