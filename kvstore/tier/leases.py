"""The leases a tier has handed out by id, bounded in count and in time.

On the wire (and to an engine) a lease is an id; inside the cluster it is a ``Lease`` carrying
the blocks' shard locations, so a read with the lease needs no second metadata round trip. The
table maps one to the other. It never grows without bound: beyond ``capacity`` the oldest lease
is pushed out, and a lease past its end (``until``, the meta shards' wall clock) is dropped by
``sweep`` — which the owner calls on a timer, so a burst of leases nobody releases cannot pin
blocks (or memory) until the next lease-taking request happens to come by. Whatever leaves the
table is handed back to the caller to release in the cluster.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from kvstore.clock import Clock, SystemClock

#: Leases a table remembers at most (older ones are released first when it is full).
MAX_OPEN_LEASES = 100_000


class HasExpiry(Protocol):
    @property
    def lease_id(self) -> str: ...

    @property
    def until(self) -> float: ...


L = TypeVar("L", bound=HasExpiry)


class LeaseTable(Generic[L]):
    """lease id → lease, in the order they were added; thread-safe."""

    def __init__(self, capacity: int = MAX_OPEN_LEASES, clock: Clock | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be ≥ 1, got {capacity}")
        self._leases: OrderedDict[str, L] = OrderedDict()
        self._capacity = capacity
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()

    def add(self, lease: L) -> list[L]:
        """Remember ``lease``; returns the leases pushed out (over capacity or expired), which
        the caller releases."""
        with self._lock:
            self._leases[lease.lease_id] = lease
            dropped = []
            while len(self._leases) > self._capacity:
                dropped.append(self._leases.popitem(last=False)[1])
        return dropped + self.sweep()

    def sweep(self) -> list[L]:
        """Drop and return the leases whose end has passed. Leases end in about the order they
        were taken (one lease length for all), so this looks only at the oldest ones: O(number
        expired), cheap enough to run on every ``add``."""
        now = self._clock.now()
        expired = []
        with self._lock:
            while self._leases:
                oldest = next(iter(self._leases.values()))
                if oldest.until >= now:
                    break
                expired.append(self._leases.popitem(last=False)[1])
        return expired

    def take(self, lease_id: str) -> L | None:
        """Remove and return the lease (None: unknown, already taken, or swept)."""
        with self._lock:
            return self._leases.pop(lease_id, None)

    def peek(self, lease_id: str) -> L | None:
        """The lease, left in the table (None: unknown, taken, or past its end)."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or lease.until < self._clock.now():
            return None
        return lease

    def __len__(self) -> int:
        return len(self._leases)
