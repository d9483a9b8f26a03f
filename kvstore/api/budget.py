"""Bytes the gateway holds for requests, capped in total, per tenant and per connection.

A GetBlocks answer or a PutBlocks stream can be far larger than any message (2,000 blocks of
111 KiB are 228 MB), so what bounds the gateway's memory is not the message limit but how many
bytes all requests hold at once. Each request reserves what it is about to hold (a batch of
blocks read, a message of payloads received) before holding it and gives it back when the bytes
have left; a reservation that does not fit waits — the request reads no further, which is the
backpressure a slow or stalled client feels — and gives up after ``wait_s`` with
RESOURCE_EXHAUSTED. The per-tenant cap is what keeps one tenant's streams (read or not) from
taking the bytes another tenant's engine needs.

Runs on the gateway's event loop only (no locks: the loop is the one thread that touches it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvstore.errors import ConfigError, Overloaded

MIB = 1 << 20


@dataclass(frozen=True)
class BudgetLimits:
    total_bytes: int = 1024 * MIB
    tenant_bytes: int = 256 * MIB
    connection_bytes: int = 128 * MIB
    #: How long a request waits for room before it is refused.
    wait_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("total_bytes", "tenant_bytes", "connection_bytes"):
            if getattr(self, name) < MIB:
                raise ConfigError(name, f"must be ≥ 1 MiB, got {getattr(self, name)}")
        if self.wait_s <= 0:
            raise ConfigError("wait_s", f"must be > 0, got {self.wait_s}")


class ByteBudget:
    def __init__(self, limits: BudgetLimits | None = None) -> None:
        self.limits = limits or BudgetLimits()
        self.total = 0
        self._tenants: dict[str, int] = {}
        self._connections: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self._wakers: set[asyncio.Task[None]] = set()  # kept until done (asyncio's advice)

    def _fits(self, size: int, tenant: str, connection: str) -> bool:
        limits = self.limits
        return (
            self.total + size <= limits.total_bytes
            and self._tenants.get(tenant, 0) + size <= limits.tenant_bytes
            and self._connections.get(connection, 0) + size <= limits.connection_bytes
        )

    async def acquire(self, size: int, tenant: str, connection: str) -> None:
        """Reserve ``size`` bytes (waits for room; ``Overloaded`` after ``wait_s``). A single
        reservation larger than a cap is refused at once: it could never fit."""
        limits = self.limits
        largest = min(limits.total_bytes, limits.tenant_bytes, limits.connection_bytes)
        if size > largest:
            raise Overloaded(f"one request would hold {size} bytes at once; the cap is {largest}")
        if not self._fits(size, tenant, connection):
            if self._changed is None:
                self._changed = asyncio.Condition()
            changed = self._changed
            try:
                async with changed:
                    await asyncio.wait_for(
                        changed.wait_for(lambda: self._fits(size, tenant, connection)),
                        limits.wait_s,
                    )
            except TimeoutError:
                raise Overloaded(
                    f"no room for {size} more bytes in flight after {limits.wait_s:g} s "
                    f"(tenant {tenant!r} holds {self._tenants.get(tenant, 0)}, this connection "
                    f"{self._connections.get(connection, 0)}, all {self.total})"
                ) from None
        self.total += size
        self._tenants[tenant] = self._tenants.get(tenant, 0) + size
        self._connections[connection] = self._connections.get(connection, 0) + size

    def release(self, size: int, tenant: str, connection: str) -> None:
        if size <= 0:
            return
        self.total -= size
        for table, name in ((self._tenants, tenant), (self._connections, connection)):
            left = table.get(name, 0) - size
            if left > 0:
                table[name] = left
            else:
                table.pop(name, None)
        changed = self._changed
        if changed is not None:
            waker = asyncio.get_running_loop().create_task(_notify(changed))
            self._wakers.add(waker)
            waker.add_done_callback(self._wakers.discard)

    def held_by(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)


async def _notify(changed: asyncio.Condition) -> None:
    async with changed:
        changed.notify_all()
