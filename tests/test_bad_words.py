"""vLLM's `bad_words`: tokenized as vLLM tokenizes them; a one-token word is never sampled, a longer word's last
token is not sampled right after the output's last tokens spell the rest of it. Checked against transformers'
`NoBadWordsLogitsProcessor` over the output tokens (vLLM's rule: the prompt does not count) in plain steps (with
the pending token of overlap scheduling), after every node of a draft tree (the node's path counts as output),
and whole requests through the engine with speculation off, chains and trees (greedy: transformers' tokens;
seeded: plain decoding's tokens)."""
from __future__ import annotations

import random

import pytest
import torch
import transformers as tf

from specserve import SamplingParams
from specserve.assets import default_model_path
from specserve.layers.logits_processors import process_logits, process_one, process_tree_logits
from specserve.speculative.tree import DraftTree

from .conftest import assert_pool_full, make_llm, mixed_prompts
from .eagle_utils import make_pair
from .test_penalties import (
    EOS,
    SPECS,
    VOCAB,
    close,
    hf_process,
    make_seq,
    nodes_see_their_paths,
    oracle_drafts,
    random_params,
    stops_of,
)


def with_words(params: SamplingParams, words: list[list[int]]) -> SamplingParams:
    params.bad_words_token_ids = words  # what update_from_tokenizer leaves (these models have no tokenizer)
    return params


def hf_banned(logits: torch.Tensor, words: list[list[int]], output: list[int]) -> torch.Tensor:
    if not words:
        return logits
    # the output left-padded with -1 (no token): transformers 5.17 skips a word longer than the context where it
    # should compare the word's prefix alone (5.25 compares the prefix)
    context = [-1] * max(map(len, words)) + output
    return tf.NoBadWordsLogitsProcessor(words)(torch.tensor([context], dtype=torch.long), logits[None].clone())[0]


def reference(logits: torch.Tensor, seq, output: list[int]) -> torch.Tensor:
    """transformers' processors for every option of seq's params, after seq's prompt and this output."""
    processed = hf_process(logits, seq.params, seq.token_ids[:seq.num_prompt_tokens], output, stops_of(seq))
    return hf_banned(processed, seq.params.bad_words_token_ids or [], output)


def words_near(rng: random.Random, output: list[int], alphabet: int) -> list[list[int]]:
    """Bad words that often fire: some end the output plus one token, some are random over a small alphabet."""
    words = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 2))]
    for _ in range(rng.randint(0, 2)):
        k = rng.randint(0, min(3, len(output)))
        words.append(output[len(output) - k:] + [rng.randrange(alphabet)])
    return words


def random_seqs(rng: random.Random, count: int, v: int, alphabet: int, longest: int) -> list:
    """Sequences with outputs of up to `longest` tokens from range(alphabet), bad words near them, and a third
    of them other options too."""
    seqs = []
    for _ in range(count):
        output = [rng.randrange(alphabet) for _ in range(rng.randint(0, longest))]
        params = random_params(rng, v) if rng.random() < 0.3 else SamplingParams()
        seqs.append(make_seq([rng.randrange(v) for _ in range(rng.randint(1, 9))], output,
                             with_words(params, words_near(rng, output, alphabet))))
    return seqs


# ---- tokenizing -------------------------------------------------------------------------------------------
def test_words_are_tokenized_alone_and_after_a_space_as_vllm_does():
    tok = tf.AutoTokenizer.from_pretrained(default_model_path())
    params = SamplingParams(bad_words=["return", "  import os", "xyz"])
    params.update_from_tokenizer(tok)
    # the shipped tokenizer: "return" [1628], " return" [349]; "import os" [749, 803], " import os" [486, 803];
    # "xyz" [1252, 96], but " xyz" is three tokens [893, 95, 96]: vLLM keeps only variants as long as the word
    assert params.bad_words_token_ids == [[1628], [349], [749, 803], [486, 803], [1252, 96]]
    assert params.processes_logits and params.has_bad_words
    untouched = with_words(SamplingParams(), [[3, 4]])
    untouched.update_from_tokenizer(None)  # no bad_words: nothing to tokenize, ids set directly stay
    assert untouched.bad_words_token_ids == [[3, 4]]
    # the server tokenizes them to answer 400 early, the engine's add_request asks again: the same words are
    # not tokenized twice, changed words are
    calls = []
    encode = tok.encode
    tok.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    params.update_from_tokenizer(tok)
    assert calls == []
    params.bad_words = ["return"]
    params.update_from_tokenizer(tok)
    assert calls == ["return", " return"] and params.bad_words_token_ids == [[1628], [349]]


