"""Which unauthenticated peers a server takes on: handshake slots, shared fairly by source.

A peer costs a thread from its accept until it proved the key (``handshake``), so the slots are
few. With one pool for everyone, whoever dials fastest holds them all: a process without the key
that keeps opening connections to a meta shard (41,125 in one run) left no slot for the
gateways, whose calls all went through Ray (a put+get p50 of 786 ms instead of 96 ms). So each
source address may hold only ``per_source`` of the ``limit`` slots: a flood from one address
spends its own share and the honest peers, dialing from other machines, find room. Each slot is
also held for a short while only (``UNAUTHENTICATED_S`` in the server): an honest peer answers
the challenge within a round trip or two.

A peer turned away is closed at once; its caller goes through Ray (the call is not lost).
"""

from __future__ import annotations

import threading
from collections import Counter

#: Peers being authenticated at once, all sources together (a thread each).
MAX_HANDSHAKES = 64
#: Of those, from one source address: a busy gateway dials a handful at once, a flood more.
MAX_HANDSHAKES_PER_SOURCE = 8


class HandshakeSlots:
    """At most ``limit`` handshakes at once, at most ``per_source`` of them from one address."""

    def __init__(
        self, limit: int = MAX_HANDSHAKES, per_source: int = MAX_HANDSHAKES_PER_SOURCE
    ) -> None:
        if not 0 < per_source <= limit:
            raise ValueError(f"need 0 < per_source <= limit, got {per_source} and {limit}")
        self.limit = limit
        self.per_source = per_source
        self.turned_away = 0
        self._held: Counter[str] = Counter()
        self._total = 0
        self._lock = threading.Lock()

    def take(self, source: str) -> bool:
        """A slot for a peer from ``source``; False: turn it away (close it now)."""
        with self._lock:
            if self._total >= self.limit or self._held[source] >= self.per_source:
                self.turned_away += 1
                return False
            self._held[source] += 1
            self._total += 1
            return True

    def give(self, source: str) -> None:
        with self._lock:
            self._total -= 1
            self._held[source] -= 1
            if not self._held[source]:
                del self._held[source]  # no entry kept per address ever seen

    def held(self) -> int:
        with self._lock:
            return self._total
