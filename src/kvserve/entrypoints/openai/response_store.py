"""Stored responses (``store``): in memory, bounded, and each API key's own.

A stored response keeps what ``GET /v1/responses/{id}`` returns and the
conversation a request with ``previous_response_id`` continues: the
conversation that response saw (less its ``instructions``, which OpenAI does
not carry over) followed by its answer, as chat messages.

Entries are keyed by (API key, response id), so one key can never read,
continue or delete another key's responses: to any other key the id does not
exist, and it gets the same 404 as for an id never stored. On a server
without API keys every client shares one namespace. The store forgets the
least recently used response past ``capacity``, and everything on restart.
It is used from the event loop only, so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.entrypoints.openai.api_errors import ApiError
from kvserve.entrypoints.openai.protocol import ChatMessage
from kvserve.entrypoints.openai.protocol_responses import ResponseObject

# Responses kept per server (all keys together) before the oldest-used is forgotten.
DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # what a continuation starts from


class ResponseStore:
    """Responses by (API key, id), the least recently used forgotten past ``capacity``."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str | None, stored: StoredResponse) -> None:
        key = (tenant, stored.response.id)
        self._entries[key] = stored
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, tenant: str | None, response_id: str, param: str | None = None) -> StoredResponse:
        """The response; 404 (OpenAI's error body, naming ``param``) if this key has none."""
        stored = self._entries.get((tenant, response_id))
        if stored is None:
            raise _not_found(response_id, param)
        self._entries.move_to_end((tenant, response_id))
        return stored

    def delete(self, tenant: str | None, response_id: str) -> None:
        if self._entries.pop((tenant, response_id), None) is None:
            raise _not_found(response_id, None)


def _not_found(response_id: str, param: str | None) -> ApiError:
    return ApiError(
        404, f"No response with id '{response_id[:100]}' found.", param=param, code="not_found"
    )
