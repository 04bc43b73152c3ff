"""Synthetic acceptance: the engine accepts drafts at the configured per-position rates, and refuses bad ones."""
from __future__ import annotations

import argparse

import pytest
import torch

from specserve import SamplingParams
from specserve.cli import add_engine_args, engine_options
from specserve.config import ConfigError, EngineConfig
from specserve.speculative.synthetic import SyntheticAcceptance

from .conftest import DEVICE, make_llm

CHAIN = (0.77, 0.61, 0.53)
TREE = (0.88, 0.70, 0.54, 0.43, 0.33)


def test_draws_follow_the_rates():
    synthetic = SyntheticAcceptance((0.9, 0.5, 0.5, 0.1), seed=3)
    n = 20000
    draws = [synthetic.draw()[0] for _ in range(n)]
    for i, rate in enumerate(synthetic.rates):
        assert abs(sum(d > i for d in draws) / n - rate) < 0.002


def test_chains_of_a_tree_configuration_draw_their_own_rates():
    synthetic = SyntheticAcceptance(TREE, seed=1, chain_rates=CHAIN + (0.46, 0.40))
    n = 20000
    draws = [(tree, synthetic.draw(tree)[0]) for tree in (i % 3 == 0 for i in range(3 * n))]  # interleaved
    for tree, rates in ((True, TREE), (False, CHAIN + (0.46, 0.40))):
        got = [d for t, d in draws if t == tree]
        for i, rate in enumerate(rates):
            assert abs(sum(d > i for d in got) / len(got) - rate) < 0.01, (tree, i)
    assert SyntheticAcceptance(CHAIN).draw(False) == SyntheticAcceptance(CHAIN).draw(True)  # default: one set


def test_a_tree_leaves_its_spine_where_a_chain_would_stop():
    """A tree's draw accepts what the chain's same draw does along the spine, then goes on through a second
    child: its path shares exactly the chain's count with the spine (DraftTree.spine, and on the device
    tree.spine_counts), and its gain over the spine is the difference of the configured rates."""
    from specserve.layers.triton_attention import tree_bitmask
    from specserve.speculative.synthetic import spine_path
    from specserve.speculative.tree import DraftTree, spine_counts

    chain = CHAIN + (0.40, 0.30)  # at most the tree's rate at every position
    synthetic = SyntheticAcceptance(TREE, seed=2, chain_rates=chain)
    # a binary tree four levels deep in level order: node i's children are 2i + 1 and 2i + 2
    tree = DraftTree(list(range(31)), [-1] + [(i - 1) // 2 for i in range(1, 31)])
    parents = torch.tensor([tree.parents])
    bits = tree_bitmask(tree.ancestor_mask())[None]
    gains = []
    for _ in range(400):
        accepted, detour = synthetic.draw(True)
        want = min(accepted, 4)
        on_path, _ = spine_path(parents, torch.tensor([want]), torch.tensor([detour]))
        path = on_path[0].nonzero().flatten().tolist()
        shared, length = tree.spine(path)
        assert (shared, length) == tuple(spine_counts(parents, bits, on_path)[0].tolist())
        assert length == 4 and len(path) - 1 == want
        assert shared == (min(detour, 4) if detour >= 0 else want)
        gains.append(want - shared)
    assert sum(gains) / len(gains) == pytest.approx(sum(TREE[:4]) - sum(chain[:4]), abs=0.02)


def test_a_detour_without_a_side_branch_ends_the_path():
    """A tree gains over its spine only through a side branch it has: a chain-shaped spine of 3 with one
    side child under the root. A detour at depth 0 takes it (and stops at its leaf); a detour at depth 1,
    where the spine node has no second child, ends the path there (the spine's draw, 1 draft), not on
    down the spine to the tree's draw."""
    from specserve.speculative.synthetic import spine_path

    parents = torch.tensor([[-1, 0, 0, 1, 3]])  # root; 1 (spine) and 2 (side) under it; 3 under 1; 4 under 3
    on_path, node = spine_path(parents, torch.tensor([3]), torch.tensor([0]))
    assert on_path[0].nonzero().flatten().tolist() == [0, 2] and node.item() == 2
    on_path, node = spine_path(parents, torch.tensor([3]), torch.tensor([1]))
    assert on_path[0].nonzero().flatten().tolist() == [0, 1] and node.item() == 1
    on_path, node = spine_path(parents, torch.tensor([3]), torch.tensor([-1]))
    assert on_path[0].nonzero().flatten().tolist() == [0, 1, 3, 4]


def test_chain_drawn_is_the_spine_path_of_a_chain():
    """The speculative loop's chains take `chain_drawn` (two operations) for `spine_path`'s walk."""
    from specserve.speculative.synthetic import chain_drawn, spine_path

    for n in (2, 4, 6):
        values = torch.arange(-1, n + 2)
        want, detour = (x.reshape(-1) for x in torch.meshgrid(values, values, indexing="ij"))
        want = want.clamp(min=0)  # rows with a draw
        parents = torch.arange(-1, n - 1).expand(want.shape[0], n)
        on_path, node = spine_path(parents, want, detour)
        assert torch.equal(chain_drawn(want, detour, n), node)
        assert torch.equal(on_path, torch.arange(n) <= node[:, None])


def test_tree_children_rank_the_spine_first():
    scores = SyntheticAcceptance(TREE).child_scores(2, 4, "cpu")  # conditional 0.70 / 0.88 at depth 2
    assert scores.argmax() == 0 and abs(scores[0].exp() - 0.70 / 0.88) < 1e-6
    assert abs(scores.exp().sum() - 1) < 1e-4


def run_synthetic(rates, batch, **spec):
    from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET

    llm = make_llm(SHIPPED_TARGET, speculative_algorithm="EAGLE3", speculative_draft_model_path=SHIPPED_DRAFT,
                   speculative_policy="always",
                   speculative_synthetic_acceptance_rates=list(rates), **spec)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(batch)]
    tokens = 1200 if batch == 1 else 160
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return llm.engine.stats.spec


# batch 1 differs from batch 16 only on CUDA (its own captured graphs); on the CPU batch 16 runs the same
# code in a tenth of the steps
BATCH_ONE = pytest.mark.skipif(DEVICE["name"] != "cuda", reason="on the CPU batch 16 covers batch 1's path")


@pytest.mark.parametrize("batch", [pytest.param(1, marks=BATCH_ONE), 16])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_engine_accepts_at_the_configured_rates(shape, batch):
    rates, spec = (CHAIN, {}) if shape == "chain" else (
        TREE, dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8))
    stats = run_synthetic(rates, batch, **spec)
    assert stats.num_drafts >= 300
    measured = [a / stats.num_drafts for a in stats.accepted_per_position]
    for got, want in zip(measured, rates):
        assert abs(got - want) < 0.02, (measured, rates)
    assert abs(stats.mean_acceptance_length / (1 + sum(rates)) - 1) < 0.02


