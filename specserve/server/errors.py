"""Errors as OpenAI clients expect them: `{"error": {"message", "type", "param", "code"}}`; 429 and 503 also
carry a Retry-After header."""
from __future__ import annotations

from typing import Optional

from pydantic import ValidationError

RETRY_AFTER_S = {429: 1, 503: 5}  # the Retry-After header of these statuses, in seconds


def retry_after(status: int) -> Optional[dict[str, str]]:
    """The Retry-After header for a response of this status (429 and 503), or None."""
    seconds = RETRY_AFTER_S.get(status)
    return {"Retry-After": str(seconds)} if seconds is not None else None


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> Optional[dict[str, str]]:
        return retry_after(self.status)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable_error", code="service_unavailable")


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", code="internal_error")


def _param(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def from_validation_error(err: ValidationError, tags: tuple[str, ...] = ()) -> APIError:
    """The first problem pydantic found, phrased for the client; the param is the field's dotted path (less
    `tags`, the names a tagged union of list items puts after an item's index)."""
    errors = err.errors(include_url=False)
    for e in errors:
        loc = e["loc"]
        e["loc"] = tuple(p for i, p in enumerate(loc) if not (p in tags and i and isinstance(loc[i - 1], int)))
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        if first["type"] == "value_error":  # a check across fields
            return bad_request(first["msg"].removeprefix("Value error, "), code="invalid_value")
        return bad_request(f"the request body must be a JSON object: {first['msg']}", code="invalid_type")
    # a union reports one error per member, each with the member's type appended to the field's path
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    loc = _common_prefix([e["loc"] for e in same_field])
    param = _param(loc or first["loc"])
    if first["type"] == "missing":  # fields missing from one object: the first is named
        param = _param(first["loc"]) if all(e["type"] == "missing" for e in same_field) else param
        return bad_request(f"{param} is required", param, "missing_field")
    messages = list(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in same_field))
    got = first.get("input")
    return bad_request(f"{param}: {' or '.join(messages)} (got {got!r})"[:1000], param, "invalid_value")
