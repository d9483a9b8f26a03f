"""Which unauthenticated peers a server takes on: handshake slots, shared fairly by source.

A peer costs a thread from its accept until it proved the key (``handshake``), so the slots are
few. With one pool for everyone, whoever dials fastest holds them all: a process without the key
that keeps opening connections to a meta shard (41,125 in one run) left no slot for the
gateways, whose calls all went through Ray (a put+get p50 of 786 ms instead of 96 ms). So each
source address may hold only ``per_source`` of the ``limit`` slots: a flood from one address
spends its own share and the honest peers, dialing from other machines, find room.

A flood from many addresses (``limit / per_source`` of them, 8 by default) can still fill every
slot within its shares. So a peer that finds the slots full takes the slot of the oldest
handshake of the source holding the most, when that source holds more than the newcomer's
would: the evicted peer's socket is shut (its thread sees the connection end) and its slot
is the newcomer's at once. An honest peer answers the challenge within a round trip or two,
so it is seldom the oldest; a peer that only sits there is. Each slot is also held for a short
while only (``UNAUTHENTICATED_S`` in the server).

A peer turned away is closed at once; its caller goes through Ray (the call is not lost).
"""

from __future__ import annotations

import socket
import threading
from collections import Counter

#: Peers being authenticated at once, all sources together (a thread each).
MAX_HANDSHAKES = 64
#: Of those, from one source address: a busy gateway dials a handful at once, a flood more.
MAX_HANDSHAKES_PER_SOURCE = 8


class Slot:
    """One peer's handshake slot (``HandshakeSlots.take``); given back once, by whoever ends
    it first: its thread (``HandshakeSlots.give``) or an eviction."""

    __slots__ = ("source", "peer", "held")

    def __init__(self, source: str, peer: socket.socket | None) -> None:
        self.source = source
        self.peer = peer
        self.held = True


class HandshakeSlots:
    """At most ``limit`` handshakes at once, at most ``per_source`` of them from one address;
    when full, the busiest source's oldest handshake makes room for a less busy source."""

    def __init__(
        self, limit: int = MAX_HANDSHAKES, per_source: int = MAX_HANDSHAKES_PER_SOURCE
    ) -> None:
        if not 0 < per_source <= limit:
            raise ValueError(f"need 0 < per_source <= limit, got {per_source} and {limit}")
        self.limit = limit
        self.per_source = per_source
        self.turned_away = 0
        self.evicted = 0
        self._held: Counter[str] = Counter()
        self._slots: dict[Slot, None] = {}  # in the order taken: the first is the oldest
        self._lock = threading.Lock()

    def take(self, source: str, peer: socket.socket | None = None) -> Slot | None:
        """A slot for ``peer`` from ``source``; None: turn it away (close it now)."""
        victim: Slot | None = None
        with self._lock:
            if self._held[source] >= self.per_source:
                self.turned_away += 1
                return None
            if len(self._slots) >= self.limit:
                victim = self._victim(source)
                if victim is None:
                    self.turned_away += 1
                    return None
                self._end(victim)
                self.evicted += 1
            slot = Slot(source, peer)
            self._slots[slot] = None
            self._held[source] += 1
        if victim is not None and victim.peer is not None:
            try:  # wakes the victim's thread, blocked reading its challenge answer
                victim.peer.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone
        return slot

    def _victim(self, newcomer: str) -> Slot | None:
        """The oldest handshake of the source holding the most slots, if it holds more than
        the newcomer would (equal shares are left alone: no churn between equals)."""
        busiest, held = self._held.most_common(1)[0]
        if held <= self._held[newcomer] + 1:
            return None
        return next(slot for slot in self._slots if slot.source == busiest)

    def give(self, slot: Slot) -> None:
        with self._lock:
            if slot.held:
                self._end(slot)

    def _end(self, slot: Slot) -> None:
        slot.held = False
        del self._slots[slot]
        self._held[slot.source] -= 1
        if not self._held[slot.source]:
            del self._held[slot.source]  # no entry kept per address ever seen

    def held(self) -> int:
        with self._lock:
            return len(self._slots)
