"""What a sweep runs (`SweepOptions`) and its command-line flags, shared by `specserve bench` and
`specserve compare`. Plain Python: the CLI imports this module to build its flags without httpx.

Flags default to None so that a command can fill what the user left out from its own defaults
(`compare` with no configurations uses a sweep sized for a small CPU)."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional


@dataclass(frozen=True)
class SweepOptions:
    """What `specserve bench` (and each configuration of `specserve compare`) runs."""

    endpoint: str = "completions"
    model: Optional[str] = None  # None: the first of /v1/models
    concurrency: tuple[int, ...] = (1, 2, 5, 10, 30, 70, 100, 250)
    requests_per_level: int = 30
    max_tokens: int = 200
    warmup: int = 5
    dataset: str = "builtin"
    ignore_eos: bool = False
    request_rate: Optional[float] = None  # None: all requests at once (closed loop only)
    temperature: float = 0.0
    api_key: Optional[str] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.requests_per_level < 1 or self.max_tokens < 1 or self.warmup < 0:
            raise ValueError("requests_per_level and max_tokens must be >= 1, warmup >= 0")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")

    def record(self) -> dict:
        """The options as they go into the results JSON (the API key left out)."""
        out = asdict(self)
        out["api_key"] = "(set)" if self.api_key else None
        return out


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
