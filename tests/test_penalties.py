"""Penalties, logit_bias and min_tokens (issue 20), checked against transformers' logits processors applied
one token at a time: the processors themselves, after every node of a draft tree (the node's path counts
as output), and whole requests through the engine with speculation off, chains and trees (greedy: the
same tokens as transformers; seeded: the same tokens as plain decoding)."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import transformers as tf

from specserve import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.layers.logits_processors import process_logits, process_one, process_tree_logits
from specserve.speculative.batch_verify import process_drafts, verify_batch_params
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import verify

from .conftest import assert_pool_full, make_llm, mixed_prompts
from .eagle_utils import make_pair

EOS = 1


def hf_process(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
               stops: set[int]) -> torch.Tensor:
    """The reference: transformers' processors in vLLM's order (bias, min_tokens, repetition over prompt and
    output), then OpenAI's formula for the frequency and presence penalties, a token at a time."""
    procs = []
    if params.allowed_token_ids is not None:
        outside = sorted(set(range(logits.shape[-1])) - set(params.allowed_token_ids))
        procs.append(tf.SuppressTokensLogitsProcessor(outside))
    if params.logit_bias:
        procs.append(tf.SequenceBiasLogitsProcessor({(t,): float(b) for t, b in params.logit_bias.items()}))
    if params.min_tokens and stops:
        procs.append(tf.MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, sorted(stops)))
    if params.repetition_penalty != 1:
        procs.append(tf.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    scores = tf.LogitsProcessorList(procs)(torch.tensor([prompt + output]), logits[None].clone())[0]
    for token, count in Counter(output).items():  # mu[j] -= c[j] * frequency + (c[j] > 0) * presence
        scores[token] -= count * params.frequency_penalty + params.presence_penalty
    return scores


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 1.0]), max_tokens=40,
        repetition_penalty=rng.choice([1.0, 1.0, 0.7, 1.3, 2.0]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.5, 2.0]),
        logit_bias=rng.choice([{}, {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}]),
        min_tokens=rng.choice([0, 0, 3, 8]), stop_token_ids=rng.choice([[], [rng.randrange(vocab)]]),
        allowed_token_ids=rng.choice([None, None, sorted(rng.sample(range(vocab), 6)) + [EOS]]))


def make_seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = Sequence("r", prompt, params, {EOS}, 10_000, None)
    seq.token_ids += output
    return seq


def stops_of(seq: Sequence) -> set[int]:
    return seq.eos_token_ids | set(seq.params.stop_token_ids)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-4)


# ---- the processors ---------------------------------------------------------------------------------
def test_processors_match_transformers_row_by_row_and_batched():
    rng, v = random.Random(0), 50
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        seqs = [make_seq([rng.randrange(v) for _ in range(rng.randint(1, 20))],
                         [rng.randrange(v) for _ in range(rng.randint(0, 12))], random_params(rng, v))
                for _ in range(rng.randint(1, 6))]
        logits = torch.randn(len(seqs), v, generator=gen) * 3
        batched = process_logits(logits, seqs)
        for i, seq in enumerate(seqs):
            prompt, output = seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids
            want = hf_process(logits[i], seq.params, prompt, output, stops_of(seq))
            assert close(process_one(logits[i], seq.params, prompt, output, stops_of(seq)), want)
            assert close(batched[i], want)
            if not seq.params.processes_logits:
                assert torch.equal(batched[i], logits[i])


def test_a_batch_without_options_is_returned_untouched():
    logits = torch.randn(3, 20)
    seqs = [make_seq([2, 3], [4], SamplingParams(temperature=t)) for t in (0.0, 1.0, 0.5)]
    assert process_logits(logits, seqs) is logits
    assert all(s.logits_state is None for s in seqs)
    trees = [DraftTree.chain(4, [5, 6])] * 3
    big = torch.randn(3, 3, 20)
    assert process_drafts(seqs, trees, big) is big


