"""Speculative sampling is lossless: emitted tokens follow the target's distribution."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve import SamplingParams

from .conftest import DEVICE, assert_pool_full, make_llm
from .eagle_utils import make_pair
from .stats import chi_square_pvalue, reference_distribution

VOCAB = 64
N = 4000
PROMPT = [7, 3, 11, 40, 2]
PARAMS = dict(temperature=0.8, top_p=0.95)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("specsample"), VOCAB)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A tiny random Qwen3-MoE target (every layer routed) and a random EAGLE-3 draft for it."""
    from .eagle_utils import make_eagle3_checkpoint
    from .test_moe import make_moe_checkpoint

    root = tmp_path_factory.mktemp("specsample_moe")
    target = make_moe_checkpoint(str(root / "target"), seed=3, vocab=VOCAB, num_hidden_layers=4,
                                 mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    return target, make_eagle3_checkpoint(str(root / "draft"), target, seed=1)


def target_logits(target: str, prefix: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prefix])).logits[0, -1]


CHAIN = dict(speculative_num_steps=2, speculative_eagle_topk=1)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)


CASES = {"chain": ("pair", CHAIN, PARAMS), "tree": ("pair", TREE, PARAMS), "moe_chain": ("moe_pair", CHAIN, PARAMS),
         # temperature alone: on CUDA the loop's other sampling graphs (on the CPU the chain case's path)
         "chain_temperature": ("pair", CHAIN, dict(temperature=0.8))}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_distribution_matches_target(request, case):
    target, spec, params = CASES[case]
    if case == "chain_temperature" and DEVICE["name"] != "cuda":
        pytest.skip("the same eager path as the chain case on this device")
    target, draft = request.getfixturevalue(target)
    # 256 rows at a time: on CUDA a tree's loop graphs hold 2,048 tokens (256 trees of 8), so its verifies loop
    llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft, max_num_seqs=256,
                   max_num_batched_tokens=4096, speculative_policy="always", **spec)
    modes = looped_modes(llm)
    outs = llm.generate([PROMPT] * N, SamplingParams(max_tokens=3, ignore_eos=True, **params))
    # ~60 accepted on average (45-68 over seeds 0-5 on CPU): enough to exercise the accepted path
    assert llm.engine.stats.spec.num_accepted_tokens > 25, "drafts must be accepted for the test to mean anything"
    assert_pool_full(llm)
    if llm.engine.spec.loop is not None:  # CUDA: the verify steps ran in the loop's graphs
        assert modes == {"filtered" if "top_p" in params else "sampled"}, modes
    # the 2nd and 3rd tokens come out of verify steps (accepted drafts or recovered/bonus tokens)
    first = Counter(o.token_ids[0] for o in outs).most_common(1)[0][0]
    given_first = [o.token_ids for o in outs if o.token_ids[0] == first]
    second = Counter(ids[1] for ids in given_first).most_common(1)[0][0]
    checks = [(PROMPT + [first], [ids[1] for ids in given_first]),
              (PROMPT + [first, second], [ids[2] for ids in given_first if ids[1] == second])]
    top_p = params.get("top_p", 1.0)
    for prefix, tokens in checks:
        assert len(tokens) > 300
        counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
        logits = target_logits(target, prefix)
        assert chi_square_pvalue(counts, reference_distribution(logits, params["temperature"], top_p=top_p)) > 1e-3
        wrong = reference_distribution(logits, temperature=params["temperature"] * 1.6, top_p=top_p)
        assert chi_square_pvalue(counts, wrong) < 1e-4  # the test has the power to see a skew


def looped_modes(llm) -> set:
    """The modes of the speculative loop's launches from now on (recorded as they happen; empty without a loop)."""
    loop, modes = llm.engine.spec.loop, set()
    if loop is not None:
        launch = loop._launch

        def recording(seqs, shape, draws, mode):
            modes.add(mode)
            return launch(seqs, shape, draws, mode)

        loop._launch = recording
    return modes
