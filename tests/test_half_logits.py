"""The model's logits stay in its dtype (bf16 on a GPU) out of the step, the cast to fp32 left to what needs it:
sampling, the processors and verification give on bf16 logits exactly what they give on those logits cast to
fp32 first (greedy and seeded rows: the same tokens; processed logits: the same values)."""
from __future__ import annotations

import random

import torch

from specserve import SamplingParams
from specserve.layers.logits_processors import process_logits, process_tree_logits
from specserve.layers.sampler import Sampler, filtered_logits
from specserve.speculative.batch_verify import verify_batch_params

from .test_penalties import make_seq, random_params

PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5),
          SamplingParams(temperature=1.0, top_k=7, seed=6), SamplingParams(temperature=1.2, top_p=0.6, seed=7),
          SamplingParams(temperature=0.7, min_p=0.1, seed=8)]


def half_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4).to(torch.bfloat16)


def test_sampling_bf16_logits_is_sampling_their_fp32_cast():
    logits = half_logits(len(PARAMS), 300)
    positions = list(range(10, 10 + len(PARAMS)))
    for params in (PARAMS, PARAMS[:1] * 3):
        rows = logits[:len(params)]
        got = Sampler()(rows, params, None, positions[:len(params)])
        assert torch.equal(got, Sampler()(rows.float(), params, None, positions[:len(params)]))
    filtered = filtered_logits(logits, PARAMS)
    assert filtered.dtype == torch.float32 and torch.equal(filtered, filtered_logits(logits.float(), PARAMS))


def test_processors_on_bf16_logits_compute_in_fp32():
    rng, v = random.Random(1), 60
    for i in range(10):
        seqs = [make_seq([rng.randrange(v) for _ in range(5)], [rng.randrange(v) for _ in range(4)],
                         random_params(rng, v)) for _ in range(4)]
        logits = half_logits(4, v, seed=i)
        assert torch.equal(process_logits(logits, seqs).float(), process_logits(logits.float(), seqs))
        tree = half_logits(4, 3, v, seed=100 + i)
        tokens = torch.randint(0, v, (4, 3), generator=torch.Generator().manual_seed(i))
        parents = torch.tensor([[-1, 0, 1]] * 4)
        assert torch.equal(process_tree_logits(tree, seqs, tokens, parents).float(),
                           process_tree_logits(tree.float(), seqs, tokens, parents))


def test_verification_of_bf16_logits_is_that_of_their_fp32_cast():
    b, n, v = len(PARAMS), 4, 200
    logits = half_logits(b, n, v, seed=3)
    tokens = torch.randint(0, v, (b, n), generator=torch.Generator().manual_seed(4))
    tokens[:, 1:] = logits.float().argmax(-1)[:, :-1]  # drafts the greedy rows accept
    for chains, parents in ((True, torch.arange(-1, n - 1).expand(b, n)), (False, torch.tensor([[-1, 0, 0, 1]] * b))):
        args = (tokens, parents)
        got = verify_batch_params(*args, logits, PARAMS, [None] * b, chains, list(range(b)))
        want = verify_batch_params(*args, logits.float(), PARAMS, [None] * b, chains, list(range(b)))
        assert torch.equal(got.out_tokens, want.out_tokens) and torch.equal(got.accept_len, want.accept_len)
