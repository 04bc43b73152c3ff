"""Finished /v1/responses responses kept in memory (--responses-store-size), for `previous_response_id`, item
references to their output items, and GET / DELETE /v1/responses/{id}: the latest N, the oldest dropped first."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as the client got it
    conversation: list[dict[str, Any]]  # chat messages through this response's output, its instructions left out
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, each item with an id


class ResponseStore:
    def __init__(self, size: int):
        self.size = size  # 0: nothing is kept
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._owners: dict[str, str] = {}  # output item id -> the id of the stored response it is in

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def put(self, response: StoredResponse) -> None:
        self._items[response.body["id"]] = response
        self._owners.update((item["id"], response.body["id"]) for item in response.body.get("output", []))
        while len(self._items) > self.size:
            self._forget(self._items.popitem(last=False)[1])

    def get(self, response_id: str) -> Optional[StoredResponse]:
        return self._items.get(response_id)

    def item(self, item_id: str) -> Optional[dict[str, Any]]:
        """The output item (message, reasoning or function call) of that id of a stored response, or None."""
        stored = self._items.get(self._owners.get(item_id, ""))
        return next((item for item in stored.body["output"] if item["id"] == item_id), None) if stored else None

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._forget(stored)
        return stored is not None

    def _forget(self, response: StoredResponse) -> None:
        for item in response.body.get("output", []):
            self._owners.pop(item["id"], None)
