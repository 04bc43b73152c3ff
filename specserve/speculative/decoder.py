"""The engine's one handle on speculative decoding: it owns the proposer, the controller, verification
and the step timing the controller learns from.

Each step the engine asks `choose` for the step's shape (plain decoding or a draft shape), schedules the
KV slots `num_slots` asks for, asks `draft` for the trees of the sequences that speculate, runs the target
over them and hands the logits to `accept`, which verifies every tree at once, moves the accepted tree
branches' KV into place and feeds the statistics and the controller. Every step, speculative or not,
the proposer `observe`s what the target committed; `record_step` times decode steps for the controller.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..device import to_device
from ..engine.sequence import Sequence
from ..engine.stats import SpecStats
from .batch_verify import verify_drafts
from .calibration import Calibration, calibrate
from .controller import Controller
from .eagle3_loop import LoopFlight, run_mode
from .shapes import PLAIN, Shape, candidate_shapes
from .tree import DraftTree
from .verify import Verdict

if TYPE_CHECKING:
    from ..engine.model_runner import StepTensors

log = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, config, target_arch, runner, stats: SpecStats):
        """config: the resolved EngineConfig (speculation enabled); runner: the target's ModelRunner (the
        proposer shares its KV layout, embedding and device; verification moves KV through it)."""
        from . import make_proposer, make_synthetic

        self.config = config
        self.runner = runner
        self.stats = stats
        self.synthetic = make_synthetic(config)
        if self.synthetic is not None:
            log.warning("SYNTHETIC ACCEPTANCE: drafts are accepted at rates %s (chains %s), not verified; output "
                        "text is meaningless (benchmarks only)", list(self.synthetic.rates),
                        list(self.synthetic.chain_rates))
        self.proposer = make_proposer(config, target_arch, runner, self.synthetic)
        # prices every step, or where there is a loop the steps of batches that can run in it; `off_loop` prices
        # the rest there (its steps run on the engine's step path, whose draft steps cost more than the loop's
        # that start-up measured); `active`: the one that chose the latest step
        self.controller = self._controller()
        self.off_loop: Optional[Controller] = None
        self.active = self.controller
        self._judged: tuple = ()  # the sequences `loop_mode` last judged (held, so no id of theirs is reused), and
        self._judged_mode: Optional[str] = None  # their mode
        self.forced: Optional[Shape] = None  # calibration: this shape every step, nothing learned
        self.calibration: Optional[Calibration] = None
        self.loop = None  # speculative steps in the overlap pipeline (a SpecLoop, CUDA graphs)

    def _controller(self) -> Controller:
        spec = self.config.speculative
        return Controller(spec.speculative_policy, candidate_shapes(
            spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens or 1),
            spec.speculative_disable_batch_threshold, token_budget=self.config.scheduler.max_num_batched_tokens)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose input hidden states the proposer needs."""
        return self.proposer.aux_layers

    @property
    def shapes(self) -> list[Shape]:
        """Every shape `choose` may return (the target's CUDA graphs cover each one's tokens per request)."""
        return self.controller.shapes

    def capture_graphs(self, max_bs: int) -> None:
        """Replay steady-state drafting of every shape from CUDA graphs, for batches up to max_bs (the
        engine calls this when the target's steps run in graphs)."""
        shapes = [s for s in self.shapes if s.steps > 0]
        most = self.config.model.max_model_len + max(self.num_slots(s) for s in shapes) + 1
        block = self.runner.block_size
        self.proposer.capture_graphs(shapes, max_bs, -(-most // block) + 1)
        if self.runner.ranks is None:  # under tensor parallelism every rank would need the loop's verdicts
            self.loop = self.proposer.make_loop(self.runner.graphs, self.runner.kv_cache)
        if self.loop is not None and self.controller.policy == "adaptive":
            self.off_loop = self._controller()

    def make_follower(self):
        """The proposer's follower for the target's plain-decode graphs, or None (see Proposer)."""
        return self.proposer.make_follower(self.config.scheduler.max_num_seqs)

    def calibrate(self, engine) -> None:
        """Measure every shape's step time at start-up for the adaptive controller (the engine calls this
        once it is built and idle; other policies do not need it). See speculative/calibration.py."""
        budget = self.config.speculative.speculative_calibration_s
        if self.controller.policy != "adaptive" or not budget:
            return
        self.calibration = calibrate(engine, self.shapes, budget)
        c = self.calibration
        self.controller.seed_costs(c.times, c.summary(), c.tokens, c.token_seconds, c.prompt_extra,
                                   c.prompt_token_seconds)
        if self.off_loop is not None:  # plain's times hold off the loop too; its drafts are explored live
            plain = [key for key in c.times if key[1] == PLAIN]
            tokens = {k: c.tokens[k] for k in plain if k in c.tokens}
            self.off_loop.seed_costs({k: c.times[k] for k in plain}, None, tokens, c.token_seconds)

    def choose(self, batch_size: int, prefill: Optional[Callable[[], bool]] = None,
               running: Optional[list[Sequence]] = None) -> Shape:
        """The next step's shape (prefill(): will it also compute prompt tokens? See `Controller.choose`).
        running: the running sequences; where there is a loop, `off_loop` chooses for a batch that cannot run
        in it (`run_mode`)."""
        if self.forced is not None:
            return self.forced
        off = self.off_loop is not None and running and self.loop_mode(running) is None
        self.active = self.off_loop if off else self.controller
        return self.active.choose(batch_size, prefill)

    def loop_mode(self, seqs: list[Sequence]) -> Optional[str]:
        """How a run of seqs would verify in the loop (`run_mode`; None: it cannot loop). Judged again only when
        the sequences change: `run_mode` reads every row's parameters (158 us at 256 rows on a 2-core CPU), and a
        step asks up to three times (the controller's choice, whether a run fits, its start)."""
        key = tuple(seqs)  # compared by identity
        if key != self._judged:
            self._judged, self._judged_mode = key, run_mode(seqs)
        return self._judged_mode

    def num_slots(self, shape: Shape) -> int:
        """KV slots a sequence needs past its computed prefix for a step of this shape."""
        return self.proposer.num_slots(shape)

    def drafts(self, seq: Sequence, shape: Shape) -> bool:
        """Does seq draft in a speculative step (see `Proposer.drafts`)? Every row does in a step whose shape
        is forced (calibration) and under synthetic acceptance, which accepts by rates, not by the drafts."""
        return self.forced is not None or self.synthetic is not None or self.proposer.drafts(seq, shape)

    def record_declined(self, shape: Shape, count: int) -> None:
        """count sequences of a step of this shape declined to draft (`drafts`) and decoded one token each:
        for the controller, verifies that accepted nothing (what choosing the shape made of them; the step's
        time, measured with them, is what they cost). The statistics count drafts only."""
        if self.forced is None:
            for _ in range(count):
                self.active.record_verify(shape, 0, (0, shape.steps))

    def draft(self, seqs: list[Sequence], shape: Shape) -> list[DraftTree]:
        """One tree of shape.num_nodes nodes per sequence (each has one uncomputed token)."""
        start = time.perf_counter()
        trees = self.proposer.propose(seqs, shape)
        self.stats.draft_time_s += time.perf_counter() - start
        return trees

    def accept(self, seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor, shape: Shape
               ) -> list[tuple[Verdict, Optional[list]]]:
        """Verify every tree at once against the target's logits [B, N, vocab] and move the accepted tree
        branches' KV into place (one copy); per sequence, its verdict and its tokens' logprobs (None unless
        it asked). Nothing is committed to the sequences: that is the engine's."""
        check = self.synthetic.verify_batch if self.synthetic is not None else None
        chains = shape.topk == 1
        verdicts = verify_drafts(trees, logits, [s.params for s in seqs], [None] * len(seqs), chains, check,
                                 [s.num_tokens for s in seqs], self.runner.generator)  # unseeded rows: the engine's
        if not chains:  # a chain's accepted nodes are already in place
            self._move_branches(seqs, verdicts)
        spines = [(v.num_accepted, t.size - 1) if chains else t.spine(v.path)  # a chain is its own spine
                  for t, v in zip(trees, verdicts)]
        self.record_accepted(shape, [v.num_accepted for v in verdicts], spines)
        return list(zip(verdicts, self._logprobs(seqs, verdicts, logits.flatten(0, 1))))

    def record_accepted(self, shape: Shape, accepted: list[int], spines: list[Optional[tuple[int, int]]],
                        looped: bool = False) -> None:
        """Drafts accepted per verified tree of one step, and of each tree's spine (`DraftTree.spine`; a
        chain is its own spine), for the statistics and the controller (`looped`: a step of the loop's)."""
        if self.forced is None:
            controller = self.controller if looped else self.active
            for a, spine in zip(accepted, spines):
                self.stats.record(shape.k, a)
                controller.record_verify(shape, a, spine)

    # ---- speculation in the overlap pipeline (eagle3_loop.py) ------------------------------------
    def loop_fits(self, seqs: list[Sequence], shape: Shape) -> bool:
        """Can seqs run speculative steps of this shape with the host one step behind?"""
        if self.loop is None:
            return False
        mode = self.loop_mode(seqs)
        return mode is not None and self.loop.runs(shape, len(seqs), mode)

    def loop_runs(self, shape: Shape, flight: LoopFlight) -> bool:
        """Can flight's run (its rows, its mode) go on with a step of this shape?"""
        return self.loop.runs(shape, len(flight.seqs), flight.mode)

    def start_loop(self, seqs: list[Sequence], shape: Shape) -> LoopFlight:
        """Launch the first step of a run (seqs scheduled with `num_slots(shape)` slots each)."""
        return self.loop.start(seqs, shape, self.loop_mode(seqs), self._draws(seqs, shape))

    def continue_loop(self, flight: LoopFlight, shape: Shape) -> LoopFlight:
        """Launch the next step of flight's rows, of this shape, before reading flight (KV reserved by the
        engine)."""
        return self.loop.launch(flight, shape, self._draws(flight.seqs, shape))

    def end_loop(self, seqs: list[Sequence], accepted: list[Optional[int]]) -> None:
        """The run's last step is read: hand the draft state back (see `SpecLoop.hand_back`)."""
        self.loop.hand_back(seqs, accepted)

    def _draws(self, seqs: list[Sequence], shape: Shape) -> Optional[list[tuple[int, int]]]:
        return [self.synthetic.draw(shape.topk > 1) for _ in seqs] if self.synthetic is not None else None

    def _move_branches(self, seqs: list[Sequence], verdicts: list[Verdict]) -> None:
        """Move the KV of each accepted tree branch to the positions after the prefix, all in one copy."""
        moves = [(s, [s.num_computed_tokens + p for p in v.path],
                  range(s.num_computed_tokens, s.num_computed_tokens + len(v.path)))
                 for s, v in zip(seqs, verdicts) if v.path != list(range(len(v.path)))]
        if moves:
            self.runner.move_kv(moves)

    def _logprobs(self, seqs: list[Sequence], verdicts: list[Verdict], logits: torch.Tensor) -> list:
        """Per sequence, the logprobs of its verdict's tokens (None unless it asked), from logits
        [B * N, vocab] in one call for the batch."""
        asked = [k for k, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list = [None] * len(seqs)
        if not asked:
            return result
        n = logits.shape[0] // len(seqs)
        rows = [k * n + p for k in asked for p in verdicts[k].path]
        tokens = [t for k in asked for t in verdicts[k].tokens]
        flat = self.runner.logprobs(logits[to_device(rows, torch.long, logits.device)],
                                    to_device(tokens, torch.long, logits.device),
                                    [seqs[k] for k in asked for _ in verdicts[k].tokens])
        start = 0
        for k in asked:
            result[k] = flat[start:start + len(verdicts[k].tokens)]
            start += len(verdicts[k].tokens)
        return result

    def observe(self, aux: Optional[torch.Tensor], committed: list, inputs: Optional["StepTensors"] = None) -> None:
        """What the target committed this step (see `Proposer.observe`)."""
        if committed:
            self.proposer.observe(aux, committed, inputs)

    def flush(self, seqs: list[Sequence], cached_blocks: list[int]) -> None:
        """These requests finish (see `Proposer.flush`)."""
        self.proposer.flush(seqs, cached_blocks)

    def retire(self, seqs: list[Sequence]) -> None:
        """These requests are done (see `Proposer.retire`)."""
        self.proposer.retire(seqs)

    def record_step(self, batch_size: int, shape: Shape, seconds: float, drafted: int = 0,
                    tokens: Optional[float] = None, looped: bool = False) -> None:
        """A decode-only step's wall time, for the controller (`tokens`: what it emitted, when known).
        `drafted`: sequences that speculated in it;
        a step whose draft caught up on more than a verify's worth of positions per sequence (after plain
        decoding) is not typical of its shape: the controller charges it to exploration but does not time
        it. `looped`: a step of the overlap pipeline (typical by construction)."""
        if self.forced is not None:
            return
        caught_up = self.proposer.last_catch_up if drafted and not looped else 0
        typical = caught_up <= drafted * (shape.steps + 1)
        controller = self.controller if looped else self.active
        controller.record_step(batch_size, shape if drafted else PLAIN, seconds, typical, caught_up, tokens)
