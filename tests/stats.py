"""Goodness-of-fit helpers for sampling tests."""
from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of observed counts against probabilities; bins with small expected
    counts are pooled. Returns the p-value."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a token with zero probability was observed
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampling should follow, computed independently of specserve's sampler."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    if top_k > 0:  # keep the k most likely, renormalise
        p = torch.zeros_like(p).scatter(0, order[:top_k], p[order[:top_k]])
        p = p / p.sum()
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for tok in order.tolist():  # then the smallest set whose mass reaches top_p
        if mass >= top_p or p[tok] == 0:
            break
        keep[tok] = True
        mass += p[tok].item()
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum()
    if min_p > 0:
        q = torch.where(q >= min_p * q.max(), q, torch.zeros_like(q))
        q = q / q.sum()
    return q
