"""The servers of a job: the least busy one that is up gets the next request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(eq=False)  # endpoints are told apart by identity, not by their counts
class Endpoint:
    """One server of a job: its client, requests in flight, and until when it is left alone."""

    client: Any
    in_flight: int = 0
    down_until: float = 0.0
    requests: int = 0
    rows: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        """The server's ``host:port``."""
        return str(getattr(self.client, "url", self.client))


class EndpointPool:
    """Spreads requests over servers: the least busy one that is up, in turn among equals."""

    def __init__(self, clients: Sequence[Any], cooldown_s: float = 5.0) -> None:
        """One endpoint per client; a server that failed is left alone for ``cooldown_s``."""
        if not clients:
            raise ValueError("a job needs at least one server")
        self.endpoints = [Endpoint(c) for c in clients]
        self.cooldown_s = cooldown_s
        self._turn = 0

    def pick(self, now: float) -> Endpoint | None:
        """The endpoint for the next request, or None while every server is left alone."""
        count = len(self.endpoints)
        ring = [self.endpoints[(self._turn + i) % count] for i in range(count)]
        up = [e for e in ring if e.down_until <= now]
        if not up:
            return None
        chosen = min(up, key=lambda e: e.in_flight)  # min keeps the first of equals: the ring's turn
        self._turn = (self.endpoints.index(chosen) + 1) % count
        return chosen

    def fail(self, endpoint: Endpoint, now: float) -> None:
        """Leave ``endpoint`` alone for the cool-down."""
        endpoint.failures += 1
        endpoint.down_until = now + self.cooldown_s

    def next_up_s(self, now: float) -> float:
        """Seconds until some server may be tried again (0 if one is up)."""
        return max(0.0, min(e.down_until for e in self.endpoints) - now)