def test_counts_follow_new_tokens_and_the_pending_one_on_the_device():
    # overlap scheduling: the last sampled token is still on the device (row 1 of the in-flight step)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5, min_tokens=4)
    seq = make_seq([3, 4], [5, 5], params)
    logits = torch.randn(1, 10)
    first = process_logits(logits, [seq])[0]
    assert close(first, hf_process(logits[0], params, [3, 4], [5, 5], {EOS})) and first[EOS] == -float("inf")
    seq.token_ids.append(6)  # folded in on the next use
    seq.num_pending, seq.pending_row = 1, 1
    pending = torch.tensor([9, 7, 9])
    got = process_logits(logits, [seq], pending)[0]
    want = hf_process(logits[0], params, [3, 4], [5, 5, 6, 7], {EOS})
    assert close(got, want)
    seq.num_pending = 0  # resolved: 7 arrives on the host
    seq.token_ids.append(7)
    assert close(process_logits(logits, [seq])[0], want)
    assert got[EOS].item() != float("-inf")  # four output tokens: EOS is allowed again


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def path_of(tree: DraftTree, j: int) -> list[int]:
    """The drafts from the root (left out) down to node j."""
    path = []
    while j > 0:
        path.insert(0, tree.tokens[j])
        j = tree.parents[j]
    return path


def nodes_see_their_paths(rng: random.Random, gen: torch.Generator, seqs: list, v: int, alphabet: int,
                          reference) -> int:
    """Random trees of drafts from range(alphabet) over seqs: process_tree_logits after each node equals
    reference(logits, seq, output tokens + the node's path). Returns how many nodes it sets more logits -inf at."""
    b, n = len(seqs), rng.randint(1, 7)
    parents = [random_tree(rng, n) if rng.random() < 0.5 else list(range(-1, n - 1)) for _ in range(b)]
    tokens = torch.randint(alphabet, (b, n), generator=gen)
    logits = torch.randn(b, n, v, generator=gen) * 3
    got = process_tree_logits(logits, seqs, tokens, torch.tensor(parents))
    banned = 0
    for r, seq in enumerate(seqs):
        tree = DraftTree(tokens[r].tolist(), parents[r])
        for j in range(n):
            want = reference(logits[r, j], seq, seq.output_token_ids + path_of(tree, j))
            assert close(got[r, j], want)
            banned += int(torch.isinf(want).sum() > torch.isinf(logits[r, j]).sum())
    return banned


def test_each_draft_node_sees_its_path():
    rng, v = random.Random(1), 40
    gen = torch.Generator().manual_seed(1)
    for _ in range(15):
        seqs = [make_seq([rng.randrange(v) for _ in range(rng.randint(1, 10))],
                         [rng.randrange(v) for _ in range(rng.randint(0, 8))], random_params(rng, v))
                for _ in range(rng.randint(1, 5))]
        nodes_see_their_paths(rng, gen, seqs, v, v, lambda logits, seq, output: hf_process(
            logits, seq.params, seq.token_ids[:seq.num_prompt_tokens], output, stops_of(seq)))


def test_min_tokens_at_draft_nodes_worked_example():
    # two output tokens so far, min_tokens 4: EOS is held back after the root and after depth 1, allowed
    # after depth 2 (the token it would be is the fifth output token)
    params = SamplingParams(min_tokens=4, temperature=0)
    seq = make_seq([2, 3], [4, 5], params)
    tree = DraftTree([6, 7, 8, 9, 10], [-1, 0, 0, 1, 3])  # depths 0, 1, 1, 2, 3
    logits = torch.zeros(1, 5, 12)
    logits[..., EOS] = 5.0
    got = process_tree_logits(logits, [seq], torch.tensor([tree.tokens]), torch.tensor([tree.parents]))
    assert torch.isinf(got[0, :, EOS]).tolist() == [True, True, True, False, False]


