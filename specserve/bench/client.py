"""The benchmark's side of the OpenAI protocol: one streamed request timed chunk by chunk, the served model,
the speculation counters from a server's Prometheus /metrics, and the speculation part of its /server_info.

Output tokens come from the final usage chunk (`stream_options.include_usage`); a server that sends none
is counted one token per content chunk. A request fails on an HTTP error, a transport error (connection
refused, a stream cut short), an error event, a stream without `[DONE]`, or finish_reason "abort"; a failed
request contributes no tokens.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import httpx

from .datasets import Prompt

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SPEC_PREFIXES = ("specserve", "vllm")  # whose spec_decode counters /metrics may carry, preferred first
SpecCounters = tuple[float, float]  # (drafts, accepted tokens) since the server started


class BenchError(RuntimeError):
    """The benchmark cannot run (the server is unreachable, or serves no model)."""


@dataclass(frozen=True)
class Endpoint:
    """Where requests go and what they carry besides the prompt."""

    base_url: str
    kind: str  # "completions" or "chat"
    model: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: Optional[str] = None
    range_ratio: float = 1.0  # < 1: max_tokens per prompt, see `max_tokens_for`
    seed: int = 0
    loras: tuple[str, ...] = ()  # LoRA adapters' names: each request names one of them as its model

    def model_for(self, index: int) -> str:
        """The model the prompt of dataset index `index` asks for: `model`, or one of `loras` drawn by (seed,
        index) (vLLM's bench picks one at random), the same wherever the prompt is sent."""
        if not self.loras:
            return self.model
        return random.Random(f"{self.seed}:lora:{index}").choice(self.loras)

    def max_tokens_for(self, index: int) -> int:
        """The output length the prompt of dataset index `index` asks for: max_tokens, or below range_ratio 1 a
        length drawn uniformly from ceil(range_ratio x max_tokens)..max_tokens, seeded by (seed, index) so that
        the prompt asks the same wherever it is sent."""
        if self.range_ratio >= 1.0:
            return self.max_tokens
        low = max(1, math.ceil(self.range_ratio * self.max_tokens))
        return random.Random(f"{self.seed}:{index}").randint(low, self.max_tokens)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.kind]

    def body(self, prompt: Prompt, index: int = 0) -> dict:
        """The request for `prompt`, dataset index `index`."""
        max_tokens = self.max_tokens_for(index)
        body = {"model": self.model_for(index), "stream": True, "stream_options": {"include_usage": True},
                "temperature": self.temperature}
        if self.kind == "chat":
            body.update(messages=prompt.chat_messages(), max_completion_tokens=max_tokens)
        else:
            body.update(prompt=prompt.text, max_tokens=max_tokens)
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and SGLang's extra field as well as specserve's
        return body


def auth_headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from sending it."""

    prompt_index: int
    model: Optional[str] = None  # the model (or adapter) it asked for
    ok: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None
    latency: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks

    def record(self) -> dict:
        return asdict(self)


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, prompt: Prompt,
                       index: int) -> RequestResult:
    """Send one streamed request and time it; never raises for a failure of the request itself."""
    result = RequestResult(index, endpoint.model_for(index))
    start = time.perf_counter()
    try:
        async with client.stream("POST", endpoint.url, json=endpoint.body(prompt, index),
                                 headers=auth_headers(endpoint.api_key)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                return result
            result.error = await _read_stream(response, result, start)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    result.latency = time.perf_counter() - start
    result.ok = result.error is None
    if not result.ok:
        result.output_tokens = result.prompt_tokens = 0
    return result


async def _read_stream(response: httpx.Response, result: RequestResult, start: float) -> Optional[str]:
    """Consume the SSE body into `result`; the error, or None for a stream that ended cleanly."""
    chunks, usage, finish_reason, last = 0, None, None, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if finish_reason == "abort":
                return "the server aborted the request"
            usage = usage or {}
            result.output_tokens = usage.get("completion_tokens", chunks)
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            if result.ttft is None and result.output_tokens:  # tokens with no visible text (special tokens)
                result.ttft = time.perf_counter() - start
            return None
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            return f"bad SSE event: {data[:200]!r}"
        if "error" in event:
            return f"error event: {_error_message(json.dumps(event).encode())}"
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            finish_reason = choice.get("finish_reason") or finish_reason
            if _has_content(choice):
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    return "the stream ended without [DONE]"


def _has_content(choice: dict) -> bool:
    """Whether a streamed choice carries output (text, content, reasoning or tool-call arguments)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


