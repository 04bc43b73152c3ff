"""Speculative decoding: the engine's SpecDecoder (decoder.py), proposers, draft trees, verification, the
controller."""
from __future__ import annotations


def make_synthetic(config):
    """The synthetic acceptance the configuration asks for (benchmarks), or None."""
    from .synthetic import SyntheticAcceptance

    spec = config.speculative
    rates, chains = spec.speculative_synthetic_acceptance_rates, spec.speculative_synthetic_chain_rates
    return SyntheticAcceptance(tuple(rates), config.model.seed, tuple(chains) if chains else None) if rates else None


def make_proposer(config, target_arch, runner, synthetic=None):
    """The proposer the configuration asks for: EAGLE-3 (a draft model) or prompt lookup (NGRAM)."""
    from .eagle3_proposer import Eagle3Proposer
    from .ngram import NgramProposer
    from .ngram_history import History

    spec = config.speculative
    if spec.speculative_algorithm == "NGRAM":
        low, high, capacity = (spec.speculative_ngram_min_match_window_size,
                               spec.speculative_ngram_max_match_window_size, spec.speculative_ngram_capacity)
        return NgramProposer(low, high, History(capacity, high) if capacity else None)
    if spec.speculative_algorithm != "EAGLE3":
        raise ValueError(f"unknown speculative algorithm {spec.speculative_algorithm!r}")
    return Eagle3Proposer(spec, target_arch, runner.draft_embedding, runner.num_blocks * runner.block_size,
                          runner.block_size, runner.dtype, runner.device, runner.backend,
                          config.model.load_format, config.model.seed, synthetic)