def test_batched_verification_matches_the_reference():
    rng, v = random.Random(2), 30
    gen = torch.Generator().manual_seed(2)
    checked = 0
    for _ in range(25):
        b, n = rng.randint(1, 6), rng.randint(2, 7)
        seqs = []
        for _ in range(b):
            params = random_params(rng, v)
            params.seed = rng.choice([None, rng.randrange(100)])
            seqs.append(make_seq([rng.randrange(v) for _ in range(rng.randint(1, 10))],
                                 [rng.randrange(v) for _ in range(rng.randint(0, 6))], params))
        parents = [random_tree(rng, n) for _ in range(b)]
        logits = torch.randn(b, n, v, generator=gen) * 2
        processed = process_tree_logits(logits, seqs, torch.zeros(b, n, dtype=torch.long), torch.tensor(parents))
        tokens = processed.argmax(-1).gather(1, torch.tensor(parents).clamp(min=0))  # mostly the argmax drafts
        tokens[:, 0] = 0
        tokens = torch.where(torch.rand(b, n, generator=gen) < 0.2, torch.randint(v, (b, n), generator=gen), tokens)
        trees = [DraftTree(tokens[r].tolist(), parents[r]) for r in range(b)]
        positions = [s.num_tokens for s in seqs]
        gens = [torch.Generator().manual_seed(r) for r in range(b)]
        out = verify_batch_params(tokens, torch.tensor(parents), process_drafts(seqs, trees, logits),
                                  [s.params for s in seqs], gens, False, positions)
        for r, seq in enumerate(seqs):
            history = (seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids, stops_of(seq))
            ref = verify(trees[r], logits[r], seq.params, torch.Generator().manual_seed(r), positions[r], history)
            k = len(ref.path)
            assert out.path[r].tolist()[:k] == ref.path and out.out_tokens[r].tolist()[:k] == ref.tokens
            checked += k > 2
    assert checked > 5, "long accepted paths must be exercised"


# ---- the engine -------------------------------------------------------------------------------------
VOCAB = 64
NEW = 20
OPTIONS = [dict(repetition_penalty=1.4), dict(repetition_penalty=0.7),
           dict(frequency_penalty=0.8, presence_penalty=0.4), dict(presence_penalty=-1.5),
           dict(logit_bias={5: 3.0, 9: -4.0}, repetition_penalty=1.2),
           dict(min_tokens=8, logit_bias={EOS: 6.0}),
           dict(min_tokens=5, stop_token_ids=[7], logit_bias={7: 5.0}, frequency_penalty=0.3),
           dict(repetition_penalty=1.1, frequency_penalty=-0.4, presence_penalty=0.6, logit_bias={3: 2.0},
                min_tokens=3),
           dict(allowed_token_ids=[3, 5, 9, 12, 20, 33, EOS], repetition_penalty=1.3, logit_bias={9: 2.0}),
           dict()]
GREEDY = [SamplingParams(temperature=0, max_tokens=NEW, **o) for o in OPTIONS]
SEEDED = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=NEW, **o) for i, o in enumerate(OPTIONS)]
SPECS = {
    "chain3": dict(speculative_num_steps=3, speculative_eagle_topk=1),
    "tree": dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("penalties"), VOCAB)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(len(OPTIONS) * 2, VOCAB, seed=4, lo=2, hi=30)


def hf_greedy_processed(path: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' model, one token at a time, its logits through `hf_process`, then the argmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out, stops = [], {EOS} | set(params.stop_token_ids)
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(hf_process(logits, params, prompt, out, stops).argmax()))
            if out[-1] in stops:
                break
    return out


@pytest.fixture(scope="module")
def greedy_reference(pair, prompts):
    return [hf_greedy_processed(pair[0], p, s) for p, s in zip(prompts, GREEDY)]


@pytest.fixture(scope="module")
def seeded_reference(pair, prompts):
    """Each seeded request alone, plain decoding without overlap."""
    llm = make_llm(pair[0], disable_overlap_schedule=True)
    return [llm.generate([p], s)[0].token_ids for p, s in zip(prompts[len(OPTIONS):], SEEDED)]


def requests(prompts):
    """Every greedy and seeded case, each on its own prompt, interleaved."""
    greedy = list(zip(prompts, GREEDY))
    seeded = list(zip(prompts[len(OPTIONS):], SEEDED))
    return [x for pair in zip(greedy, seeded) for x in pair]