async def served_model(client: httpx.AsyncClient, base_url: str, api_key: Optional[str]) -> str:
    """The first model of /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=auth_headers(api_key))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        raise BenchError(f"GET {url}: HTTP {response.status_code}: {_error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise BenchError(f"GET {url}: the server lists no model")
    return models[0]["id"]


FLUSH_PATHS = ("/flush_cache", "/reset_prefix_cache")  # SGLang's, vLLM's (specserve serves both)
FLUSH_WAIT_S = 10.0  # how long a refused flush is retried: the last level's requests may still be leaving


async def flush_cache(client: httpx.AsyncClient, base_url: str, api_key: Optional[str]) -> None:
    """Empty the server's prefix cache; BenchError when it serves neither path or keeps refusing."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    while True:
        answers, refused = [], False
        for path in FLUSH_PATHS:
            url = base_url.rstrip("/") + path
            try:
                response = await client.post(url, headers=auth_headers(api_key))
            except httpx.HTTPError as e:
                raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
            if response.status_code == 200:
                return
            answers.append(f"POST {path}: HTTP {response.status_code}: {_error_message(response.content)}")
            refused = response.status_code not in (404, 405)  # served, and refused: try it again
            if refused:
                break
        if not refused or time.monotonic() > deadline:
            raise BenchError("--flush-cache: the server's prefix cache could not be emptied (" + "; ".join(answers)
                             + ")")
        await asyncio.sleep(0.2)


async def spec_counters(base_url: str, api_key: Optional[str]) -> Optional[SpecCounters]:
    """(drafts, accepted tokens) from /metrics, or None when the server exposes no speculation counters
    (or cannot be reached). Scraped on a connection of its own: a request sent right after a scrape on
    the same keep-alive connection was seen to wait ~40 ms for its first chunk, which would skew TTFT."""
    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.get(base_url.rstrip("/") + "/metrics", headers=auth_headers(api_key))
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_spec_counters(response.text)


async def server_spec(base_url: str, api_key: Optional[str]) -> Optional[dict]:
    """The "spec" part of a specserve server's /server_info (speculation counters and the adaptive
    controller's explanation), or None from a server without one (or one that cannot be reached)."""
    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.get(base_url.rstrip("/") + "/server_info", headers=auth_headers(api_key))
        spec = response.json().get("spec") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return spec if isinstance(spec, dict) else None


def parse_spec_counters(text: str) -> Optional[SpecCounters]:
    """(drafts, accepted tokens) summed over label sets, from Prometheus text exposition."""
    for prefix in SPEC_PREFIXES:
        drafts = _counter(text, f"{prefix}:spec_decode_num_drafts")
        accepted = _counter(text, f"{prefix}:spec_decode_num_accepted_tokens")
        if drafts is not None and accepted is not None:
            return drafts, accepted
    return None


def _counter(text: str, name: str) -> Optional[float]:
    values = re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)", text, re.M)
    return sum(float(v) for v in values) if values else None


def acceptance_length(before: Optional[SpecCounters], after: Optional[SpecCounters]) -> Optional[float]:
    """1 + accepted / drafts over the interval between two counter readings; None without drafts."""
    if before is None or after is None:
        return None
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    return 1 + accepted / drafts if drafts > 0 else None
