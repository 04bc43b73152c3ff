"""Speculative decoding is lossless: speculative output equals plain output token for token."""
from __future__ import annotations

import pytest

from specserve import SamplingParams

from .conftest import assert_pool_full, make_hf_checkpoint, make_llm, mixed_prompts
from .eagle_utils import make_eagle3_checkpoint

VOCAB = 64
NEW = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_hf_checkpoint(str(root / "target"), "llama", seed=3, vocab=VOCAB, layers=4)
    draft = make_eagle3_checkpoint(str(root / "draft"), target, seed=1)
    return target, draft


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


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("spec", CONFIGS, ids=lambda c: f"s{c['speculative_num_steps']}k{c['speculative_eagle_topk']}")
def test_greedy_lossless(pair, plain_outputs, spec, engine):
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, **spec, **ENGINES[engine])
    for batch in (prompts[:1], prompts):
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == want[:len(batch)]
    stats = llm.engine.stats.spec
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0, "the random draft should hit sometimes: acceptance paths untested"
    if engine == "chunked_preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_full(llm)


def test_stops_inside_accepted_run(pair, plain_outputs):
    target, draft = pair
    prompts, want = plain_outputs
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    for max_tokens in (1, 2, 3, 7, 13):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        assert [o.token_ids for o in outs] == [w[:max_tokens] for w in want]
    stop_at = [w[9] for w in want]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[t], ignore_eos=True)
                                  for t in stop_at])
    assert [o.token_ids for o in outs] == [w[:w.index(t) + 1] for w, t in zip(want, stop_at)]
    assert_pool_full(llm)


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
