"""Work in flight per tenant, by cost: how many blocks of lookups one tenant may have running.

Admission by count (``GatewayLimits.tenant_in_flight``) treats a QueryHit of 8,192 keys like
one of 8: a tenant sending the largest lookups, several at a time, took a share of the cores
in proportion to its keys, and the other tenants' small lookups waited behind that work
(benchmarks/tenants.py: 8 concurrent 8,192-key QueryHits raised another tenant's QueryHit p50
5×). Here each lookup costs its blocks, and a tenant's lookups run only while their blocks in
flight stay within its share; a lookup that would exceed it waits, in arrival order, for that
tenant's earlier ones to finish. No tenant waits on another's: an engine's ordinary lookups
(tens of blocks) never wait at all, while one tenant's flood of large lookups runs one or two at
a time — its own throughput falls, everyone else's latency does not rise.

A single lookup larger than the share runs alone (the share is never a cap on one request:
that is ``GatewayLimits.max_tokens``). A lookup that cannot start within ``wait_s`` is refused
with RESOURCE_EXHAUSTED.

Runs on the gateway's event loop only (no locks: the loop is the one thread that touches it).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvstore.errors import ConfigError, Overloaded


class CostShares:
    """Per tenant: the cost of its admitted work, and its waiters in arrival order."""

    def __init__(self, share: int, wait_s: float) -> None:
        if share < 1:
            raise ConfigError("tenant_blocks_in_flight", f"must be ≥ 1, got {share}")
        if wait_s <= 0:
            raise ConfigError("wait_s", f"must be > 0, got {wait_s}")
        self.share = share
        self.wait_s = wait_s
        self._running: dict[str, int] = {}
        self._waiting: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    @asynccontextmanager
    async def admit(self, tenant: str, cost: int) -> AsyncIterator[None]:
        """Hold ``cost`` of ``tenant``'s share for the block's duration (waits for room)."""
        cost = max(1, min(cost, self.share))  # one over-share lookup runs, alone
        await self._acquire(tenant, cost)
        try:
            yield
        finally:
            self._release(tenant, cost)

    def _fits(self, tenant: str, cost: int) -> bool:
        return self._running.get(tenant, 0) + cost <= self.share

    async def _acquire(self, tenant: str, cost: int) -> None:
        queue = self._waiting.get(tenant)
        if not queue and self._fits(tenant, cost):
            self._running[tenant] = self._running.get(tenant, 0) + cost
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, collections.deque())
        queue.append((cost, turn))
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.wait_s)
        except TimeoutError:
            if turn.done():  # admitted just as the wait ran out: keep it
                return
            self._forget(tenant, turn)
            raise Overloaded(
                f"tenant {tenant!r} has {self.running(tenant)} blocks of lookups running "
                f"(its share is {self.share}); this one of {cost} waited {self.wait_s:g} s"
            ) from None
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(tenant, cost)  # admitted, but the caller is gone
            else:
                self._forget(tenant, turn)
            raise

    def _forget(self, tenant: str, turn: asyncio.Future[None]) -> None:
        turn.cancel()
        queue = self._waiting.get(tenant)
        if queue is not None:
            self._waiting[tenant] = collections.deque(w for w in queue if w[1] is not turn)
            self._admit_waiters(tenant)  # a large waiter leaving may unblock smaller ones

    def _release(self, tenant: str, cost: int) -> None:
        left = self._running.get(tenant, 0) - cost
        if left > 0:
            self._running[tenant] = left
        else:
            self._running.pop(tenant, None)
        self._admit_waiters(tenant)

    def _admit_waiters(self, tenant: str) -> None:
        """Start waiters in arrival order while the first fits (no overtaking: a large lookup
        is not starved by a stream of small ones)."""
        queue = self._waiting.get(tenant)
        while queue and self._fits(tenant, queue[0][0]):
            cost, turn = queue.popleft()
            if turn.done():
                continue
            self._running[tenant] = self._running.get(tenant, 0) + cost
            turn.set_result(None)
        if not queue:
            self._waiting.pop(tenant, None)
