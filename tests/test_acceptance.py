"""Worked examples of verification: these drafts, these target distributions, so these tokens."""
from __future__ import annotations

import torch

from specserve.speculative.tree import DraftTree, select_tree
from specserve.speculative.verify import verify_greedy, verify_sampling


def one_hot_rows(rows: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), vocab).float()


def test_chain_greedy_accepts_prefix_then_recovers():
    # root 5, drafts 1 2 3; the target would say 1 2 4 9 after root, 1, 2, 3
    tree = DraftTree.chain(5, [1, 2, 3])
    v = verify_greedy(tree, [1, 2, 4, 9])
    assert v.path == [0, 1, 2] and v.num_accepted == 2
    assert v.tokens == [1, 2, 4]  # two accepted, then the recovered token 4


def test_chain_greedy_all_accepted_adds_bonus():
    tree = DraftTree.chain(5, [1, 2, 3])
    v = verify_greedy(tree, [1, 2, 3, 7])
    assert v.path == [0, 1, 2, 3] and v.tokens == [1, 2, 3, 7]  # 7 is the bonus token


def test_chain_greedy_first_rejected_still_emits_one():
    v = verify_greedy(DraftTree.chain(5, [1, 2]), [6, 2, 3])
    assert v.path == [0] and v.tokens == [6]


def test_tree_greedy_follows_matching_branch():
    #        root(5)
    #       /       \
    #    n1:1       n2:2
    #    /   \         \
    # n3:3  n4:4       n5:6
    tree = DraftTree([5, 1, 2, 3, 4, 6], [-1, 0, 0, 1, 1, 2])
    # target after root says 2, after n2 says 6, after n5 says 0
    argmax = [2, 9, 6, 9, 9, 0]
    v = verify_greedy(tree, argmax)
    assert v.path == [0, 2, 5] and v.tokens == [2, 6, 0]


def test_tree_ancestor_mask_and_depths():
    tree = DraftTree([5, 1, 2, 3, 4, 6], [-1, 0, 0, 1, 1, 2])
    assert tree.depths() == [0, 1, 1, 2, 2, 2]
    m = tree.ancestor_mask()
    assert m[5].tolist() == [True, False, True, False, False, True]
    assert m[3].tolist() == [True, True, False, True, False, False]


def test_sampling_point_mass_target_behaves_like_greedy():
    tree = DraftTree([5, 1, 2, 3], [-1, 0, 0, 1])
    probs = one_hot_rows([2, 0, 7, 0])  # after root: surely 2; after n2: surely 7
    for seed in range(5):
        v = verify_sampling(tree, probs, torch.Generator().manual_seed(seed))
        assert v.path == [0, 2] and v.tokens == [2, 7]


def test_sampling_rejected_child_is_never_the_recovered_token():
    # the target gives token 1 probability 0.5 after root; the draft proposes 1.
    # when 1 is rejected, the recovered token comes from the rest: never 1.
    tree = DraftTree.chain(5, [1])
    probs = torch.tensor([[0.0, 0.5, 0.25, 0.25, 0, 0, 0, 0], [0.0] * 7 + [1.0]])
    seen_rejections = 0
    for seed in range(200):
        v = verify_sampling(tree, probs, torch.Generator().manual_seed(seed))
        if v.path == [0]:
            seen_rejections += 1
            assert v.tokens[0] in (2, 3)
        else:
            assert v.tokens == [1, 7]
    assert 60 < seen_rejections < 140


def test_select_tree_keeps_best_by_cumulative_score():
    # candidates in level order: a(0.6) b(0.3) | a->c(0.6*0.9) a->d(0.6*0.05) b->e(0.3*0.5)
    tokens = torch.tensor([10, 11, 12, 13, 14])
    scores = torch.tensor([0.6, 0.3, 0.54, 0.03, 0.15]).log()
    parents = torch.tensor([-1, -1, 0, 0, 1])
    tree = select_tree(99, tokens, scores, parents, num_nodes=4)
    assert tree.tokens == [99, 10, 11, 12] and tree.parents == [-1, 0, 0, 1]


def test_batched_selection_equals_per_request_selection():
    from specserve.speculative.tree import select_trees

    gen = torch.Generator().manual_seed(0)
    k, steps, batch = 3, 3, 12
    sizes = [k] + [k * k] * (steps - 1)
    depths = torch.tensor([d + 1 for d, size in enumerate(sizes) for _ in range(size)])
    parents = [torch.full((batch, k), -1)]
    for d, size in enumerate(sizes[1:]):  # children of k nodes expanded among the previous level
        offset = sum(sizes[:d])
        parents.append(offset + torch.randint(0, sizes[d], (batch, k)).repeat_interleave(k, 1))
    parents = torch.cat(parents, 1)
    tokens = torch.randint(0, 50, (batch, len(depths)), generator=gen)
    step = torch.randint(-3, 1, (batch, len(depths)), generator=gen).float()  # many ties
    scores = step.clone()
    for c in range(k, len(depths)):  # cumulative: a child never scores above its parent
        scores[:, c] += scores.gather(1, parents[:, c:c + 1]).squeeze(1)
    for num_nodes in (2, 5, 8):
        trees = select_trees(list(range(batch)), tokens, scores, parents, depths, num_nodes)
        for b, tree in enumerate(trees):
            want = select_tree(b, tokens[b], scores[b], parents[b], num_nodes)
            assert (tree.tokens, tree.parents) == (want.tokens, want.parents)
            assert tree.depth == DraftTree(want.tokens, want.parents).depths()
            assert torch.equal(tree.ancestor_mask(), DraftTree(want.tokens, want.parents).ancestor_mask())
