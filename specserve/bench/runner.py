"""The concurrency sweep: for each level, `requests_per_level` streamed requests with at most C in flight
(closed loop), optionally arriving as a Poisson process of `request_rate` per second (open loop, still
capped at C), as `vllm bench serve --max-concurrency C --request-rate R` does.

Every level sends the same prompts in the same order (a seeded shuffle of the dataset; a level of N requests
sends its first N), so levels and configurations are comparable; with `fresh_prompts` each level sends the
next N instead (configurations still get the same prompts at the same level), so that a server's prefix
cache does not serve repeated prompts. Warm-up requests run once before the first
level and are not recorded. With `rounds` > 1 the sweep runs that many times and each level keeps its median
round; `run_interleaved` does this against several servers at once, level by level, for `specserve compare`.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .client import (
    BenchError,
    Endpoint,
    RequestResult,
    acceptance_length,
    flush_cache,
    send_request,
    served_model,
    server_spec,
    spec_counters,
)
from .datasets import Prompt, load_dataset
from .options import SweepOptions
from .report import summarize_level

REQUEST_TIMEOUT_S = 600.0  # the longest wait for the next bytes of a response
CONNECT_TIMEOUT_S = 10.0


def _http_client(max_concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                             limits=httpx.Limits(max_connections=max_concurrency + 2), trust_env=False)


async def run_requests(client: httpx.AsyncClient, endpoint: Endpoint, prompts: list[tuple[int, Prompt]],
                       concurrency: int, request_rate: Optional[float], rng: random.Random,
                       on_done: Optional[Callable[[RequestResult], None]] = None
                       ) -> tuple[list[RequestResult], float]:
    """Send `prompts` ((dataset index, prompt) pairs) with at most `concurrency` in flight; the results in
    order and the wall time from the first send to the last completion."""
    limit = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: Prompt) -> RequestResult:
        async with limit:
            result = await send_request(client, endpoint, prompt, index)
        if on_done is not None:
            on_done(result)
        return result

    start = time.perf_counter()
    tasks = []
    for n, (index, prompt) in enumerate(prompts):
        if request_rate is not None and n:
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(one(index, prompt)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def request_order(dataset: list[Prompt], count: int, seed: int) -> list[tuple[int, Prompt]]:
    """`count` (index, prompt) pairs: the dataset in a seeded shuffle, repeated as needed."""
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    return [(order[i % len(order)], dataset[order[i % len(order)]]) for i in range(count)]


async def run_sweep(base_url: str, options: SweepOptions, console: Optional[Console] = None,
                    title: str = "") -> dict:
    """Run every level against the server at `base_url`; the results as a JSON-able dict."""
    [result] = await run_interleaved([(title, base_url)], options, console)
    if isinstance(result, BenchError):
        raise result
    return result


async def run_interleaved(servers: list[tuple[str, str]], options: SweepOptions,
                          console: Optional[Console] = None) -> list[Union[dict, BenchError]]:
    """The sweep against each of `servers` ((name, base URL) pairs), side by side: each server is warmed
    up, then `options.rounds` rounds run; in a round each level runs on every server in turn before the
    next level, the servers' order reversed every other round, so that the machine's drift hits each alike.
    Per server its result (as `run_sweep`'s; with rounds > 1 each level is the round of median output
    throughput, and lists every round's summary under "rounds"), or the BenchError that stopped it."""
    console = console or Console(stderr=True)
    dataset = load_dataset(options.dataset, options.seed)
    async with contextlib.AsyncExitStack() as stack:
        runs = []
        for name, url in servers:
            client = await stack.enter_async_context(_http_client(max(options.concurrency)))
            runs.append(await _start_run(name, url, client, dataset, options))
        live = [run for run in runs if run.error is None]
        schedule = iter(level_prompts(dataset, options))
        with _progress(console) as progress:
            for r in range(options.rounds):
                for c in options.concurrency:
                    prompts = next(schedule)
                    for run in (live if r % 2 == 0 else live[::-1]):
                        if run.error is not None:
                            continue
                        if options.flush_cache:
                            try:
                                await flush_cache(run.client, run.endpoint.base_url, options.api_key)
                            except BenchError as e:
                                run.error = e
                                continue
                        title = run.name + (f" round {r + 1}" if options.rounds > 1 else "")
                        level = await _run_level(run.client, run.endpoint, prompts, c, options, run.rng, progress,
                                                 title)
                        run.levels.setdefault(c, []).append(level)
        live = [run for run in live if run.error is None]
        for run in live:
            run.result["levels"] = [median_level(run.levels[c]) for c in options.concurrency]
            run.result["server_spec"] = await server_spec(run.endpoint.base_url, options.api_key)
    return [run.error or run.result for run in runs]


def level_prompts(dataset: list[Prompt], options: SweepOptions) -> list[list[tuple[int, Prompt]]]:
    """Each level's prompts, in the order the levels run (round by round): the first N of the dataset's seeded
    shuffle, or with `fresh_prompts` the next N of it, so that no prompt repeats (and no level gains from a
    server's prefix cache) until the dataset runs out; then it starts over."""
    counts = [options.requests_at(c) for _ in range(options.rounds) for c in options.concurrency]
    if not options.fresh_prompts:
        return [request_order(dataset, n, options.seed) for n in counts]
    stream = request_order(dataset, sum(counts), options.seed)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [stream[start:start + n] for start, n in zip(starts, counts)]


@dataclass
class _Run:
    """One server's side of `run_interleaved`."""

    name: str
    client: httpx.AsyncClient
    rng: random.Random  # Poisson arrivals: the same sequence on every server
    endpoint: Optional[Endpoint] = None
    result: dict = field(default_factory=dict)
    error: Optional[BenchError] = None
    levels: dict[int, list[dict]] = field(default_factory=dict)  # concurrency -> the level of each round


async def _start_run(name: str, base_url: str, client: httpx.AsyncClient, dataset: list[Prompt],
                     options: SweepOptions) -> _Run:
    """The served model, the result's header and the warm-up; a BenchError is kept in the run."""
    run = _Run(name, client, random.Random(options.seed))
    try:
        model = options.model or await served_model(client, base_url, options.api_key)
        run.endpoint = Endpoint(base_url, options.endpoint, model, options.max_tokens, options.temperature,
                                options.ignore_eos, options.api_key, options.max_tokens_range_ratio, options.seed,
                                options.lora_modules)
        run.result = {"base_url": base_url, "model": model, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "options": options.record(), "num_dataset_prompts": len(dataset)}
        run.result["warmup_failed"] = await _warm_up(client, run.endpoint, dataset, options, run.rng)
    except BenchError as e:
        run.error = e
    return run


ROUND_KEYS = ("output_throughput", "total_token_throughput", "request_throughput", "duration", "completed",
              "failed", "mean_ttft_ms", "mean_tpot_ms", "mean_accept_length", "spec_drafts", "spec_accepted")


def median_level(rounds: list[dict]) -> dict:
    """A level run once is kept as it is; run in several rounds, the round of median output throughput (the
    lower middle one of an even count: a measured level, its requests included), with "round" (its index)
    and "rounds" (every round's summary, in the order they ran) added."""
    if len(rounds) == 1:
        return rounds[0]
    ranked = sorted(range(len(rounds)), key=lambda i: rounds[i]["output_throughput"])
    chosen = ranked[(len(rounds) - 1) // 2]
    level = dict(rounds[chosen])
    level["round"] = chosen
    level["rounds"] = [{key: lv[key] for key in ROUND_KEYS} for lv in rounds]
    return level


async def _warm_up(client: httpx.AsyncClient, endpoint: Endpoint, dataset: list[Prompt], options: SweepOptions,
                   rng: random.Random) -> int:
    """Send the warm-up requests all at once; how many failed. Raises BenchError when all of them fail."""
    if options.warmup == 0:
        return 0
    prompts = request_order(dataset, options.warmup, options.seed + 1)
    results, _ = await run_requests(client, endpoint, prompts, options.warmup, None, rng)
    failed = [r for r in results if not r.ok]
    if len(failed) == len(results):
        raise BenchError(f"all {len(results)} warm-up requests to {endpoint.url} failed: {failed[0].error}")
    return len(failed)


async def _run_level(client: httpx.AsyncClient, endpoint: Endpoint, prompts: list[tuple[int, Prompt]],
                     concurrency: int, options: SweepOptions, rng: random.Random, progress: Progress,
                     title: str) -> dict:
    task = progress.add_task(f"{title} C={concurrency}".strip(), total=len(prompts), failed=0)
    failed = 0

    def on_done(result: RequestResult) -> None:
        nonlocal failed
        failed += not result.ok
        progress.update(task, advance=1, failed=failed)

    before = await spec_counters(endpoint.base_url, options.api_key)
    results, duration = await run_requests(client, endpoint, prompts, concurrency, options.request_rate, rng,
                                           on_done)
    after = await spec_counters(endpoint.base_url, options.api_key)
    level = summarize_level(results, duration, concurrency, options.request_rate, acceptance_length(before, after),
                            options.metric_percentiles, options.goodput)
    # verifies (one per request per speculative step) and accepted drafts in the level: how much it speculated
    level["spec_drafts"], level["spec_accepted"] = ((after[0] - before[0], after[1] - before[1])
                                                    if before is not None and after is not None else (None, None))
    return level


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=console)
