"""The leases a tier has handed out by id, bounded in count and in time, each tagged with its
holder.

On the wire (and to an engine) a lease is an id; inside the cluster it is a ``Lease`` carrying
the blocks' shard locations, so a read with the lease needs no second metadata round trip. The
table maps one to the other. It never grows without bound: beyond ``capacity`` the oldest lease
is pushed out, and a lease past its end (``until``, the meta shards' wall clock) is dropped by
``sweep`` — which the owner calls on a timer, so a burst of leases nobody releases cannot pin
blocks (or memory) until the next lease-taking request happens to come by. Whatever leaves the
table is handed back to the caller to release in the cluster.

It is the one table of a tier's leases: each carries a ``LeaseTag`` naming the tenant that
holds it (``kvstore.tier.tenancy``), so a lease id handed to one tenant is nobody else's, and a
tenant's cap on open leases is checked and taken in one step under the table's lock (concurrent
requests cannot slip past it).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Generic, Protocol, TypeVar

from kvstore.clock import Clock, SystemClock
from kvstore.errors import Overloaded
from kvstore.tier.records import UNTAGGED, LeaseTag

#: Leases a table remembers at most (older ones are released first when it is full).
MAX_OPEN_LEASES = 100_000


class HasExpiry(Protocol):
    @property
    def lease_id(self) -> str: ...

    @property
    def until(self) -> float: ...


L = TypeVar("L", bound=HasExpiry)


class LeaseTable(Generic[L]):
    """lease id → (lease, tag), in the order they were added; thread-safe."""

    def __init__(self, capacity: int = MAX_OPEN_LEASES, clock: Clock | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be ≥ 1, got {capacity}")
        self._leases: OrderedDict[str, tuple[L, LeaseTag]] = OrderedDict()
        self._held: Counter[str] = Counter()  # open leases per tenant
        self._capacity = capacity
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()

    def add(self, lease: L, tag: LeaseTag = UNTAGGED) -> list[L]:
        """Remember ``lease`` for ``tag``'s holder; returns the leases pushed out (over capacity
        or expired), which the caller releases. A holder at its cap (``tag.cap``) gets
        ``Overloaded`` and the table is unchanged."""
        expired = self.sweep()
        with self._lock:
            if tag.cap is not None and self._held[tag.tenant] >= tag.cap:
                raise Overloaded(
                    f"tenant {tag.tenant!r} holds {tag.cap} leases (its cap): read or release "
                    "some first"
                )
            self._leases[lease.lease_id] = (lease, tag)
            self._held[tag.tenant] += 1
            dropped = []
            while len(self._leases) > self._capacity:
                dropped.append(self._pop_oldest())
        return dropped + expired

    def _pop_oldest(self) -> L:
        lease, tag = self._leases.popitem(last=False)[1]
        self._held[tag.tenant] -= 1
        return lease

    def sweep(self) -> list[L]:
        """Drop and return the leases whose end has passed. Leases end in about the order they
        were taken (one lease length for all), so this looks only at the oldest ones: O(number
        expired), cheap enough to run on every ``add``."""
        now = self._clock.now()
        expired = []
        with self._lock:
            while self._leases:
                oldest = next(iter(self._leases.values()))[0]
                if oldest.until >= now:
                    break
                expired.append(self._pop_oldest())
        return expired

    def take(self, lease_id: str) -> L | None:
        """Remove and return the lease (None: unknown, already taken, or swept)."""
        with self._lock:
            entry = self._leases.pop(lease_id, None)
            if entry is None:
                return None
            self._held[entry[1].tenant] -= 1
            return entry[0]

    def peek(self, lease_id: str) -> L | None:
        """The lease, left in the table (None: unknown, taken, or past its end)."""
        entry = self._entry(lease_id)
        return None if entry is None else entry[0]

    def tag(self, lease_id: str) -> LeaseTag | None:
        """Who holds the lease (None: unknown, taken, or past its end)."""
        entry = self._entry(lease_id)
        return None if entry is None else entry[1]

    def _entry(self, lease_id: str) -> tuple[L, LeaseTag] | None:
        with self._lock:
            entry = self._leases.get(lease_id)
        if entry is None or entry[0].until < self._clock.now():
            return None
        return entry

    def held(self, tenant: str) -> int:
        """Open leases ``tenant`` holds."""
        with self._lock:
            return self._held[tenant]

    def __len__(self) -> int:
        return len(self._leases)