def oracle_drafts(llm, truth: dict) -> None:
    """Draft each request's true continuation (truth: prompt -> tokens) in every last child of a node,
    wrong at output indices 4i + 2, so accepted paths, rejections, min_tokens and the counts along them are
    exercised (the random drafter alone would almost never be right)."""
    spec = llm.engine.spec
    propose = spec.draft

    def draft(seqs, shape):
        trees = propose(seqs, shape)
        for seq, tree in zip(seqs, trees):
            ref = truth[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            tokens, depth, done = list(tree.host_tokens()), tree.depths(), seq.num_output_tokens
            for j in {p: j for j, p in enumerate(tree.parents) if j > 0}.values():
                at = done + depth[j] - 1
                if at < len(ref):
                    tokens[j] = ref[at] if at % 4 != 2 else (ref[at] + 1) % VOCAB
            tree.tokens, tree.batch = tokens, None
        return trees

    spec.draft = draft


def test_the_cases_do_something(greedy_reference, seeded_reference, pair, prompts):
    plain = make_llm(pair[0]).generate(prompts[:len(OPTIONS)], SamplingParams(temperature=0, max_tokens=NEW))
    assert sum(o.token_ids != r for o, r in zip(plain, greedy_reference)) >= len(OPTIONS) - 2
    for ref, params in zip(greedy_reference + seeded_reference, GREEDY + SEEDED):
        stops = {EOS} | set(params.stop_token_ids)
        assert not stops & set(ref[:params.min_tokens])
        if params.min_tokens and stops & set(params.logit_bias):  # held back, then taken when its bias says
            assert ref[-1] in stops and params.min_tokens < len(ref) < NEW


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_matches_transformers(greedy_reference, seeded_reference, pair, prompts, overlap):
    llm = make_llm(pair[0], disable_overlap_schedule=not overlap)
    batch = requests(prompts)
    outs = [o.token_ids for o in llm.generate([p for p, _ in batch], [s for _, s in batch])]
    assert outs[0::2] == greedy_reference and outs[1::2] == seeded_reference
    assert_pool_full(llm)


@pytest.mark.parametrize("spec", list(SPECS))
def test_speculation_keeps_the_tokens(greedy_reference, seeded_reference, pair, prompts, spec):
    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_policy="always", **SPECS[spec])
    batch = requests(prompts)
    truth = {tuple(p): r for (p, _), r in zip(batch, [x for pair in zip(greedy_reference, seeded_reference)
                                                      for x in pair])}
    oracle_drafts(llm, truth)
    outs = [o.token_ids for o in llm.generate([p for p, _ in batch], [s for _, s in batch])]
    assert outs[0::2] == greedy_reference and outs[1::2] == seeded_reference
    assert llm.engine.stats.spec.num_accepted_tokens > NEW * len(OPTIONS) // 2
    assert_pool_full(llm)


@pytest.mark.parametrize("spec", [None, "chain3", "tree"])
def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(pair, spec):
    target, draft = pair
    options = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, speculative_policy="always",
                   **SPECS[spec]) if spec else {}
    llm = make_llm(target, **options)
    forced = [SamplingParams(temperature=t, seed=s, max_tokens=12, logit_bias={5: 100}) for t, s in
              ((0, None), (1.0, 3), (1.0, None))]
    eos_late = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, logit_bias={EOS: 100})
    few = SamplingParams(temperature=1.0, seed=4, max_tokens=12, allowed_token_ids=[7, 11], ignore_eos=True)
    outs = llm.generate([[2, 3, 4]] * 5, forced + [eos_late, few])
    assert [o.token_ids for o in outs[:3]] == [[5] * 12] * 3
    late = outs[3]
    assert EOS not in late.token_ids[:6] and late.token_ids[6:] == [EOS] and late.finish_reason == "stop"
    assert set(outs[4].token_ids) == {7, 11}


def test_options_are_validated():
    for bad in (dict(repetition_penalty=0), dict(repetition_penalty=-1.0), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3), dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}),
                dict(logit_bias={"x": 1}), dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=1.5),
                dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]), dict(allowed_token_ids=3)):
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={"12": 5}).logit_bias == {12: 5}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={64: 1}).check_token_ids(64)
    with pytest.raises(ValueError, match="stop_token_ids token id 70"):
        SamplingParams(stop_token_ids=[70]).check_token_ids(64)
    with pytest.raises(ValueError, match="allowed_token_ids token id 64"):
        SamplingParams(allowed_token_ids=[3, 64]).check_token_ids(64)
    SamplingParams(logit_bias={63: 1}, stop_token_ids=[0], allowed_token_ids=[63]).check_token_ids(64)
