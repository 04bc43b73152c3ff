"""Prompt-lookup speculation (`--speculative-algorithm NGRAM`): the index's worked examples, and whole requests
through the engine, whose tokens equal plain decoding's (greedy, seeded, with penalties, chunked prefill and
preemption), with drafts accepted where the output repeats its context."""
from __future__ import annotations

import random

import pytest

from specserve import SamplingParams
from specserve.config import ConfigError, EngineConfig
from specserve.engine.sequence import Sequence
from specserve.speculative.ngram import NgramProposer, PromptLookup, lookup_tree
from specserve.speculative.ngram_history import History
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


def test_continuations_rank_the_longest_then_the_latest():
    tokens = [7, 1, 2, 3, 9, 2, 3, 4, 5, 3, 8, 1, 2, 3]
    # suffix (1, 2, 3) at 1-3 matches 3 tokens, (2, 3) at 5-6 two, (3) at 9 one
    assert PromptLookup(1, 3).continuations(tokens, 2, limit=5) == [(3, [9, 2]), (2, [4, 5]), (1, [8, 1])]
    assert PromptLookup(2, 3).continuations(tokens, 2, limit=5) == [(3, [9, 2]), (2, [4, 5])]
    assert PromptLookup(1, 3).continuations(tokens, 2, limit=1) == [(3, [9, 2])]
    # two occurrences of (3) alone: the latest first
    assert PromptLookup(1, 1).continuations([3, 5, 3, 6, 3], 1, limit=5) == [(1, [6]), (1, [5])]
    assert PromptLookup(1, 3).continuations([1, 2], 2, limit=5) == []


def test_a_lookup_tree_merges_the_continuations_best_first():
    found = [[4, 5, 6], [4, 5, 9], [8, 1, 2], [4, 7, 7], [4, 7, 8]]
    tree = lookup_tree(3, found, Shape(3, 2, 7), recent=[3])
    # a node ranks as the best continuation through it: 4 5 6 (0), 9 (1), 8 1 (2) are kept before 7 under 4 (3);
    # at most two children each, in level order, the better child first
    assert tree.tokens == [3, 4, 8, 5, 1, 6, 9]
    assert tree.parents == [-1, 0, 0, 1, 2, 3, 3]
    assert tree.spine([0]) == (0, 3)  # the spine is the best continuation, 4 5 6
    assert [tree.tokens[i] for i in (0, 1, 3, 5)] == [3, 4, 5, 6]
    # topk bounds the children of a node: with one child each, the tree is the best continuation's chain
    assert lookup_tree(3, found, Shape(3, 1, 4), recent=[]).tokens == [3, 4, 5, 6]


def test_a_lookup_tree_is_filled_to_its_shape_with_distinct_guesses():
    tree = lookup_tree(3, [[4, 5]], Shape(2, 2, 6), recent=[4, 9, 9, 3])
    # 4 5 found; the root's other children are recent tokens, latest first, none twice under one parent
    assert tree.tokens == [3, 4, 3, 9, 0, 5] and tree.parents == [-1, 0, 0, 0, 0, 1]
    empty = lookup_tree(2, [], Shape(3, 4, 5), recent=[2])
    assert empty.tokens == [2, 2, 0, 1, 3] and set(empty.parents[1:]) == {0}
    for t in (tree, empty):
        assert t.size == len(t.tokens) and all(p < i for i, p in enumerate(t.parents))


def test_the_proposer_drafts_trees_of_a_tree_shape():
    seq = Sequence("0", [5, 1, 2, 5, 3, 4, 5], SamplingParams(), {1}, 100, None)
    tree = NgramProposer(1, 3).propose([seq], Shape(2, 2, 5))[0]
    assert tree.tokens == [5, 3, 1, 4, 2] and tree.parents == [-1, 0, 0, 1, 2]  # after the latest 5, then the first
    assert NgramProposer(1, 3).propose([seq], Shape(2, 1, 3))[0].tokens == [5, 3, 4]  # a chain shape: a chain


def test_only_a_sequence_whose_suffix_recurs_drafts():
    proposer, chain = NgramProposer(2, 4), Shape(3, 1, 4)
    seq = Sequence("0", [9, 4, 5, 6, 7, 4], SamplingParams(), {1}, 100, None)
    assert not proposer.drafts(seq, chain)  # (7, 4) never occurred before; a match of one token is too short
    seq.append_tokens([5])
    assert proposer.drafts(seq, chain)  # (4, 5) did


# ---- the history of finished requests ---------------------------------------------------------------
def test_the_history_gives_what_followed_a_suffix_in_finished_requests():
    history = History(1024, max_match=4)
    history.add([1, 2, 3, 4, 5, 6])
    history.add([7, 2, 3, 9, 8, 2, 3, 4, 1])
    # (2, 3) occurred three times: (2, 3, 4) twice, matched 3 tokens, the latest first; then (7, 2, 3)
    assert history.continuations([0, 2, 3], 2, limit=5) == [(2, [4, 1]), (2, [9, 8]), (2, [4, 5])]
    assert history.continuations([8, 2, 3], 2, limit=5)[0] == (3, [4, 1])
    assert history.continuations([7, 2, 3], 2, limit=1) == [(3, [9, 8])]
    # a continuation stops at the end of its request: (4, 5) is followed by one token only
    assert history.continuations([4, 5], 2, limit=5) == [] and history.continuations([4, 5], 1, limit=5) == [(2, [6])]
    assert history.continuations([5], 1, limit=5) == []  # one token is no pair