def test_bad_words_are_validated():
    assert SamplingParams(bad_words="never").bad_words == ["never"]
    for bad in ([""], ["  "], ["ok", 3], 3):
        with pytest.raises(ValueError, match="invalid sampling parameter: bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)
    with pytest.raises(ValueError, match="bad_words token id 64 is outside the vocabulary"):
        with_words(SamplingParams(), [[3, 64]]).check_token_ids(64)


# ---- the processors ---------------------------------------------------------------------------------------
def test_rows_match_transformers_row_by_row_and_batched():
    rng, v, alphabet = random.Random(5), 30, 5
    gen = torch.Generator().manual_seed(5)
    fired = 0
    for _ in range(40):
        seqs = random_seqs(rng, rng.randint(1, 6), v, alphabet, 8)
        logits = torch.randn(len(seqs), v, generator=gen) * 3
        batched = process_logits(logits, seqs)
        for i, seq in enumerate(seqs):
            output = seq.output_token_ids
            want = reference(logits[i], seq, output)
            prompt = seq.token_ids[:seq.num_prompt_tokens]
            assert close(process_one(logits[i], seq.params, prompt, output, stops_of(seq)), want)
            assert close(batched[i], want)
            fired += int(torch.isinf(want).sum() > torch.isinf(hf_process(logits[i], seq.params, prompt, output,
                                                                          stops_of(seq))).sum())
    assert fired > 20, "bad words must ban tokens in these cases"


def test_a_word_ending_in_the_pending_token_bans_after_it():
    # overlap scheduling: the output so far is [5, 6] on the host and 7, sampled last step, still on the device
    seq = make_seq([2, 3], [5, 6], with_words(SamplingParams(), [[6, 7, 9], [7, 8], [5, 7, 2], [6, 11], [4]]))
    seq.num_pending, seq.pending_row = 1, 2
    logits = torch.zeros(1, 12)
    got = process_logits(logits, [seq], torch.tensor([0, 0, 7]))[0]
    assert torch.isinf(got).nonzero().flatten().tolist() == [4, 8, 9]
    seq.num_pending = 0  # resolved: 7 arrives on the host
    seq.token_ids.append(7)
    assert torch.equal(process_logits(logits, [seq])[0], got)


def test_each_draft_node_sees_its_path():
    rng, v, alphabet = random.Random(6), 24, 4
    gen = torch.Generator().manual_seed(6)
    fired = 0
    for _ in range(25):
        seqs = random_seqs(rng, rng.randint(1, 4), v, alphabet, 5)
        fired += nodes_see_their_paths(rng, gen, seqs, v, alphabet, reference)
    assert fired > 30, "bad words must ban tokens at draft nodes"


def test_draft_nodes_worked_example():
    # output [4, 5]; tree: root 5 (committed), 6 under it, 7 under 6, 8 under the root
    seq = make_seq([2], [4, 5], with_words(SamplingParams(temperature=0), [[4, 5, 10], [5, 6, 11], [6, 7, 3]]))
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, 0])
    got = process_tree_logits(torch.zeros(1, 4, 12), [seq], torch.tensor([tree.tokens]), torch.tensor([tree.parents]))
    banned = [torch.isinf(got[0, j]).nonzero().flatten().tolist() for j in range(4)]
    assert banned == [[10], [11], [3], []]


# ---- the engine -------------------------------------------------------------------------------------------
NEW = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("bad_words"), VOCAB)


@pytest.fixture(scope="module")
def cases(pair):
    """(prompt, greedy params, seeded params) a case: words taken from each prompt's plain greedy output (one
    token; two; three; two words and one token), so each ban changes the output."""
    prompts = mixed_prompts(4, VOCAB, seed=11, lo=3, hi=25)
    plain = [o.token_ids for o in make_llm(pair[0]).generate(prompts, SamplingParams(temperature=0, max_tokens=NEW,
                                                                                       ignore_eos=True))]
    p = plain
    words = [[p[0][2:3]], [p[1][3:5]], [p[2][4:7]], [p[3][1:3], p[3][6:8], p[3][9:10]]]
    out = []
    for i, (prompt, ws) in enumerate(zip(prompts, words)):
        greedy = with_words(SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), ws)
        seeded = with_words(SamplingParams(temperature=1.0, seed=40 + i, max_tokens=NEW, ignore_eos=True), ws)
        out.append((prompt, greedy, seeded, plain[i]))
    return out


def hf_greedy_banned(path: str, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(hf_banned(logits, params.bad_words_token_ids, out).argmax()))
    return out


@pytest.fixture(scope="module")
def references(pair, cases):
    greedy = [hf_greedy_banned(pair[0], prompt, g) for prompt, g, _, _ in cases]
    llm = make_llm(pair[0], disable_overlap_schedule=True)
    seeded = [llm.generate([prompt], s)[0].token_ids for prompt, _, s, _ in cases]
    return greedy, seeded


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def run(llm, cases) -> tuple[list, list]:
    batch = [(prompt, params) for prompt, g, s, _ in cases for params in (g, s)]
    outs = [o.token_ids for o in llm.generate([p for p, _ in batch], [s for _, s in batch])]
    return outs[0::2], outs[1::2]


def test_the_words_change_the_output(cases, references):
    greedy, seeded = references
    for (_, params, _, plain), ref, sampled in zip(cases, greedy, seeded):
        assert ref != plain
        assert not any(contains(ref, w) or contains(sampled, w) for w in params.bad_words_token_ids)


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_matches_transformers(pair, cases, references, overlap):
    llm = make_llm(pair[0], disable_overlap_schedule=not overlap)
    assert run(llm, cases) == references
    assert_pool_full(llm)


@pytest.mark.parametrize("spec", list(SPECS))
def test_speculation_keeps_the_tokens(pair, cases, references, spec):
    target, draft = pair
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft,
                   speculative_policy="always", **SPECS[spec])
    greedy, seeded = references
    truth = {tuple(c[0]): r for c, r in zip(cases, greedy)}
    oracle_drafts(llm, truth)  # greedy requests' drafts right but at every fourth token: paths through the bans
    assert run(llm, cases) == references
    assert llm.engine.stats.spec.num_accepted_tokens > NEW
    assert_pool_full(llm)


def test_eos_is_not_special(pair):
    """A bad word may be EOS itself (vLLM bans it like any token)."""
    llm = make_llm(pair[0])
    params = with_words(SamplingParams(temperature=0, max_tokens=6, logit_bias={EOS: 100}), [[EOS]])
    [out] = llm.generate([[2, 3, 4]], params)
    assert EOS not in out.token_ids and len(out.token_ids) == 6


def test_a_bad_word_without_a_tokenizer_fails_before_any_request_runs(pair):
    llm = make_llm(pair[0])  # these checkpoints have no tokenizer
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        llm.generate([[2, 3], [4, 5]], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, bad_words=["x"])])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
