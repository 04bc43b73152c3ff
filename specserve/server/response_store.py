"""Finished /v1/responses responses kept in memory (--responses-store-size), for `previous_response_id` and
GET / DELETE /v1/responses/{id}: the latest N, the oldest dropped first."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as the client got it
    conversation: list[dict[str, Any]]  # chat messages through this response's output, its instructions left out


class ResponseStore:
    def __init__(self, size: int):
        self.size = size  # 0: nothing is kept
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def put(self, response: StoredResponse) -> None:
        self._items[response.body["id"]] = response
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
