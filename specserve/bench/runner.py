"""The concurrency sweep: for each level, `requests_per_level` streamed requests with at most C in flight
(closed loop), optionally arriving as a Poisson process of `request_rate` per second (open loop, still
capped at C), as `vllm bench serve --max-concurrency C --request-rate R` does.

Every level sends the same prompts in the same order (a seeded shuffle of the dataset), so levels and
configurations are comparable. Warm-up requests run once before the first level and are not recorded.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Callable, Optional

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .client import BenchError, Endpoint, RequestResult, acceptance_length, send_request, served_model, spec_counters
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
    console = console or Console(stderr=True)
    dataset = load_dataset(options.dataset, options.seed)
    async with _http_client(max(options.concurrency)) as client:
        model = options.model or await served_model(client, base_url, options.api_key)
        endpoint = Endpoint(base_url, options.endpoint, model, options.max_tokens, options.temperature,
                            options.ignore_eos, options.api_key)
        rng = random.Random(options.seed)
        result = {"base_url": base_url, "model": model, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "options": options.record(), "num_dataset_prompts": len(dataset)}
        result["warmup_failed"] = await _warm_up(client, endpoint, dataset, options, rng)
        prompts = request_order(dataset, options.requests_per_level, options.seed)
        with _progress(console) as progress:
            result["levels"] = [await _run_level(client, endpoint, prompts, c, options, rng, progress, title)
                                for c in options.concurrency]
    return result


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
    return summarize_level(results, duration, concurrency, options.request_rate, acceptance_length(before, after))


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(), console=console)
