"""Stored responses: what `previous_response_id` continues and GET / DELETE /v1/responses/{id} read.

Each stored response keeps its tenant, the conversation up to and including its answer (as the
chat messages the template renders: earlier instructions are not carried over, as OpenAI
does) and the response body. The store is bounded twice: by count and by age (an entry older
than the TTL is gone whatever the count). When the count is reached, the tenant holding the most
entries loses its oldest: one tenant's flood of requests evicts its own responses, never those of
a tenant holding fewer (each tenant's share is at least the store's size over the tenants using it). It lives in the
front's memory,
so a restart forgets it. A response of another tenant is answered exactly as an unknown one (a
404), so ids reveal nothing across tenants.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.serve.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    stored_at: float
    conversation: list[dict[str, Any]]  # chat messages, the response's own answer last
    body: dict[str, Any]  # the response object as it was answered


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"No response with id {response_id!r} is stored (unknown, expired, deleted or not this API key's).",
        type="not_found_error",
        param=param,
        code="response_not_found",
    )


class ResponsesStore:
    """Response id -> StoredResponse, at most `max_entries` of them, each for `ttl_s` seconds.
    Thread-safe: endpoints read it on the event loop and from their preparing threads."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"responses store size must be >= 1, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"responses store TTL must be > 0 seconds, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # each tenant's ids, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, response_id: str, tenant: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> None:
        with self._lock:
            if response_id in self._entries:
                self._forget(response_id)
            self._entries[response_id] = StoredResponse(tenant, self._clock(), conversation, body)
            self._by_tenant.setdefault(tenant, OrderedDict())[response_id] = None
            while len(self._entries) > self.max_entries:
                largest = max(self._by_tenant.values(), key=len)
                self._forget(next(iter(largest)))
            self._expire()

    def tenant_count(self, tenant: str) -> int:
        """Responses `tenant` has stored."""
        with self._lock:
            self._expire()
            return len(self._by_tenant.get(tenant, ()))

    def get(self, tenant: str, response_id: str, param: str | None = None) -> StoredResponse:
        """The tenant's stored response, or a 404 APIError naming `param`."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            raise response_not_found(response_id, param)
        return entry

    def delete(self, tenant: str, response_id: str) -> None:
        """Forget the tenant's stored response, or raise a 404 APIError."""
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                raise response_not_found(response_id)
            self._forget(response_id)

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        # Entries are in insertion order, so the expired ones are at the front.
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > deadline:
                break
            self._forget(oldest_id)

    def _forget(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        ids = self._by_tenant[entry.tenant]
        del ids[response_id]
        if not ids:
            del self._by_tenant[entry.tenant]
