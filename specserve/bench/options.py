"""Command-line flags of the sweep, shared by `specserve bench` and `specserve compare`.

Flags default to None so that a command can fill what the user left out from its own defaults
(`compare` with no configurations uses a sweep sized for a small CPU)."""
from __future__ import annotations

import argparse
from dataclasses import fields, replace

from .runner import SweepOptions

DEFAULTS = SweepOptions()


def concurrency_levels(text: str) -> tuple[int, ...]:
    """'1,2,5' -> (1, 2, 5)."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1, got {text!r}")
    return levels


def add_sweep_args(parser: argparse.ArgumentParser, model_name: bool = True) -> None:
    """The sweep's flags; `model_name=False` leaves `--model` to the caller (compare's server model, which
    must then use another dest than `model`)."""
    g = parser.add_argument_group("sweep")
    d = DEFAULTS
    g.add_argument("--endpoint", choices=("completions", "chat"), help=f"(default: {d.endpoint})")
    if model_name:
        g.add_argument("--model", help="model name sent in requests (default: the first of /v1/models)")
    g.add_argument("--concurrency", type=concurrency_levels,
                   help="levels of requests in flight (default: " + ",".join(map(str, d.concurrency)) + ")")
    g.add_argument("--requests-per-level", type=int, help=f"(default: {d.requests_per_level})")
    g.add_argument("--max-tokens", type=int, help=f"output tokens asked per request (default: {d.max_tokens})")
    g.add_argument("--warmup", type=int, help=f"unrecorded requests before the first level (default: {d.warmup})")
    g.add_argument("--dataset", help="builtin, random, sharegpt:FILE or jsonl:FILE (default: builtin)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="generate max-tokens every time")
    g.add_argument("--request-rate", type=float,
                   help="Poisson arrivals per second, capped at the level's concurrency (default: all at once)")
    g.add_argument("--temperature", type=float, help=f"(default: {d.temperature}: greedy)")
    g.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--seed", type=int, help=f"prompt order and arrival times (default: {d.seed})")


def sweep_options(args: argparse.Namespace, base: SweepOptions = DEFAULTS) -> SweepOptions:
    """`base` with the flags the user gave."""
    given = {f.name: getattr(args, f.name, None) for f in fields(SweepOptions)}
    return replace(base, **{name: value for name, value in given.items() if value is not None})
