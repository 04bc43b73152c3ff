"""Step costs measured before the first request, for the adaptive controller.

At start-up the engine runs dummy requests (random prompts, greedy, no stop) through its real step:
for each batch size 1, 2, 4, ... up to max_num_seqs (as far as the KV pool holds them and the time
budget `speculative_calibration_s` lasts; larger batches are priced from the largest measured one's
cost ratios, see `Controller._cost`), timed steps of each shape the controller may pick, interleaved
between the shapes. CUDA graphs are captured before, so a step here is what a live step costs: graph
replays plus the host's work. Then, per draft shape, what its step costs over a plain one when it also
prefills a new request's prompt (`prompt_extra`): windows of steps opened by such a step in the shape
and in plain (a step with a prompt runs synchronously, from a mixed CUDA graph where it fits one, and its
verify tokens add compute to a step the prompt made compute-bound, so its price is not a decode-only step's).
The requests are aborted and the engine's counters restored afterwards; only the tables remain
(`Controller.seed_costs`).
Acceptance is not measured here: random prompts say nothing about the workload's, which the controller
learns online.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import random
import statistics
import time
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams
from .shapes import PLAIN, Shape
from .synthetic import SyntheticAcceptance

log = logging.getLogger(__name__)

WINDOW = 3  # steps in an arrival's window (`_arrival`); one more settles the batch after it


@dataclass
class Calibration:
    """Per (batch size, shape), the wall times of its timed steps and the tokens each emitted; the host
    time per emitted token; and what the measurement cost."""

    times: dict[tuple[int, Shape], list[float]] = field(default_factory=dict)
    tokens: dict[tuple[int, Shape], list[int]] = field(default_factory=dict)
    # per (batch size, draft shape): seconds its step with a prompt of `prompt_tokens[batch size]` tokens
    # costs over a plain step with it (`_prompt_extra`)
    prompt_extra: dict[tuple[int, Shape], list[float]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    prompt_token_seconds: float = 0.0  # what a prompt token costs: an arrival's window over plain steps
    token_seconds: float = 0.0
    # per batch size: (seconds, tokens) of the longest chain's steps accepting nothing, and everything
    token_steps: dict[int, tuple[list, list]] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole measurement, prefill of the dummy requests included

    def summary(self) -> dict:
        """{batch size: {shape label: median ms}}, ms per emitted token and the time it took, for /server_info."""
        table: dict = {}
        for (n, shape), ts in sorted(self.times.items(), key=lambda kv: (kv[0][0], kv[0][1].num_nodes)):
            table.setdefault(n, {})[shape.label] = round(statistics.median(ts) * 1e3, 3)
        prompt: dict = {}
        for (n, shape), ts in sorted(self.prompt_extra.items(), key=lambda kv: (kv[0][0], kv[0][1].num_nodes)):
            prompt.setdefault(n, {"tokens": self.prompt_tokens[n]})[shape.label] = round(statistics.median(ts) * 1e3, 3)
        return {"seconds": round(self.seconds, 2), "step_ms": table, "prompt_extra_ms": prompt,
                "prompt_token_us": round(self.prompt_token_seconds * 1e6, 3),
                "token_ms": round(self.token_seconds * 1e3, 4)}

    def fit_token_seconds(self) -> None:
        """Host seconds per emitted token: the extra time of the steps that accepted every draft over those
        that accepted none, per extra token, summed over the batch sizes (the largest weigh most)."""
        extra_time = extra_tokens = 0.0
        for none, every in self.token_steps.values():
            if none[0] and every[0]:
                extra_time += statistics.median(every[0]) - statistics.median(none[0])
                extra_tokens += statistics.median(every[1]) - statistics.median(none[1])
        self.token_seconds = max(0.0, extra_time / extra_tokens) if extra_tokens > 0 else 0.0


def batch_sizes(max_num_seqs: int, fits: int) -> list[int]:
    """Powers of two up to max_num_seqs (and max_num_seqs itself), as far as `fits` requests fit."""
    top = min(max_num_seqs, fits)
    sizes, n = [], 1
    while n < top:
        sizes.append(n)
        n *= 2
    return sizes + [top] if top >= 1 else sizes


def _arrival_tokens(engine) -> int:
    """The most tokens a step with an arriving prompt computes here: the step's token budget, or the largest
    mixed CUDA graph's tokens, which serve most prompts as they arrive (a step past them runs eagerly: on the
    H200 a step of the 8B shape with a prompt and chain-3 verifies at C = 5 took ~127 ms eagerly, ~24 graphed)."""
    budget = engine.config.scheduler.max_num_batched_tokens
    graphs = engine.runner.graphs
    mixed = max(graphs.mixed_tokens, default=0) if graphs is not None else 0
    return min(budget, mixed) if mixed else budget


def calibrate(engine, shapes: list[Shape], budget_s: float, prompt_len: int = 64, rounds: int = 2, warmup: int = 2,
              timed: int = 3, arriving_len: int = 512, prompt_timed: int = 3) -> Calibration:
    """Time `rounds` x `timed` steps of every shape at the batch sizes of `batch_sizes` in turn, each run
    after `warmup` untimed steps (the switch from the shape before; for plain decoding the overlap pipeline
    fills in two steps, the first one's time read in the second), with dummy requests of `prompt_len`
    random tokens, as long as the next size (guessed to take twice the last) fits in `budget_s` seconds
    (the first size always gets one round, a further one only where it fits). At batch size 4 it also
    times the longest chain accepting nothing and everything (synthetic verdicts), for the host time per
    emitted token. Then, with what is left of the budget and from the
    smallest size again, `prompt_timed` times per draft shape what its step with a prompt of up to
    `arriving_len` tokens costs over a plain one (`_prompt_extra`; the prompt cut to what the step's tokens
    leave in the largest mixed graph, `_arrival_tokens`; skipped where that is under 64 tokens or no request
    more fits). The engine must be idle; it is idle again afterwards."""
    start = time.perf_counter()
    saved = copy.deepcopy(engine.stats)
    spec = engine.spec
    synthetic = spec.synthetic
    result = Calibration()
    chain = max((s for s in shapes if s.topk == 1 and s.steps), key=lambda s: s.steps, default=None)
    steps_per_size = rounds * (warmup + timed) * (len(shapes) + (2 if chain else 0))
    most_nodes = max(s.num_nodes for s in shapes)
    slots = spec.num_slots(shapes[-1])
    decode_need = (warmup + timed) * most_nodes + slots  # tokens one `_timed_steps` may add to a request
    prompt_need = (warmup + prompt_timed * 2 * (WINDOW + 1)) * most_nodes + slots  # and one `_prompt_extra`
    max_len = engine.config.model.max_model_len
    longest = min(max_len - 1, prompt_len + steps_per_size * most_nodes + slots + 1)  # a dummy's cap
    prompt_len = max(1, min(prompt_len, longest - decode_need))
    arriving_len = min(arriving_len, max_len - 1 - slots - (WINDOW + 1) * most_nodes)
    block = engine.config.cache.block_size
    room = int(0.8 * engine.blocks.num_free_blocks) - -(-(arriving_len + 8 * most_nodes) // block)  # the arrival
    dummies = _Dummies(engine, prompt_len, max_len, cap=longest)
    try:
        sizes = batch_sizes(engine.config.scheduler.max_num_seqs, room // -(-longest // block))
        token_size = sizes[min(2, len(sizes) - 1)] if sizes else 0  # batch 4: enough tokens, cheap steps

        def decode_steps(n: int) -> None:
            began = time.perf_counter()
            for r in range(rounds):  # shapes interleaved: a burst of load does not land on one shape alone
                now = time.perf_counter()
                if r and now - start + (now - began) / r > budget_s:  # one round at least; more if they fit
                    break
                for shape in shapes:
                    dummies.grow(n, decode_need)
                    times, tokens = _timed_steps(engine, shape, warmup, timed)
                    result.times.setdefault((n, shape), []).extend(times)
                    result.tokens.setdefault((n, shape), []).extend(tokens)
                if chain is not None and n == token_size:  # host time per emitted token: the chain accepting 0, all
                    runs = result.token_steps.setdefault(n, (([], []), ([], [])))
                    for rate, (times, tokens) in zip((0.0, 1.0), runs):
                        dummies.grow(n, decode_need)
                        spec.synthetic = SyntheticAcceptance((rate,) * chain.steps)
                        for values, got in zip((times, tokens), _timed_steps(engine, chain, warmup, timed)):
                            values.extend(got)
                        spec.synthetic = synthetic

        measured = _within_budget(dummies, sizes, start, budget_s, decode_steps)
        result.fit_token_seconds()
        dummies.abort()
        arriving = {n: min(arriving_len, _arrival_tokens(engine) - n * most_nodes)
                    for n in measured if n < engine.config.scheduler.max_num_seqs}
        arriving = {n: a for n, a in arriving.items() if a >= 64 and longest - prompt_len >= prompt_need}

        drafts = [s for s in shapes if s.steps]

        def prompt_steps(n: int) -> None:
            result.prompt_tokens[n] = arriving[n]
            for shape in drafts:
                dummies.grow(n, prompt_need)
                result.prompt_extra[(n, shape)] = _prompt_extra(engine, shape, warmup, prompt_timed, dummies.rng,
                                                                arriving[n], most_nodes)

        def first_arrival(n: int) -> float:
            """One plain arrival window at the first size: what a prompt token costs (the window over as many
            plain steps), and the guess of this size's prompt pass (as many windows, settling included). An
            untimed arrival of each kind goes first: the first prefill of a length compiles kernels (Triton's
            JIT took ~0.7 s on the H200), which would price every prompt token at a millisecond."""
            dummies.grow(n, prompt_need)
            for shape in (PLAIN, *drafts):
                _arrival(engine, dummies.rng, arriving[n], most_nodes, shape, shape)
            dummies.grow(n, prompt_need)
            once = _arrival(engine, dummies.rng, arriving[n], most_nodes, PLAIN, PLAIN)
            plain = WINDOW * statistics.median(result.times[(n, PLAIN)])
            result.prompt_token_seconds = max(0.0, once - plain) / arriving[n]
            return 2.5 * len(drafts) * prompt_timed * once  # two windows a time, and the settling steps

        _within_budget(dummies, sorted(arriving), start, budget_s, prompt_steps, first_guess=first_arrival)
    finally:
        spec.forced, spec.synthetic = None, synthetic
        dummies.abort()
        _restore(engine.stats, saved)
    result.seconds = time.perf_counter() - start
    log.info("speculation: step costs of %d shapes at batch sizes %s (a prompt beside: %s) measured in %.1f s",
             len(shapes), sorted({n for n, _ in result.times}), sorted(result.prompt_tokens), result.seconds)
    return result


class _Dummies:
    """The calibration's dummy requests: random prompts, greedy, no stop, none longer than `cap` tokens (the KV
    the calibration reserved for each)."""

    def __init__(self, engine, prompt_len: int, max_len: int, cap: int):
        self.engine, self.prompt_len, self.cap, self.seqs = engine, prompt_len, cap, []
        self.rng = random.Random(0)
        self.params = SamplingParams(temperature=0, max_tokens=max_len - prompt_len, ignore_eos=True)
        self.made = 0

    def grow(self, n: int, need: int = 0) -> None:
        """n requests running, their prompts computed, each with room for `need` more tokens under the cap: a
        request that finished (it reached max_model_len) or has less room is aborted and replaced by a fresh
        one, so a measurement at batch size n runs n requests throughout."""
        engine = self.engine
        for seq in self.seqs:
            if seq.num_tokens + need > self.cap:
                engine.abort(seq.request_id)
        self.seqs = [seq for seq in self.seqs if not seq.finished]
        while len(self.seqs) < n:
            prompt = [self.rng.randrange(engine.arch.vocab_size) for _ in range(self.prompt_len)]
            self.seqs.append(engine.add_request(prompt, self.params, request_id=f"calibration-{self.made}"))
            self.made += 1
        engine.spec.forced = PLAIN
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in self.seqs):
            engine.step()

    def abort(self) -> None:
        """None left, the engine idle."""
        for seq in self.seqs:
            self.engine.abort(seq.request_id)
        self.seqs = []
        while self.engine.has_unfinished():
            self.engine.step()


def _within_budget(dummies: _Dummies, sizes: list[int], start: float, budget_s: float, measure,
                   first_guess=None) -> list[int]:
    """measure(n) at each size in turn, with n dummy requests running, as long as the next one (guessed to
    take twice the last; the first: first_guess(n), or nothing) fits in the budget; the sizes measured."""
    done, last = [], 0.0
    for n in sizes:
        began = time.perf_counter()
        if began - start + 2 * last > budget_s:
            break
        dummies.grow(n)
        if not done and first_guess is not None and time.perf_counter() - start + first_guess(n) > budget_s:
            break
        measure(n)
        done.append(n)
        last = time.perf_counter() - began
    return done


def _timed_steps(engine, shape: Shape, warmup: int, timed: int) -> tuple[list[float], list[int]]:
    """Steps of this shape: the times and emitted tokens of `timed` of them, after `warmup` untimed."""
    engine.spec.forced = shape
    for _ in range(warmup):
        engine.step()
    times, tokens = [], []
    for _ in range(timed):
        t0, emitted = time.perf_counter(), engine.stats.num_generation_tokens
        engine.step()
        times.append(time.perf_counter() - t0)
        tokens.append(engine.stats.num_generation_tokens - emitted)
    return times, tokens


def _prompt_extra(engine, shape: Shape, warmup: int, timed: int, rng: random.Random, prompt_len: int,
                  most_nodes: int) -> list[float]:
    """Seconds a draft shape's step with a prompt costs over a plain one, when the steps after it are the
    shape's either way, `timed` times: a window of WINDOW steps whose first one also prefills a new
    request's `prompt_len` random tokens, in the shape, less the same window with that first step plain.
    A window spans the first step's device time whichever way it is read (an overlapped step is waited
    for in the step after it; a looped step launches in one and is read in the next) and the arrival's
    follow-on work (the draft catching up on the new prompt, a restarted loop), which both pay."""
    engine.spec.forced = shape
    for _ in range(warmup):
        engine.step()
    extras = []
    for i in range(timed):
        order = (shape, PLAIN) if i % 2 == 0 else (PLAIN, shape)  # neither always second: drift cancels
        seconds = {first: _arrival(engine, rng, prompt_len, most_nodes, first, shape) for first in order}
        extras.append(seconds[shape] - seconds[PLAIN])
    return extras


def _arrival(engine, rng: random.Random, prompt_len: int, most_nodes: int, first: Shape, then: Shape) -> float:
    """The seconds of WINDOW steps whose first one (of shape `first`, the others `then`) prefills a new
    request's `prompt_len` random tokens; the request is aborted after them, and one untimed step of
    `then` settles the batch again."""
    params = SamplingParams(temperature=0, max_tokens=(WINDOW + 1) * most_nodes, ignore_eos=True)
    seq = engine.add_request([rng.randrange(engine.arch.vocab_size) for _ in range(prompt_len)], params,
                             request_id="calibration-arriving")
    engine.spec.forced = first
    start = time.perf_counter()
    engine.step()
    engine.spec.forced = then
    for _ in range(WINDOW - 1):
        engine.step()
    seconds = time.perf_counter() - start
    engine.abort(seq.request_id)
    engine.step()
    return seconds


def _restore(obj, saved) -> None:
    """Put the counters back as they were, in place (other objects hold references to the nested ones)."""
    for f in dataclasses.fields(obj):
        value = getattr(saved, f.name)
        if dataclasses.is_dataclass(value):
            _restore(getattr(obj, f.name), value)
        else:
            setattr(obj, f.name, value)
