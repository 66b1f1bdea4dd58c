"""Stored responses of the Responses API: what `GET /v1/responses/{id}` returns and what a later
request's `previous_response_id` continues.

One gateway keeps its own store, in memory (as vLLM's, behind `VLLM_ENABLE_RESPONSES_API_STORE`,
is per process): behind several gateway replicas a client that chains responses must stick to
one, or the chain is a 404. The store is bounded twice, least recently used first out: by count
(`GatewayConfig.responses_store_max_entries`) and by bytes (`responses_store_max_bytes`: the
JSON size of each response plus the conversation before its output); a response larger than
the byte bound alone is not kept. Retrieving a response or continuing it counts as a use.

Each stored response carries its whole conversation (the chain's items, its own input items,
its output items), so evicting or deleting an earlier response of a chain leaves the later ones
whole. The items are shared between the responses of a chain, never copied, and never mutated.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Item = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response. `conversation`: the chain's items before it (its previous
    response's `conversation`), its own input items, then its `num_output_items` output items —
    what a request with `previous_response_id` set to it continues."""

    response: dict[str, Any]          # the response object as it was returned
    conversation: tuple[Item, ...]
    num_output_items: int
    num_bytes: int                    # what it counts against the store's byte bound

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def input_items(self) -> tuple[Item, ...]:
        """The items the model was given (after `instructions`): the chain's, then its own."""
        return self.conversation[:len(self.conversation) - self.num_output_items]


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _copy(obj: Any) -> tuple[Any, int]:
    """A deep copy of a JSON value (nothing the caller keeps can change it) and its size."""
    text = _json(obj)
    return json.loads(text), len(text.encode())


class ResponseStore:
    """An LRU map of response id → `StoredResponse`, bounded by count and by bytes (either
    bound 0: storing is off, `put` keeps nothing). `get`, `put` and `delete` mutate it (`get`
    moves the entry to the most recently used end); not thread-safe: the gateway uses it from
    its one event loop."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: Sequence[Item],
            previous: StoredResponse | None) -> StoredResponse | None:
        """Keep a copy of the finished `response`, whose request gave `input_items` after
        `previous`'s conversation; evicts the least recently used past the bounds. None: not
        kept (storing is off, or it alone is over the byte bound)."""
        if not self.enabled:
            return None
        stored, num_bytes = _copy(response)
        own, _ = _copy(list(input_items))
        before = (*(previous.conversation if previous is not None else ()), *own)
        num_bytes += len(_json(before).encode())
        if num_bytes > self.max_bytes:
            return None
        output = stored["output"]
        entry = StoredResponse(stored, (*before, *output), len(output), num_bytes)
        self.delete(entry.id)
        self._entries[entry.id] = entry
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if it was not stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
