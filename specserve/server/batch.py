"""`specserve run-batch`: a file of OpenAI batch requests through the server's own routes, with no port.

Each input line is OpenAI's batch request, `{"custom_id", "method": "POST", "url", "body"}`, for
/v1/chat/completions, /v1/completions or /v1/responses. Each is sent to the app in process (httpx's ASGI
transport), so validation, templates, parsers and errors are the server's. The output has one line per input
line, in input order, written as soon as the lines before it are done:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. `body` is what the server
answered, an error body included; `error` is null on success and `{"code", "message"}` otherwise, for lines
that failed before reaching a route too (not JSON, an unknown url, a streamed request, a repeated custom_id).
A bad line costs only its own output line.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

import httpx

from ..config import EngineConfig
from ..engine.async_engine import AsyncEngine
from .app import build_app
from .options import ServerOptions
from .serve import DEFAULT_MODEL_NAME, watch_engine
from .state import Phase, ServerState

log = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRY_FULL_S = 0.05  # a line answered 429 (the server's queue is full) waits this long per try while others run
PROGRESS_EVERY_S = 10.0  # how often a running batch logs how far it is


class LineError(Exception):
    """A line that cannot be sent: its output line carries `code`, the message, and the custom_id if it had one."""

    def __init__(self, code: str, message: str, custom_id: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def parse_line(text: str) -> tuple[Optional[str], str, dict]:
    """(custom_id, url, body) of one input line; raises LineError naming what is wrong with it."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError("invalid_json", f"the line is not JSON: {e}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_request", "the line must be a JSON object with custom_id, method, url and body")
    custom_id = line.get("custom_id")
    error = None
    if not isinstance(custom_id, str) or not custom_id:
        custom_id, error = None, "custom_id must be a non-empty string"
    elif line.get("method", "POST") != "POST":
        error = f"method must be POST, got {line.get('method')!r}"
    elif line.get("url") not in URLS:
        error = f"url {line.get('url')!r} is not served in a batch: use one of {', '.join(URLS)}"
    elif not isinstance(line.get("body"), dict):
        error = "body must be a JSON object: the request the url takes"
    elif line["body"].get("stream"):
        error = "body.stream must be false in a batch: each line gets its whole response"
    if error is not None:
        raise LineError("invalid_request", error, custom_id)
    return custom_id, line["url"], line["body"]


def error_line(custom_id: Optional[str], status: int, code: str, message: str) -> dict:
    """The output line of a line that got no answer from a route."""
    line = output_line(custom_id, status, None, "")
    line["error"] = {"code": code, "message": message}
    return line


def output_line(custom_id: Optional[str], status: int, body: Optional[dict], request_id: str) -> dict:
    """One output line; `error` mirrors a failed response's error body."""
    error = None
    if status >= 400:
        detail = (body or {}).get("error") or {}
        error = {"code": detail.get("code") or detail.get("type") or str(status),
                 "message": detail.get("message") or f"HTTP {status}"}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}


class OrderedWriter:
    """Writes output lines in input order: a finished line waits only for the lines before it."""

    def __init__(self, out: TextIO):
        self.out = out
        self.next_index = 0
        self.waiting: dict[int, dict] = {}
        self.counts = {"succeeded": 0, "failed": 0}
        self.logged = time.monotonic()

    def add(self, index: int, line: dict) -> None:
        self.counts["failed" if line["error"] else "succeeded"] += 1
        self.waiting[index] = line
        while self.next_index in self.waiting:
            self.out.write(json.dumps(self.waiting.pop(self.next_index)) + "\n")
            self.next_index += 1
        self.out.flush()
        if time.monotonic() - self.logged >= PROGRESS_EVERY_S:
            self.logged = time.monotonic()
            log.info("%d lines done (%d failed), %d written", sum(self.counts.values()), self.counts["failed"],
                     self.next_index)