def test_the_history_agrees_with_a_scan_and_forgets_its_oldest_tokens():
    rng = random.Random(11)
    for capacity in (1024, 1 << 14):
        history, kept = History(capacity, max_match=4, buckets=64, ways=4), []  # small tables: collisions
        for _ in range(60):
            tokens = [rng.randrange(6) for _ in range(rng.randint(1, 60))]
            history.add(tokens)
            kept += tokens + [-1]
            query = [rng.randrange(6) for _ in range(5)]
            found = history.continuations(query, 2, limit=50)
            ring = kept[-capacity:]
            for length, after in found:  # each one is a real occurrence, matched as long as claimed
                assert any(ring[e - length:e] == query[-length:] and ring[e:e + 2] == after
                           for e in range(length, len(ring) - 1))
            assert [f[0] for f in found] == sorted((f[0] for f in found), reverse=True)
        assert len(kept) > capacity or capacity > 1024
    assert History(1024, 4).continuations([1, 2], 1, limit=5) == []


def test_history_drafts_for_requests_without_a_cache_salt():
    history = History(1024, max_match=4)
    history.add([5, 6, 7, 8, 9, 10])
    proposer, chain = NgramProposer(2, 4, history), Shape(2, 1, 3)
    seq = Sequence("0", [1, 2, 6, 7], SamplingParams(), {0}, 100, None)
    assert proposer.drafts(seq, chain) and proposer.propose([seq], chain)[0].tokens == [7, 8, 9]
    salted = Sequence("1", [1, 2, 6, 7], SamplingParams(), {0}, 100, None, cache_salt=b"tenant")
    assert not proposer.drafts(salted, chain)
    own = Sequence("2", [8, 6, 7, 4, 6, 7], SamplingParams(), {0}, 100, None)
    assert proposer.propose([own], chain)[0].tokens == [7, 4, 6]  # its own match first among equals
    proposer.retire([salted, own])
    assert history.written == 7 + 7  # the salted request added nothing


def test_a_speculative_step_gives_a_declining_sequence_one_token(target):
    llm = make_llm(target, speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_policy="always",
                   speculative_ngram_min_match_window_size=2)
    try:
        engine = llm.engine
        engine.shape = engine.spec.choose(1)
        declines = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(), {0}, 100, None)
        drafts = Sequence("b", [1, 2, 3, 1, 2], SamplingParams(), {0}, 100, None)
        assert engine._decode_shape(declines) == (1, 1) and engine._decode_shape(drafts) == (4, 4)
        engine.spec.forced = engine.shape  # a forced step (calibration) drafts every row
        assert engine._decode_shape(declines) == (4, 4)
    finally:
        llm.engine.close()


def test_declined_rows_count_for_the_controller_as_verifies_that_accepted_nothing(target, prompts):
    llm = make_llm(target, speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_policy="always")
    recorded = []
    record = llm.engine.spec.controller.record_verify
    llm.engine.spec.controller.record_verify = lambda shape, a, spine=None: (recorded.append(a),
                                                                            record(shape, a, spine))
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        spec = llm.engine.stats.spec
        assert 0 < spec.num_drafts < len(recorded)  # some steps declined a row
        assert sum(recorded) == spec.num_accepted_tokens  # and counted nothing accepted for it
    finally:
        llm.engine.close()


def test_options_are_checked():
    for bad, words in ((dict(speculative_draft_model_path="/x"), "needs no speculative_draft_model_path"),
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
    want = plain_tokens(target, batch)
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


def plain_tokens(target, batch) -> list[list[int]]:
    return [o.token_ids for o in make_llm(target, disable_overlap_schedule=True).generate(
        [p for p, _ in batch], [s for _, s in batch])]


@pytest.mark.parametrize("options", [dict(), dict(num_kv_blocks=20, block_size=8, max_model_len=128)],
                         ids=["plain-batching", "preemption"])
def test_trees_give_plain_decodings_tokens(target, prompts, options):
    batch = [(p, params) for p in prompts for params in PARAMS]
    want = plain_tokens(target, batch)
    llm = make_llm(target, speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=7, speculative_policy="always", **options)
    verified = []  # (drafts accepted, of them on the spine) per verified tree
    record = llm.engine.spec.record_accepted
    llm.engine.spec.record_accepted = lambda shape, accepted, spines: (
        verified.extend((a, s[0]) for a, s in zip(accepted, spines)), record(shape, accepted, spines))
    try:
        assert [o.token_ids for o in llm.generate([p for p, _ in batch], [s for _, s in batch])] == want
        spec = llm.engine.stats.spec
        assert spec.num_accepted_tokens > 10 and spec.accepted_per_position[1] > 0
        assert any(a > on_spine for a, on_spine in verified)  # some trees accepted a branch off their spine
        if "num_kv_blocks" in options:
            assert llm.engine.stats.num_preemptions > 0
        assert_pool_full(llm)
    finally:
        llm.engine.close()


def test_a_repeated_request_drafts_from_the_first_ones_output(target):
    prompt = mixed_prompts(1, VOCAB, seed=5, lo=20, hi=20)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain_tokens(target, [(prompt, params)])[0]
    accepted = {}
    for capacity in (0, 1 << 14):
        llm = make_llm(target, speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_policy="always",
                       speculative_ngram_capacity=capacity)
        try:
            for run in range(2):
                before = llm.engine.stats.spec.num_accepted_tokens
                assert llm.generate([prompt], params)[0].token_ids == want
                accepted[capacity, run] = llm.engine.stats.spec.num_accepted_tokens - before
        finally:
            llm.engine.close()
    assert accepted[0, 1] == accepted[0, 0]  # without a history the second request drafts as the first did
    assert accepted[1 << 14, 1] >= 30 > accepted[0, 1]  # with one it drafts the first one's output