def test_shorter_chains_use_the_leading_rates():
    stats = run_synthetic(CHAIN, 4, speculative_num_steps=3)
    assert len(stats.accepted_per_position) == 3
    stats_k1 = run_synthetic((0.6,), 4, speculative_num_steps=1)
    assert abs(stats_k1.accepted_per_position[0] / stats_k1.num_drafts - 0.6) < 0.02


@pytest.mark.parametrize("rates, message", [
    ([0.5, 0.6, 0.4], "non-increasing"),
    ([1.2, 0.6, 0.4], r"\[0, 1\]"),
    ([0.8, 0.6], "one per draft step"),
    ("0.8,x,0.1", "comma-separated numbers"),
    ([True, 0.5, 0.1], "list of numbers"),
])
def test_bad_rates_are_refused(rates, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(speculative_algorithm="EAGLE3", speculative_synthetic_acceptance_rates=rates)


def test_chain_rates_are_checked_like_the_rates():
    tree = dict(speculative_algorithm="EAGLE3", speculative_num_steps=5, speculative_eagle_topk=4)
    with pytest.raises(ConfigError, match="speculative_synthetic_chain_rates .*one per draft step"):
        EngineConfig.from_options(**tree, speculative_synthetic_acceptance_rates=TREE,
                                  speculative_synthetic_chain_rates=CHAIN)
    with pytest.raises(ConfigError, match="needs speculative_synthetic_acceptance_rates"):
        EngineConfig.from_options(**tree, speculative_synthetic_chain_rates=TREE)
    config = EngineConfig.from_options(**tree, speculative_synthetic_acceptance_rates=TREE,
                                       speculative_synthetic_chain_rates="0.77,0.61,0.53,0.46,0.4")
    assert config.speculative.speculative_synthetic_chain_rates == CHAIN + (0.46, 0.4)


def test_rates_need_speculation(tmp_path):
    from specserve.assets import SHIPPED_TARGET
    from specserve.engine.machine import resolve_config

    config = EngineConfig.from_options(model=SHIPPED_TARGET, speculative_algorithm="none",
                                       speculative_synthetic_acceptance_rates=[0.5, 0.4, 0.3])
    with pytest.raises(ConfigError, match="without speculative decoding"):
        resolve_config(config)


def test_command_line_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-synthetic-acceptance-rates", "0.77,0.61,0.53"])
    config = EngineConfig.from_options(**engine_options(args))
    assert config.speculative.speculative_synthetic_acceptance_rates == CHAIN
    assert config.flat()["speculative_synthetic_acceptance_rates"] == CHAIN


@pytest.mark.skipif(DEVICE["name"] != "cpu", reason="the CPU default suffices: no device path differs")
def test_off_by_default():
    assert EngineConfig().speculative.speculative_synthetic_acceptance_rates is None
