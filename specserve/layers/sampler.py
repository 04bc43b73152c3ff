"""Turning logits into tokens, per request: greedy, temperature, top-k, top-p, min-p, seeds, logprobs."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..device import to_device
from ..sampling_params import SamplingParams


def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k, then top-p, then min-p set to -inf.

    logits [n, vocab] fp32, one row per params entry (rows with temperature 0 are left unscaled).
    The distribution softmax(filtered_logits) is the one sampling draws from; speculative verification
    uses the same function so that it accepts against exactly this distribution.
    """
    device = logits.device
    temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, device)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k):
        k = to_device(top_k, torch.long, device).unsqueeze(1)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], torch.float32, device).unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # the first token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def exponential_noise(shape: tuple[int, int], generators: Sequence[Optional[torch.Generator]],
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise [n, vocab]; rows with their own generator (a seeded request) draw from it."""
    noise = torch.empty(shape, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return noise


def sample_from_logits(logits: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """Draw one token per row from softmax(logits): argmax(p / E) with E ~ Exp(1) is an exact sample."""
    probs = logits.softmax(-1)
    noise = exponential_noise(tuple(probs.shape), generators, probs.device)
    return (probs / noise).argmax(-1)


class Sampler:
    """Samples one token per row. Greedy rows take the argmax of the raw logits."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
        # logits [n, vocab] -> tokens [n]
        logits = logits.float()
        tokens = logits.argmax(-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = to_device(random_rows, torch.long, logits.device)
            sub_params = [params[i] for i in random_rows]
            sampled = sample_from_logits(filtered_logits(logits[rows], sub_params),
                                         [generators[i] for i in random_rows])
            tokens[rows] = sampled
        return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (of the model's raw distribution) of the chosen tokens and the top alternatives.

    Returns chosen [n], top_ids [n, num_top], top_logprobs [n, num_top].
    """
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = logp.topk(num_top, dim=-1) if num_top > 0 else None
    if top is None:
        empty = torch.empty(logp.shape[0], 0, device=logp.device)
        return chosen, empty.long(), empty
    return chosen, top.indices, top.values
