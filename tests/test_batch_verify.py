"""Batched verification against the per-request reference (verify.py), worked examples, and the
distribution of the emitted token."""
from __future__ import annotations

import random

import torch

from specserve import SamplingParams
from specserve.speculative.batch_verify import ancestor_bits as ancestor_bits_device
from specserve.speculative.batch_verify import (
    draw_verify_random,
    path_verdict,
    sampling_probs,
    tree_accepted,
    verify_batch,
    verify_batch_params,
    verify_chains,
    verify_greedy_chains,
)
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import verify, verify_greedy, verify_sampling

from .stats import chi_square_pvalue

VOCAB = 50
PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
          SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=1.2, top_p=0.8),
          SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05), SamplingParams(temperature=0)]


def random_parents(rng: random.Random, n: int) -> list[int]:
    kind = rng.choice(["chain", "level", "any"])
    if kind == "chain":
        return [-1] + list(range(n - 1))
    parents = [rng.randrange(i) for i in range(1, n)]  # a parent precedes its child
    return [-1] + (sorted(parents) if kind == "level" else parents)


def random_batch(rng: random.Random, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, parents [B, N]: random tree shapes whose drafts are often likely under probs [B, N, V]."""
    b, n, v = probs.shape
    parents = torch.tensor([random_parents(rng, n) for _ in range(b)])  # [B, N]
    tokens = torch.randint(v, (b, n))  # [B, N]
    for r in range(b):
        for i in range(1, n):
            if rng.random() < 0.6:  # a draft the target likes
                tokens[r, i] = int(torch.multinomial(probs[r, parents[r, i]], 1))
    return tokens, parents


def trees(tokens: torch.Tensor, parents: torch.Tensor) -> list[DraftTree]:
    return [DraftTree(t, p) for t, p in zip(tokens.tolist(), parents.tolist())]


def assert_same(batched, b: int, verdict) -> None:
    k = len(verdict.path)
    assert int(batched.accept_len[b]) == verdict.num_accepted
    assert batched.path[b].tolist() == verdict.path + [-1] * (batched.path.shape[1] - k)
    assert batched.out_tokens[b].tolist() == verdict.tokens + [-1] * (batched.path.shape[1] - k)


def test_greedy_matches_reference_on_random_trees():
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(60):
        b, n = rng.randint(1, 16), rng.randint(2, 9)
        logits = torch.randn(b, n, VOCAB) * 3  # [B, N, V]
        tokens, parents = random_batch(rng, logits.softmax(-1))
        out = verify_batch(tokens, parents, logits, torch.ones(b, dtype=torch.bool))
        for r, tree in enumerate(trees(tokens, parents)):
            assert_same(out, r, verify_greedy(tree, logits[r].argmax(-1).tolist()))


def test_sampling_matches_reference_fed_the_same_random_numbers():
    rng = random.Random(1)
    torch.manual_seed(1)
    accepted = 0
    for trial in range(60):
        b, n = rng.randint(1, 16), rng.randint(2, 9)
        probs = (torch.randn(b, n, VOCAB) * 2.5).softmax(-1)  # [B, N, V]
        probs[:, :, :5] = 0  # tokens the target never says, drafted now and then
        probs /= probs.sum(-1, keepdim=True)
        tokens, parents = random_batch(rng, probs)
        seeds = [1000 * trial + r for r in range(b)]
        greedy = [False] * b
        uniforms, noise = draw_verify_random(n, VOCAB, [torch.Generator().manual_seed(s) for s in seeds], greedy, "cpu")
        out = verify_batch(tokens, parents, probs.log(), torch.zeros(b, dtype=torch.bool), probs, uniforms, noise)
        for r, tree in enumerate(trees(tokens, parents)):
            assert_same(out, r, verify_sampling(tree, probs[r], torch.Generator().manual_seed(seeds[r])))
        accepted += int(out.accept_len.sum())
    assert accepted > 100, "drafts must be accepted for the comparison to mean anything"


def test_sampling_deep_trees_with_repeated_siblings_match_the_reference_walk():
    """Trees of up to 24 nodes over 6 tokens (siblings repeat tokens, fans of up to 8 children, deep paths):
    `verify_batch` decides every node at once; the per-request walk fed the same random numbers agrees."""
    rng = random.Random(6)
    torch.manual_seed(6)
    accepted = wide = 0
    for trial in range(80):
        b, n = rng.randint(1, 8), rng.randint(2, 24)
        probs = (torch.randn(b, n, 6) * 1.5).softmax(-1)  # [B, N, 6]
        tokens, parents = random_batch(rng, probs)
        seeds = [7000 * trial + r for r in range(b)]
        uniforms, noise = draw_verify_random(n, 6, [torch.Generator().manual_seed(s) for s in seeds], [False] * b,
                                             "cpu")
        out = verify_batch(tokens, parents, probs.log(), torch.zeros(b, dtype=torch.bool), probs, uniforms, noise)
        for r, tree in enumerate(trees(tokens, parents)):
            assert_same(out, r, verify_sampling(tree, probs[r], torch.Generator().manual_seed(seeds[r])))
        accepted += int(out.accept_len.sum())
        wide += int((torch.stack([torch.bincount(row[1:], minlength=n) for row in parents]) >= 3).sum())
    assert accepted > 200 and wide > 50, "deep paths and wide fans must occur for the comparison to mean anything"


def test_mixed_greedy_and_filtered_sampling_rows_match_verify():
    rng = random.Random(2)
    torch.manual_seed(2)
    for trial in range(40):
        b, n = rng.randint(1, 16), rng.randint(2, 9)
        logits = torch.randn(b, n, VOCAB) * 3  # [B, N, V]
        params = [rng.choice(PARAMS) for _ in range(b)]
        tokens, parents = random_batch(rng, sampling_probs(logits, params))
        seeds = [rng.randrange(1 << 30) if rng.random() < 0.8 else None for _ in range(b)]
        seeds = [s if s is not None or p.greedy else 7 for s, p in zip(seeds, params)]  # sampling rows seeded
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        out = verify_batch_params(tokens, parents, logits, params, gens)
        for r, tree in enumerate(trees(tokens, parents)):
            ref_gen = None if seeds[r] is None else torch.Generator().manual_seed(seeds[r])
            assert_same(out, r, verify(tree, logits[r], params[r], ref_gen))
            if ref_gen is not None:  # the same draws taken (none for greedy rows)
                assert torch.equal(gens[r].get_state(), ref_gen.get_state())


def test_worked_examples():
    #     root(5)             chain: root(5) -> n1:1 -> n2:2 -> n3:3
    #    /       \
    # n1:1       n2:2
    #   |
    # n3:3
    tokens = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    probs = torch.zeros(2, 4, 8)
    probs[0, 0, 1:4] = torch.tensor([0.5, 0.3, 0.2])  # tree, after root
    probs[0, 2, 4:6] = torch.tensor([0.6, 0.4])  # tree, after n2
    probs[1, 0, 1], probs[1, 0, 6] = 0.9, 0.1  # chain, after root
    probs[1, 1, 2], probs[1, 1, 3] = 0.25, 0.75  # chain, after n1
    uniforms = torch.tensor([[0.7, 0.5, 0.0, 0.0], [0.3, 0.6, 0.0, 0.0]])
    noise = torch.ones(2, 8)
    noise[0, 4] = 2.0  # 0.6 / 2 < 0.4 / 1: token 5
    out = verify_batch(tokens, parents, probs.log(), torch.tensor([False, False]), probs, uniforms, noise)
    # tree: n1 rejected (0.7 >= 0.5), n2 accepted (0.5 < 0.3 / (1 - 0.5)), then the bonus token 5 after n2
    # chain: n1 accepted (0.3 < 0.9), n2 rejected (0.6 >= 0.25), recovered from what is left after n1: 3
    assert out.accept_len.tolist() == [1, 1]
    assert out.path.tolist() == [[0, 2, -1, -1], [0, 1, -1, -1]]
    assert out.out_tokens.tolist() == [[2, 5, -1, -1], [1, 3, -1, -1]]
    # greedy on test_acceptance's tree: after root the target says 2, after n2 6, after n5 0
    logits = torch.nn.functional.one_hot(torch.tensor([[2, 9, 6, 9, 9, 0]]), 10).float()
    out = verify_batch(torch.tensor([[5, 1, 2, 3, 4, 6]]), torch.tensor([[-1, 0, 0, 1, 1, 2]]), logits,
                       torch.tensor([True]))
    assert out.path.tolist() == [[0, 2, 5, -1, -1, -1]] and out.out_tokens.tolist() == [[2, 6, 0, -1, -1, -1]]


def test_worked_example_third_sibling_and_its_child():
    #        root(9)
    #     /    |    \
    #  n1:1  n2:2  n3:3      p after root: 0.5 / 0.3 / 0.15 (0.05 on token 5)
    #                |
    #              n4:4      p after n3: 0.5 (0.5 on token 6); after n4: token 7 surely
    tokens, parents = torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([[-1, 0, 0, 0, 3]])
    probs = torch.zeros(1, 5, 8)
    probs[0, 0, 1:4], probs[0, 0, 5] = torch.tensor([0.5, 0.3, 0.15]), 0.05
    probs[0, 3, 4], probs[0, 3, 6] = 0.5, 0.5
    probs[0, 4, 7] = 1.0
    uniforms = torch.tensor([[0.9, 0.9, 0.7, 0.4, 0.0]])
    out = verify_batch(tokens, parents, probs.log(), torch.tensor([False]), probs, uniforms, torch.ones(1, 8))
    # test 0: n1 rejected (0.9 >= 0.5); test 1: n2 rejected (0.9 >= 0.3 / 0.5); test 2: n3 accepted
    # (0.7 < 0.15 / 0.2, the mass left after both); test 3: n4 accepted (0.4 < 0.5); then token 7
    assert out.path.tolist() == [[0, 3, 4, -1, -1]]
    assert out.out_tokens.tolist() == [[3, 4, 7, -1, -1]]
    uniforms[0, 3] = 0.6  # n4 rejected: recovered from what is left after n3 without token 4: token 6
    out = verify_batch(tokens, parents, probs.log(), torch.tensor([False]), probs, uniforms, torch.ones(1, 8))
    assert out.path.tolist() == [[0, 3, -1, -1, -1]] and out.out_tokens.tolist() == [[3, 6, -1, -1, -1]]


def test_emitted_tokens_follow_the_target_distribution():
    # root with three children (1, 2, 3), n1 with children 4 and 1: the drafts hold most of the mass
    b, v = 20000, 6
    tokens = torch.tensor([[0, 1, 2, 3, 4, 1]]).expand(b, 6)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1]]).expand(b, 6)
    root_p = torch.tensor([0.05, 0.3, 0.25, 0.1, 0.2, 0.1])
    n1_p = torch.tensor([0.1, 0.2, 0.15, 0.05, 0.4, 0.1])
    probs = torch.ones(b, 6, v) / v
    probs[:, 0], probs[:, 1] = root_p, n1_p
    torch.manual_seed(3)
    uniforms, noise = draw_verify_random(6, v, [None] * b, [False] * b, "cpu")
    out = verify_batch(tokens, parents, probs.log(), torch.zeros(b, dtype=torch.bool), probs, uniforms, noise)
    first = out.out_tokens[:, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=v), root_p) > 1e-3
    assert chi_square_pvalue(torch.bincount(first, minlength=v), (root_p + 0.05) / 1.3) < 1e-4  # power
    second = out.out_tokens[first == 1, 1]  # first token 1 means n1 was accepted
    assert chi_square_pvalue(torch.bincount(second, minlength=v), n1_p) > 1e-3


def test_greedy_chains_are_verify_batch():
    gen = torch.Generator().manual_seed(7)
    for n in (2, 4, 6):
        b = 16
        tokens = torch.randint(0, 4, (b, n), generator=gen)  # a small vocabulary: many drafts accepted
        logits = torch.randn(b, n, 4, generator=gen)
        parents = torch.arange(-1, n - 1).expand(b, n)
        fast = verify_greedy_chains(tokens, logits)
        walk = verify_batch(tokens, parents, logits, torch.ones(b, dtype=torch.bool))
        for a, w in zip((fast.accept_len, fast.path, fast.out_tokens), (walk.accept_len, walk.path, walk.out_tokens)):
            assert torch.equal(a, w)
        assert 0 < int(fast.accept_len.sum()) < b * (n - 1)


def ancestor_bits(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int64: bit j of node i set when j is i or an ancestor of it (as `tree_bitmask` of a tree's mask)."""
    bits = torch.zeros_like(parents)
    for r, row in enumerate(parents.tolist()):
        for i in range(len(row)):
            j = i
            while j >= 0:
                bits[r, i] |= 1 << j
                j = row[j]
    return bits


def test_tree_accepted_is_verify_batch_on_greedy_rows():
    """The greedy verification of trees (`tree_accepted`, the speculative loop's) accepts the nodes
    `verify_batch` accepts, on random trees whose sibling drafts sometimes repeat a token (the first sibling
    then wins), and the verdict built from them is `verify_batch`'s."""
    rng = random.Random(3)
    torch.manual_seed(3)
    accepted = 0
    for _ in range(80):
        b, n = rng.randint(1, 12), rng.randint(2, 12)
        logits = torch.randn(b, n, 4) * 3  # a small vocabulary: siblings repeat tokens, many drafts accepted
        tokens, parents = random_batch(rng, logits.softmax(-1))
        walk = verify_batch(tokens, parents, logits, torch.ones(b, dtype=torch.bool))
        argmax = logits.argmax(-1)
        on_path = tree_accepted(tokens, parents, ancestor_bits(parents), argmax)
        want = torch.zeros(b, n + 1, dtype=torch.bool).scatter_(1, torch.where(walk.path >= 0, walk.path, n), True)
        assert torch.equal(on_path, want[:, :n])
        last = torch.where(on_path, torch.arange(n), 0).amax(1)
        fast = path_verdict(tokens, on_path, argmax.gather(1, last[:, None]).squeeze(1))
        for a, w in zip((fast.accept_len, fast.path, fast.out_tokens), (walk.accept_len, walk.path, walk.out_tokens)):
            assert torch.equal(a, w)
        accepted += int(walk.accept_len.sum())
    assert accepted > 100


def test_ancestor_bits_by_pointer_doubling():
    """`ancestor_bits` (on the device, log2 N rounds) equals the host walk up each node's parents, trees of 1-64
    nodes (bit 63 included)."""
    rng = random.Random(5)
    for n in (1, 2, 3, 8, 17, 64):
        parents = torch.tensor([random_parents(rng, n) for _ in range(6)])
        assert torch.equal(ancestor_bits_device(parents), ancestor_bits(parents))


def test_greedy_trees_in_verify_batch_params():
    """All-greedy (and seeded) batches of trees verify through `verify_greedy_trees`: `verify_batch`'s verdicts."""
    rng = random.Random(9)
    torch.manual_seed(9)
    for _ in range(30):
        b, n = rng.randint(1, 8), rng.randint(2, 10)
        logits = torch.randn(b, n, 4) * 3
        tokens, parents = random_batch(rng, logits.softmax(-1))
        fast = verify_batch_params(tokens, parents, logits, [SamplingParams(temperature=0)] * b, [None] * b)
        walk = verify_batch(tokens, parents, logits, torch.ones(b, dtype=torch.bool))
        for a, w in zip((fast.accept_len, fast.path, fast.out_tokens), (walk.accept_len, walk.path, walk.out_tokens)):
            assert torch.equal(a, w)


def test_chains_with_sampling_rows_are_verify_batch():
    """`verify_chains` (what `verify_batch_params` takes for chains with sampling rows) gives `verify_batch`'s verdict
    from the same random numbers, greedy, filtered sampling and zero-probability drafts mixed in each batch; and
    `verify_batch_params(chains=True)` matches the per-request reference fed the same generators."""
    rng = random.Random(4)
    torch.manual_seed(4)
    accepted = rejected = 0
    for trial in range(60):
        b, n = rng.randint(1, 12), rng.randint(2, 7)
        logits = torch.randn(b, n, VOCAB) * 2.5  # [B, N, V]
        logits[:, :, :3] = -float("inf")  # tokens the target never says, drafted now and then
        params = [rng.choice(PARAMS) for _ in range(b)]
        probs = sampling_probs(logits, params)
        parents = torch.arange(-1, n - 1).expand(b, n)
        tokens = torch.randint(VOCAB, (b, n))
        for r in range(b):
            for i in range(1, n):
                if rng.random() < 0.7:
                    tokens[r, i] = int(torch.multinomial(probs[r, i - 1], 1))
        greedy_rows = [p.greedy for p in params]
        greedy = torch.tensor(greedy_rows)
        uniforms, noise = draw_verify_random(n, VOCAB, [None] * b, greedy_rows, "cpu")
        fast = verify_chains(tokens, logits, greedy, probs, uniforms, noise)
        walk = verify_batch(tokens, parents, logits, greedy, probs, uniforms, noise)
        for a, w in zip((fast.accept_len, fast.path, fast.out_tokens), (walk.accept_len, walk.path, walk.out_tokens)):
            assert torch.equal(a, w)
        accepted += int(walk.accept_len.sum())
        rejected += int((walk.accept_len < n - 1).sum())
        seeds = [rng.randrange(1 << 30) for _ in range(b)]
        out = verify_batch_params(tokens, parents, logits, params, [torch.Generator().manual_seed(s) for s in seeds],
                                  chains=True)
        for r, tree in enumerate(trees(tokens, parents)):
            assert_same(out, r, verify(tree, logits[r], params[r], torch.Generator().manual_seed(seeds[r])))
    assert accepted > 100 and rejected > 50


def test_the_loops_filtered_distributions_are_the_step_paths():
    """The loop's sampling graphs filter every row from its parameter row (`row_params`; a row without a
    filter passes the filter's no-op value) and get, bit for bit, what `sampling_probs` gives the step path from
    the requests' params: FILTERED runs (any mix of filters), SAMPLED runs (temperature alone)."""
    from specserve.speculative.eagle3_loop import FILTERED, SAMPLED, filtered_rows, row_params

    def filtered_probs(logits, rows, mode):  # [B, N, V], as the loop's _sampling computes them
        return filtered_rows(logits, rows, mode).softmax(-1).view(logits.shape)

    rng = random.Random(5)
    for trial in range(40):
        b, n = rng.randint(1, 9), rng.randint(1, 5)
        logits = torch.randn(b, n, VOCAB) * 3  # [B, N, V]
        logits[:, :, :2] = -float("inf")
        params = [rng.choice(PARAMS) for _ in range(b)]
        rows = row_params(params, b + 3)[0][:, :b]  # [6, B] (padding rows cut)
        assert torch.equal(filtered_probs(logits, rows, FILTERED), sampling_probs(logits, params))
        params = [p if p.top_k <= 0 and p.top_p == 1 and p.min_p == 0 else PARAMS[1] for p in params]
        rows = row_params(params, b)[0]
        assert torch.equal(filtered_probs(logits, rows, SAMPLED), sampling_probs(logits, params))


def test_the_loops_seeded_rows_take_the_step_paths_samples():
    """In the loop's FILTERED runs a seeded row's token after each node is its seeded sample (`seeded_argmax`
    from `row_params`' rows and seeds, at each node's position + 1), bit for bit what the step path's
    `seeded_targets` draws for it; the other rows keep the argmax. Chains and trees (nodes at their depths)."""
    from specserve.speculative.batch_verify import seeded_targets
    from specserve.speculative.eagle3_loop import FILTERED, filtered_rows, row_params, seeded_argmax

    seeded = [SamplingParams(temperature=0.7, seed=11), SamplingParams(temperature=1.3, top_k=7, seed=2**63 + 5),
              SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, seed=-4)]
    rng = random.Random(6)
    for trial in range(30):
        b, n = rng.randint(1, 7), rng.randint(1, 5)
        logits = torch.randn(b, n, VOCAB) * 3  # [B, N, V]
        params = [rng.choice(PARAMS + seeded) for _ in range(b)]
        starts = torch.tensor([rng.randint(3, 500) for _ in range(b)])  # [B] the root's sequence index
        depths = torch.stack([torch.tensor(sorted(rng.randint(1, d) if d else 0 for d in range(n)))
                              for _ in range(b)])  # [B, N] node depths (a tree's, or a chain's 0..n-1)
        rows, seeds = row_params(params, b + 2)
        argmax = logits.argmax(-1)
        got = seeded_argmax(filtered_rows(logits, rows[:, :b], FILTERED), rows[:, :b], seeds[:b],
                            (starts[:, None] + depths).view(-1) + 1, argmax)
        for i, p in enumerate(params):
            want = argmax[i] if p.seed is None or p.greedy else seeded_targets(
                logits[i:i + 1], [p], starts[i:i + 1] + 1, depths[i:i + 1])[0]
            assert torch.equal(got[i], want), (trial, i, p)


