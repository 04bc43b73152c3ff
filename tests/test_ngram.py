"""Prompt-lookup speculation (`--speculative-algorithm NGRAM`): the index's worked examples, and whole requests
through the engine, whose tokens equal plain decoding's (greedy, seeded, with penalties, chunked prefill and
preemption), with drafts accepted where the output repeats its context."""
from __future__ import annotations

import random

import pytest

from specserve import SamplingParams
from specserve.config import ConfigError, EngineConfig
from specserve.engine.sequence import Sequence
from specserve.speculative.ngram import NgramProposer, PromptLookup
from specserve.speculative.shapes import Shape

from .conftest import assert_pool_full, make_hf_checkpoint, make_llm, mixed_prompts, skip_without_ranks

VOCAB = 48


# ---- the index ------------------------------------------------------------------------------------
def test_the_longest_suffix_found_gives_what_followed_it():
    # suffix 5 6 7 occurs at 0-2: what followed it there
    assert PromptLookup(2, 3).continuation([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    # a loop of period 3: its continuation wraps around instead of running out
    assert PromptLookup(1, 3).continuation([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    # the longest window wins over a later, shorter match: (4, 5) at 1-2 is followed by 6, (5) alone last by 9
    assert PromptLookup(1, 2).continuation([3, 4, 5, 6, 5, 9, 4, 5], 1) == [6]
    assert PromptLookup(1, 1).continuation([3, 4, 5, 6, 5, 9, 4, 5], 1) == [9]  # the latest occurrence
    assert PromptLookup(2, 3).continuation([1, 2, 3, 4], 3) is None  # nothing repeats
    assert PromptLookup(2, 3).continuation([7], 2) is None


def test_the_lookup_grows_with_the_tokens_and_agrees_with_a_scan():
    lookup, tokens = PromptLookup(2, 2), [1, 2, 3]
    assert lookup.continuation(tokens, 2) is None
    tokens += [1, 2]
    assert lookup.continuation(tokens, 2) == [3, 1]
    rng = random.Random(7)
    for _ in range(300):  # against the definition, by brute force
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 600 if rng.random() < 0.1 else 40))]
        assert PromptLookup(low, high).continuation(tokens, 3) == scan(tokens, low, high, 3)


def scan(tokens: list[int], low: int, high: int, k: int):
    """The latest earlier occurrence of the longest suffix (low to high tokens), its continuation wrapped."""
    for n in range(high, low - 1, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if n < len(tokens) and tokens[end - n:end] == tokens[-n:]:
                return [tokens[end + i % (len(tokens) - end)] for i in range(k)]
    return None


def test_the_proposer_drafts_chains_of_the_shape():
    proposer = NgramProposer(2, 4)
    seqs = [Sequence(str(i), ids, SamplingParams(), {1}, 100, None)
            for i, ids in enumerate([[9, 4, 5, 6, 7, 4, 5], [9, 8, 7]])]
    trees = proposer.propose(seqs, Shape(3, 1, 4))
    assert [t.tokens for t in trees] == [[5, 6, 7, 4], [7, 7, 7, 7]]  # no match: the last token again
    assert all(t.parents == [-1, 0, 1, 2] for t in trees) and proposer.num_slots(Shape(3, 1, 4)) == 4


def test_options_are_checked():
    for bad, words in ((dict(speculative_eagle_topk=2), "drafts chains"),
                       (dict(speculative_draft_model_path="/x"), "needs no speculative_draft_model_path"),
                       (dict(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2),
                        "1 <= min")):
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_options(speculative_algorithm="NGRAM", **bad)


# ---- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("ngram") / "target"), "llama", seed=3, vocab=VOCAB)


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths, half of them a pattern repeated (where lookups find something)."""
    mixed = mixed_prompts(6, VOCAB, seed=31, lo=3, hi=40)
    return mixed[:3] + [(p[:5] * 8)[:30] for p in mixed[3:]]


PARAMS = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=6, max_tokens=40, ignore_eos=True, repetition_penalty=1.2)]


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16),
                                     dict(num_kv_blocks=20, block_size=8, max_model_len=128),
                                     dict(tensor_parallel_size=2)],
                         ids=["plain-batching", "chunked-prefill", "preemption", "two-ranks"])
def test_tokens_equal_plain_decoding(target, prompts, options):
    skip_without_ranks(options)
    batch = [(p, params) for p in prompts for params in PARAMS]
    want = [o.token_ids for o in make_llm(target, disable_overlap_schedule=True).generate(
        [p for p, _ in batch], [s for _, s in batch])]
    llm = make_llm(target, speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_policy="always",
                   **options)
    try:
        assert [o.token_ids for o in llm.generate([p for p, _ in batch], [s for _, s in batch])] == want
        spec = llm.engine.stats.spec
        assert spec.num_accepted_tokens > 10 and spec.accepted_per_position[1] > 0  # where the output repeats
        if "num_kv_blocks" in options:
            assert llm.engine.stats.num_preemptions > 0
        assert_pool_full(llm)
    finally:
        llm.engine.close()
