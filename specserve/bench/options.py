"""What a sweep runs (`SweepOptions`) and its command-line flags, shared by `specserve bench` and
`specserve compare`. Plain Python: the CLI imports this module to build its flags without httpx.

Flags default to None so that a command can fill what the user left out from its own defaults
(`compare` with no configurations uses a sweep sized for a small CPU)."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal, Optional, Union

AUTO = "auto"  # requests_per_level sized by concurrency: max(AUTO_MIN_REQUESTS, AUTO_PER_SLOT x C)
AUTO_MIN_REQUESTS = 8
AUTO_PER_SLOT = 2
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may bound (vLLM bench serve's names)


@dataclass(frozen=True)
class SweepOptions:
    """What `specserve bench` (and each configuration of `specserve compare`) runs."""

    endpoint: str = "completions"
    model: Optional[str] = None  # None: the first of /v1/models
    concurrency: tuple[int, ...] = (1, 2, 5, 10, 30, 70, 100, 250)
    requests_per_level: Union[int, Literal["auto"]] = 30  # "auto": max(8, 2C) at concurrency C
    max_tokens: int = 200
    # < 1: each prompt asks for a length drawn from [ratio x max_tokens, max_tokens] (SGLang's --random-range-ratio)
    max_tokens_range_ratio: float = 1.0
    warmup: int = 5
    dataset: str = "builtin"
    ignore_eos: bool = False
    request_rate: Optional[float] = None  # None: all requests at once (closed loop only)
    temperature: float = 0.0
    api_key: Optional[str] = None
    seed: int = 0
    rounds: int = 1  # each level run this many times (interleaved across compare's servers); the median kept
    fresh_prompts: bool = False  # each level (and round) sends the next prompts of the shuffle, not the first N
    lora_modules: tuple[str, ...] = ()  # adapters' names: each request asks for one of them (vLLM bench serve's)
    flush_cache: bool = False  # empty the server's prefix cache before each level (SGLang bench_serving's)
    goodput: tuple[tuple[str, float], ...] = ()  # (ttft | tpot | e2el, ms): SLOs a request meets to count as good
    metric_percentiles: tuple[float, ...] = (99.0,)  # pN of every latency, beside the mean and the median

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.requests_per_level != AUTO and not (isinstance(self.requests_per_level, int)
                                                     and self.requests_per_level >= 1):
            raise ValueError(f"requests_per_level must be an integer >= 1 or {AUTO!r}, got {self.requests_per_level!r}")
        if self.max_tokens < 1 or self.warmup < 0:
            raise ValueError("max_tokens must be >= 1, warmup >= 0")
        if not 0.0 < self.max_tokens_range_ratio <= 1.0:
            raise ValueError(f"max_tokens_range_ratio must be in (0, 1], got {self.max_tokens_range_ratio}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        for name, ms in self.goodput:
            if name not in SLO_METRICS or not ms > 0:
                raise ValueError(f"goodput takes {', '.join(SLO_METRICS)} with a positive number of ms, got "
                                 f"{name}:{ms}")
        if not self.metric_percentiles or any(not 0 < p <= 100 for p in self.metric_percentiles):
            raise ValueError(f"metric_percentiles must be in (0, 100], got {self.metric_percentiles}")

    def requests_at(self, concurrency: int) -> int:
        """How many requests the level of `concurrency` sends."""
        if self.requests_per_level == AUTO:
            return max(AUTO_MIN_REQUESTS, AUTO_PER_SLOT * concurrency)
        return self.requests_per_level

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


def requests_per_level(text: str) -> Union[int, Literal["auto"]]:
    """'30' -> 30; 'auto' -> 'auto'."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or {AUTO!r}, got {text!r}") from None


def slo(text: str) -> tuple[str, float]:
    """'ttft:500' -> ('ttft', 500.0)."""
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = 0.0
    if name not in SLO_METRICS or not value > 0:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0, "
                                         f"got {text!r}")
    return name, value


def percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99' -> (50.0, 90.0, 99.0)."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100], got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


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
    g.add_argument("--requests-per-level", type=requests_per_level, metavar="N|auto",
                   help=f"requests sent at each level; auto: max({AUTO_MIN_REQUESTS}, {AUTO_PER_SLOT} x concurrency) "
                        f"(default: {d.requests_per_level})")
    g.add_argument("--max-tokens", type=int, help=f"output tokens asked per request (default: {d.max_tokens})")
    g.add_argument("--max-tokens-range-ratio", type=float, metavar="R",
                   help="ask each prompt for a length drawn uniformly from R x max-tokens to max-tokens, the same for "
                        "a prompt in every level, round and configuration (SGLang's --random-range-ratio; with "
                        "--ignore-eos, requests then end at different steps instead of in lockstep) "
                        f"(default: {d.max_tokens_range_ratio}: every request max-tokens)")
    g.add_argument("--warmup", type=int, help=f"unrecorded requests before the first level (default: {d.warmup})")
    g.add_argument("--dataset", help="builtin, random, sharegpt:FILE or jsonl:FILE (default: builtin)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="generate max-tokens every time")
    g.add_argument("--request-rate", type=float,
                   help="Poisson arrivals per second, capped at the level's concurrency (default: all at once)")
    g.add_argument("--temperature", type=float, help=f"(default: {d.temperature}: greedy)")
    g.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--seed", type=int, help=f"prompt order, arrival times and drawn output lengths (default: {d.seed})")
    g.add_argument("--fresh-prompts", action="store_true", default=None,
                   help="each level (and round) sends the dataset's next prompts, none repeated until the dataset "
                        "runs out (no prefix-cache hits on repeated prompts); default: every level sends the first N")
    g.add_argument("--lora-modules", nargs="+", type=str, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one of them as its model, drawn by "
                        "prompt (vLLM's bench serve flag; default: none, the served model)")
    g.add_argument("--flush-cache", action="store_true", default=None,
                   help="empty the server's prefix cache before each level and round (POST /flush_cache, SGLang's, "
                        "else /reset_prefix_cache, vLLM's), so that no level reuses another's KV")
    g.add_argument("--goodput", nargs="+", type=slo, metavar="METRIC:MS",
                   help="service-level objectives, e.g. ttft:500 tpot:50 (ms; ttft, tpot, e2el): each level also "
                        "reports request_goodput, the requests a second that met all of them (vLLM bench serve's)")
    g.add_argument("--metric-percentiles", type=percentiles, metavar="P,P",
                   help="percentiles of every latency in the JSON, e.g. 50,90,99 (vLLM bench serve's; default: 99)")
    g.add_argument("--rounds", type=positive_int,
                   help="run the whole sweep this many times and keep each level's median round; `compare` then "
                        "starts every configuration's server up front and runs each level on each server in turn "
                        f"(default: {d.rounds}: one sweep; compare runs the configurations one after another)")


def sweep_options(args: argparse.Namespace, base: SweepOptions = DEFAULTS) -> SweepOptions:
    """`base` with the flags the user gave."""
    given = {f.name: getattr(args, f.name, None) for f in fields(SweepOptions)}
    for name in ("lora_modules", "goodput"):
        if given[name] is not None:
            given[name] = tuple(given[name])
    return replace(base, **{name: value for name, value in given.items() if value is not None})
