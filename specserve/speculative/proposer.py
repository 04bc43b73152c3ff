"""The proposer interface: what the engine asks of any draft method."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional, Protocol, Union

import torch

from ..engine.sequence import Sequence
from .shapes import Shape
from .tree import DraftTree

if TYPE_CHECKING:
    from ..engine.model_runner import StepTensors


class Follower(Protocol):
    """Runs inside the target's plain-decode CUDA graphs (one token per sequence): `store_previous` beside
    the model (on a second stream: it may not read the step's outputs), `keep` after it."""

    def before_step(self, seqs: list[Sequence]) -> None:
        """Host, before a plain-decode graph replays for seqs."""

    def store_previous(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       rows: torch.Tensor) -> None:
        """Captured: ids, positions, slots [bs] the step's tokens, their positions and KV slots (the scratch
        slot on padding rows); rows [bs] the request indices (max_num_seqs on padding rows)."""

    def keep(self, aux: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> None:
        """Captured, after the model and store_previous: aux [bs, aux_dim] the step's auxiliary hidden
        states; tables [bs, max_blocks]."""


class Proposer(ABC):
    """Proposes draft trees for running requests and follows the target's accepted tokens.

    The engine knows only this interface: how many KV slots drafting a given shape needs past the
    computed prefix (`num_slots`), which target layers' input hidden states to hand over
    (`aux_layers`, empty when the method needs none), and the calls below. A verify of shape s takes
    s.num_nodes tokens per request, root included. Per-request state lives in `seq.draft_state`, which
    preemption clears; steps without speculation still `observe`, so drafting can resume at any step.
    """

    aux_layers: tuple[int, ...] = ()
    last_catch_up: int = 0  # positions the latest propose() caught up on (1 per request in steady state)

    @abstractmethod
    def num_slots(self, shape: Shape) -> int: ...

    @abstractmethod
    def propose(self, seqs: list[Sequence], shape: Shape) -> list[DraftTree]:
        """One draft tree of exactly shape.num_nodes nodes per sequence (each has one uncomputed token)."""

    def drafts(self, seq: Sequence, shape: Shape) -> bool:
        """Has seq (one uncomputed token) anything worth drafting in a step of this shape? False: it decodes
        its one token beside the sequences that verify drafts (a method whose drafts are lookups, when the
        lookup finds nothing)."""
        return True

    def info(self) -> dict:
        """What the proposer keeps, for /server_info."""
        return {}

    def retire(self, seqs: list[Sequence]) -> None:
        """These requests finished: a method that learns across requests keeps what they said."""

    @abstractmethod
    def observe(self, aux: Optional[torch.Tensor], committed: list[tuple[Sequence, Union[range, list[int]]]],
                inputs: Optional["StepTensors"] = None) -> None:
        """The target committed the KV of these sequences' next positions, once per step: aux
        [num_tokens, aux_dim] holds the step's auxiliary hidden states (empty aux_dim when aux_layers is
        empty) and, per sequence, the rows of its committed positions in position order; aux is None
        after a plain-decode graph that ran the proposer's follower. inputs: the step's tokens, positions
        and KV slots on the device when it ran eagerly (row for row with aux). The first observe of a
        request that started on cached blocks comes with num_computed_tokens past them: the proposer's
        state for those blocks comes from the cache."""

    def make_follower(self, max_seqs: int) -> Optional["Follower"]:
        """What the target's plain-decode CUDA graphs run after the model so that this proposer keeps up
        with plain decoding on the device (max_seqs: request indices run below it); None: it observes the
        auxiliary hidden states of every step instead."""
        return None

    def capture_graphs(self, shapes: list[Shape], max_bs: int, max_blocks: int) -> None:
        """Capture drafting of these shapes for batches up to max_bs in CUDA graphs (max_blocks: the
        longest block table a sequence can have); a proposer that cannot drafts eagerly."""

    def make_loop(self, target_graphs, kv_cache: torch.Tensor):
        """After `capture_graphs`: whole speculative steps captured with the target's graphs
        (target_graphs, a GraphRunner; kv_cache the target's), for the overlap pipeline (a SpecLoop,
        speculative/eagle3_loop.py), or None: speculative steps then run one at a time."""
        return None

    # ---- prefix caching: the draft's state follows the target's blocks --------------------------
    def cached_tokens(self, seq: Sequence) -> int:
        """How many of seq's leading positions have final draft-side state in the cache (its KV slots,
        per-block tensors), so that blocks within them may be shared with later requests."""
        return seq.num_computed_tokens

    def flush(self, seqs: list[Sequence], cached_blocks: list[int]) -> None:
        """These requests are about to release their blocks: bring the draft-side state of their complete
        blocks up to date (what plain-decoding steps skipped), so the prefix cache can keep them; the
        first cached_blocks[i] blocks of seqs[i] the cache holds already (their content is cached)."""

    def cache_planes(self) -> list[torch.Tensor]:
        """The proposer's tensors indexed by block id, viewed block-first ([num_blocks, ...]): what a
        block's copy in the host pool must hold besides the target's KV."""
        return []