def test_which_runs_the_loop_takes():
    """`run_mode`: a run of greedy rows is GREEDY; one sampling row by temperature makes it SAMPLED, one asking
    top-k, top-p or min-p, or seeded, FILTERED; logprobs, penalties, a grammar or an adapter keep it off the
    loop (None)."""
    from specserve.engine.sequence import Sequence
    from specserve.speculative.eagle3_loop import FILTERED, GREEDY, SAMPLED, run_mode

    def seq(lora=0, **params):
        return Sequence("r", [1, 2], SamplingParams(**params), set(), 64, None, lora=lora)

    greedy = seq(temperature=0)
    assert run_mode([greedy, seq(temperature=0, top_p=0.5)]) == GREEDY  # greedy rows ignore filters
    assert run_mode([greedy, seq(temperature=0.8)]) == SAMPLED
    assert run_mode([greedy, seq(temperature=0, seed=3)]) == GREEDY  # a greedy row's seed draws nothing
    for filtered in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(seed=3)):
        assert run_mode([seq(temperature=0.8), greedy, seq(temperature=1.0, **filtered)]) == FILTERED
    for off in (dict(temperature=0, logprobs=1), dict(temperature=0.8,
                presence_penalty=0.5), dict(temperature=0, logit_bias={3: 1.0}), dict(temperature=0, lora=1)):
        assert run_mode([greedy, seq(**off)]) is None, off
