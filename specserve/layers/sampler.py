"""Turning logits into tokens, per request: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Seeded requests (`SamplingParams.seed`) sample by Gumbel-max with counter-based noise: the token at
absolute sequence index t (prompt tokens count: a request's first output token has t = prompt length)
is argmax_x(filtered_logits[x] + G(seed, t, x)), where G is Gumbel noise that is a pure function of
(seed, t, x): a splitmix64 hash turned into a uniform u in (0, 1), then -log(-log u). argmax of the
logits plus independent Gumbel noise is an exact sample of softmax(logits), so a seeded request samples
the same distribution as any other; and since the noise depends on nothing else (not the batch, not the
step, not the device's generator state), the token drawn at index t is the same whether a plain step
or a speculative verify draws it (see speculative/batch_verify.py), in any batch, after preemption.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..device import to_device
from ..sampling_params import SamplingParams
from . import triton_ops

# splitmix64 (Steele, Lea, Flood 2014) constants as signed int64: torch's int64 arithmetic wraps mod 2^64
_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: a negative value would shift in ones)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (bits as uint64), the same on every device."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [n, vocab] float64: row i is G(seeds[i], positions[i], x) for every token x.

    seeds, positions [n] int64. Each row starts a splitmix64 stream at state mix(mix(seed) + position)
    and takes its outputs 1..vocab, one per token id; the top 52 bits make u = (k + 1/2) / 2^52, strictly
    inside (0, 1), and G = -log(-log u) lies in [-3.6, 36.7]. Integer steps only, then two float64 logs:
    the same bits on CPU and CUDA up to the last ulp of the logs.
    """
    row = splitmix64(splitmix64(seeds) + positions)  # [n] a state per (seed, position)
    step = torch.arange(1, vocab + 1, dtype=torch.long, device=seeds.device) * GAMMA  # [V]
    bits = splitmix64(row[:, None] + step)  # [n, V]
    u = (_shr(bits, 12).double() + 0.5) * 2.0 ** -52
    return -torch.log(-torch.log(u))


def seed_values(params: Sequence[SamplingParams]) -> list[int]:
    """The int64 seed of each params (any Python int, taken mod 2^64; 0 where unseeded)."""
    return [0 if p.seed is None else _signed(p.seed) for p in params]


def seed_tensor(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    """[n] int64 seeds of seeded params."""
    return to_device(seed_values(params), torch.long, device)


def seeded_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], positions: torch.Tensor) -> torch.Tensor:
    """The seeded sample of each row [n]: argmax(filtered_logits + gumbel_noise(seed, position)).

    logits [n, vocab] fp32, params [n] (each with a seed), positions [n] long: the absolute sequence
    index of the token each row draws."""
    return gumbel_tokens(filtered_logits(logits, params), seed_tensor(params, logits.device), positions)


def gumbel_tokens(filtered: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n] argmax(filtered + gumbel_noise(seeds, positions)) of filtered [n, vocab] fp32 (-inf outside the
    filters), seeds and positions [n] int64, nothing read on the host. On CUDA one fused kernel
    (`triton_ops.gumbel_argmax`), which with rows [n] bool computes only those rows (the others' tokens are
    then undefined)."""
    if triton_ops.triton is not None and filtered.is_cuda:  # not use_triton: sampling runs with grad enabled
        return triton_ops.gumbel_argmax(filtered, seeds, positions, rows)
    noise = gumbel_noise(seeds, positions, filtered.shape[-1])  # [n, V] float64
    return (filtered.double() + noise).argmax(-1)


def filtered_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k, then top-p, then min-p set to -inf.

    logits [n, vocab] (any float dtype; the result is fp32), one row per params entry (greedy rows,
    temperature < 1e-5, are left unscaled).
    The distribution softmax(filtered_logits) is the one sampling draws from; speculative verification
    uses the same function so that it accepts against exactly this distribution. Each row is filtered
    by its own params only: what other rows of the batch ask for changes nothing in it.
    """
    device = logits.device
    temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, device)
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    k = to_device(top_k, torch.long, device) if any(k < vocab for k in top_k) else None
    top_p = to_device([p.top_p for p in params], torch.float32, device) if any(p.top_p < 1 for p in params) else None
    min_p = to_device([p.min_p for p in params], torch.float32, device) if any(p.min_p > 0 for p in params) else None
    return filter_logits(logits, temps, k, top_p, min_p)