class BatchRunner:
    """Sends lines to the app, at most `concurrency` at a time, and hands each answer to the writer."""

    def __init__(self, client: httpx.AsyncClient, writer: OrderedWriter, concurrency: int):
        self.client = client
        self.writer = writer
        self.slots = asyncio.Semaphore(concurrency)
        self.in_flight = 0
        self.seen: set[str] = set()
        self.tasks: set[asyncio.Task] = set()

    async def submit(self, index: int, number: int, text: str) -> None:
        """Parse the line (output `index`, file line `number`); a bad one is written at once, a good one runs
        once a slot is free."""
        try:
            custom_id, url, body = parse_line(text)
            if custom_id in self.seen:
                raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} is used by an earlier line", custom_id)
        except LineError as e:
            self.writer.add(index, error_line(e.custom_id, 400, e.code, f"line {number}: {e}"))
            return
        self.seen.add(custom_id)
        await self.slots.acquire()
        task = asyncio.create_task(self._send(index, custom_id, url, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, index: int, custom_id: str, url: str, body: dict) -> None:
        self.in_flight += 1
        try:
            while True:
                response = await self.client.post(url, json=body)
                if response.status_code != 429 or self.in_flight == 1:
                    break
                await asyncio.sleep(RETRY_FULL_S)  # the queue is full of this batch's own lines: wait for them
            answer = response.json()
            request_id = answer.get("id", "") if response.status_code < 400 else ""
            self.writer.add(index, output_line(custom_id, response.status_code, answer, request_id))
        except Exception as e:  # one line's failure must not stop the batch
            self.writer.add(index, error_line(custom_id, 500, "internal_error", f"{type(e).__name__}: {e}"))
        finally:
            self.in_flight -= 1
            self.slots.release()

    async def drain(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks))


def read_lines(source: TextIO) -> Iterator[tuple[int, int, str]]:
    """(index among the non-blank lines, line number in the file, text) of each non-blank line."""
    index = 0
    for number, text in enumerate(source, 1):
        if text.strip():
            yield index, number, text
            index += 1


@contextmanager
def opened(path: str, mode: str):
    """A file, or standard input / output for "-"."""
    if path == "-":
        yield sys.stdin if "r" in mode else sys.stdout
    else:
        with open(path, mode, encoding="utf-8") as f:
            yield f


async def run_lines(state: ServerState, source: TextIO, out: TextIO) -> dict:
    """Every line of `source` through the app over `state`; returns the counts of succeeded and failed lines."""
    scheduler = state.engine.engine.config.scheduler
    concurrency = max(1, min(2 * scheduler.max_num_seqs, state.requests.capacity))
    writer = OrderedWriter(out)
    watch = asyncio.create_task(watch_engine(state))
    transport = httpx.ASGITransport(app=build_app(state))
    headers = {"Authorization": f"Bearer {state.options.api_key}"} if state.options.api_key else {}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", headers=headers,
                                     timeout=None) as client:
            runner = BatchRunner(client, writer, concurrency)
            for index, number, text in read_lines(source):
                await runner.submit(index, number, text)
            await runner.drain()
    finally:
        watch.cancel()
    return writer.counts


def run_batch(engine_config: EngineConfig, options: ServerOptions, input_path: str, output_path: str) -> int:
    """Run the batch file at `input_path` into `output_path` ("-": standard input / output). Returns 0 once every
    line has its output line (failed lines included), 1 when the engine failed while running."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request sent to the app
    state = ServerState(options, options.served_model_name or engine_config.model.model or DEFAULT_MODEL_NAME)
    with opened(input_path, "r") as source:
        engine = AsyncEngine(engine_config)
        try:
            state.attach(engine)
            state.phase = Phase.SERVING
            start = time.perf_counter()
            with opened(output_path, "w") as out:
                counts = asyncio.run(run_lines(state, source, out))
        finally:
            engine.shutdown()
    log.info("%d lines in %.1f s: %d succeeded, %d failed; output in %s", sum(counts.values()),
             time.perf_counter() - start, counts["succeeded"], counts["failed"], output_path)
    return 0 if engine.error is None and engine.rank_failure is None else 1
