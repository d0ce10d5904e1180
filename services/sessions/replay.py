"""A session's recent calls by ``request_id``: a retry gets the first answer, applied once.

The client gives every call an id (``request_id`` in the body; services/clients/training.py
makes one per call). The session keeps the answers of its last :data:`KEPT` successful
calls with an id, each with a digest of what the call asked:

    same id, same call ───────► the first answer again; nothing runs
    same id, another call ────► 409 (a replay of the id with other content)
    an id not kept (or none) ─► the call runs

A call that failed is not kept (a failed ``forward_backward`` changed nothing, so its
retry runs). Calls run one at a time under the session's lock, and the lookup happens
inside it: a retry that arrives while its first call still runs waits for it, then finds
its answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel

KEPT = 256
"""Answers kept per session (the oldest go first)."""


def call_digest(verb: str, body: BaseModel) -> str:
    """sha256 of the verb and the call's content, its ``request_id`` left out."""
    text = body.model_dump_json(exclude={"request_id"})
    return hashlib.sha256(f"{verb}\n{text}".encode()).hexdigest()


class ReplayConflict(ValueError):
    """An id used again for a different call."""


class RecentCalls:
    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._answers: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()

    def lookup(self, request_id: str, digest: str) -> dict[str, Any] | None:
        """The first answer of ``request_id``; None if it is not kept. Raises
        :class:`ReplayConflict` if the id was used for another call."""
        kept = self._answers.get(request_id)
        if kept is None:
            return None
        if kept[0] != digest:
            raise ReplayConflict(f"request_id {request_id!r} was already used for a "
                                 "different call; give every call its own id")
        return kept[1]

    def record(self, request_id: str, digest: str, answer: dict[str, Any]) -> None:
        self._answers[request_id] = (digest, answer)
        self._answers.move_to_end(request_id)
        while len(self._answers) > self.kept:
            self._answers.popitem(last=False)
