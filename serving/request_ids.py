"""Whose request is whose: a server keys every request by an id of its own and keeps the
client's id only to echo it back and to let that client (its connection) abort it. Two
clients that pick the same id never collide, and one cannot abort the other's request."""

from __future__ import annotations

import uuid


def new_request_id() -> str:
    return uuid.uuid4().hex


class OwnedRequests:
    """Own ids in flight, by (the caller's connection, the caller's id for the request)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], set[str]] = {}

    def add(self, owner: str, client_id: str, own_id: str) -> None:
        self._ids.setdefault((owner, client_id), set()).add(own_id)

    def discard(self, owner: str, client_id: str, own_id: str) -> None:
        ids = self._ids.get((owner, client_id))
        if ids is not None:
            ids.discard(own_id)
            if not ids:
                del self._ids[(owner, client_id)]

    def of(self, owner: str, client_id: str) -> list[str]:
        """The own ids of what ``owner`` sent as ``client_id`` and is still in flight."""
        return sorted(self._ids.get((owner, client_id), ()))

    def __len__(self) -> int:
        return len(self._ids)
