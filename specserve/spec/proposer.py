"""The proposer interface: what the engine asks of any draft method."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..engine.sequence import Sequence
from .tree import DraftTree


class Proposer(ABC):
    """Proposes draft trees for running requests and follows the target's accepted tokens.

    The engine knows only this interface: how many tokens a verify takes (`num_verify_tokens`, root
    included), how many KV slots drafting needs past the computed prefix (`num_slots`), which target
    layers' input hidden states to hand over (`aux_layers`, empty when the method needs none), and the
    three calls below. Per-request state lives in `seq.draft_state`, which preemption clears.
    """

    aux_layers: tuple[int, ...] = ()

    @property
    @abstractmethod
    def num_verify_tokens(self) -> int: ...

    @property
    @abstractmethod
    def num_slots(self) -> int: ...

    @abstractmethod
    def propose(self, seqs: list[Sequence]) -> list[DraftTree]:
        """One draft tree of exactly num_verify_tokens nodes per sequence (each has one uncomputed token)."""

    @abstractmethod
    def observe(self, seq: Sequence, features: torch.Tensor) -> None:
        """The target committed the KV of seq's next positions; features [n, aux_dim] are their
        auxiliary hidden states, in position order (empty aux_dim when aux_layers is empty)."""
