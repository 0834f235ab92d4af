"""The responses a server keeps for previous_response_id and GET /v1/responses/{id}: each
stored response with the conversation it ended (its input messages, without its
instructions, then its output as messages). In memory and bounded by bytes
(--responses-store-size, default 64 MiB, each entry measured as its JSON): a conversation
grows with every turn, so a count would bound nothing. Past the bound the least recently
used are forgotten (a follow-up naming one gets a 404); an entry larger than the whole
store is not kept; a server restart forgets them all. `store: false` keeps nothing."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from api.responses_protocol import ResponseObject

DEFAULT_STORE_BYTES = 64 * 2**20

Entry = tuple[ResponseObject, list[dict[str, Any]]]


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0  # the JSON size of what is kept
        self._entries: OrderedDict[str, tuple[Entry, int]] = OrderedDict()  # response id -> (entry, its bytes)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> bool:
        """Keeps the response (most recently used); False when it alone is larger than the store."""
        size = len(msgspec.json.encode((response, conversation)))
        self._forget(response.id)
        if size > self.max_bytes:
            return False
        self._entries[response.id] = ((response, conversation), size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            self._forget(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> Entry | None:
        kept = self._entries.get(response_id)
        if kept is None:
            return None
        self._entries.move_to_end(response_id)
        return kept[0]

    def __len__(self) -> int:
        return len(self._entries)

    def _forget(self, response_id: str) -> None:
        kept = self._entries.pop(response_id, None)
        if kept is not None:
            self.num_bytes -= kept[1]
