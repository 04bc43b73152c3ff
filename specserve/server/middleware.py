"""ASGI middleware in front of the routes: the API key and the request body size limit (refusals carry
OpenAI error bodies), and the optional access log."""
from __future__ import annotations

import hmac
import logging
import time

from fastapi.responses import JSONResponse

from .errors import APIError, bad_request

ACCESS_LOG = logging.getLogger("specserve.access")


async def _refuse(error: APIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


class ApiKey:
    """Requires `Authorization: Bearer KEY` on every path but the open ones (/health, /metrics)."""

    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.expected is not None and scope["path"] not in self.open_paths:
            given = (_header(scope, b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                 "authentication_error", code="invalid_api_key")
                return await _refuse(error, scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request body up to max_bytes and hands it on; a larger one gets 413 (by its Content-Length
    when it declares one, else as soon as the chunks read pass the limit)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                        code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _refuse(bad_request(f"bad Content-Length {declared!r}"), scope, receive, send)
            if int(declared) > self.max_bytes:
                return await _refuse(self._too_large(), scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await _refuse(self._too_large(), scope, receive, send)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class AccessLog:
    """One log line per HTTP request once its response has ended: client, method, path, status, duration
    (a stream's duration is the whole stream's; status 0: no response was started)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), 0

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client")
            ACCESS_LOG.info("%s %s %s %d %.3fs", f"{client[0]}:{client[1]}" if client else "-",
                            scope["method"], scope["path"], status, time.monotonic() - start)