def filter_logits(logits: torch.Tensor, temps: torch.Tensor, top_k: Optional[torch.Tensor] = None,
                  top_p: Optional[torch.Tensor] = None, min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`filtered_logits` from device tensors, nothing read on the host (CUDA graphs capture it): logits
    [n, vocab]; per row temps [n] (1 for greedy rows), top_k [n] (vocab: off), top_p [n] (1: off), min_p [n]
    (0: off); a filter passed as None is off for every row."""
    logits = logits.float() / temps.unsqueeze(1)
    if top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values.gather(1, top_k.unsqueeze(1) - 1)  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        top_p = top_p.unsqueeze(1)  # [n, 1]
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = (before >= top_p) & (top_p < 1)  # top_p 1 keeps all
        drop_sorted[:, 0] = False  # the most likely token is always kept (top_p 1e-300 is 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def exponential_noise(shape: tuple[int, int], generators: Sequence[Optional[torch.Generator]],
                      device: torch.device, default: Optional[torch.Generator] = None) -> torch.Tensor:
    """Exp(1) noise [n, vocab]; rows with their own generator draw from it, the others from `default` (the
    engine's; None: the global RNG)."""
    noise = torch.empty(shape, device=device).exponential_(generator=default)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return noise


def sample_from_logits(logits: torch.Tensor, generators: Sequence[Optional[torch.Generator]],
                       default: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits): argmax(p / E) with E ~ Exp(1) is an exact sample."""
    probs = logits.softmax(-1)
    noise = exponential_noise(tuple(probs.shape), generators, probs.device, default)
    return (probs / noise).argmax(-1)


Positions = Union[Sequence[int], torch.Tensor]


class Sampler:
    """Samples one token per row. Greedy rows take the argmax of the raw logits; seeded rows the
    Gumbel-max sample keyed by (seed, position) (`seeded_tokens`); other rows draw Exp(1) noise from
    their generator, or where it is None from the sampler's (the engine's: `ModelRunner.generator`; None: the
    global RNG)."""

    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Optional[Sequence[Optional[torch.Generator]]] = None,
                 positions: Optional[Positions] = None) -> torch.Tensor:
        # logits [n, vocab] -> tokens [n]; positions [n]: the absolute sequence index of the token each
        # row draws (needed when a row is seeded)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        unseeded = [i for i in random_rows if params[i].seed is None]
        if params and len(unseeded) == len(params):  # every row samples unseeded: no rows to pick out or put back
            gens = list(generators) if generators is not None else [None] * len(params)
            return sample_from_logits(filtered_logits(logits, params), gens, self.generator)
        tokens = logits.argmax(-1)  # the same as its fp32 copy's (the cast keeps order): all-greedy steps skip it
        if not random_rows:
            return tokens
        logits = logits.float()
        device = logits.device
        seeded = [i for i in random_rows if params[i].seed is not None]
        if seeded:
            if positions is None:
                raise ValueError("seeded sampling needs the position of each row's token")
            rows = to_device(seeded, torch.long, device)
            pos = to_device(positions, torch.long, device)[rows]
            tokens[rows] = seeded_tokens(logits[rows], [params[i] for i in seeded], pos)
        if unseeded:
            rows = to_device(unseeded, torch.long, device)
            gens = [generators[i] if generators is not None else None for i in unseeded]
            filtered = filtered_logits(logits[rows], [params[i] for i in unseeded])
            tokens[rows] = sample_from_logits(filtered, gens, self.generator)
        return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (of the model's raw distribution) of the chosen tokens and the top alternatives.

    Returns chosen [n], top_ids [n, num_top], top_logprobs [n, num_top].
    """
    return _token_logprobs(logits.float().log_softmax(-1), tokens, num_top)


def ranked_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_logprobs` and each chosen token's rank [n] (1 + the tokens more likely than it)."""
    logp = logits.float().log_softmax(-1)
    chosen, top_ids, top_lp = _token_logprobs(logp, tokens, num_top)
    return chosen, top_ids, top_lp, (logp > chosen.unsqueeze(1)).sum(-1) + 1


def _token_logprobs(logp: torch.Tensor, tokens: torch.Tensor, num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top = logp.topk(num_top, dim=-1) if num_top > 0 else None
    if top is None:
        empty = torch.empty(logp.shape[0], 0, device=logp.device)
        return chosen, empty.long(), empty
    return chosen, top.indices, top.values
