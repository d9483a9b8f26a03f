"""``RayFanout``: the block tier's ``Fanout`` over Ray actor handles.

Every Ray failure a caller can see becomes ``NodeUnavailable`` (``NodeDead`` when Ray reports
the actor dead for good): ``ActorDiedError``, ``ActorUnavailableError`` (restarting, or on a
machine not yet declared dead), ``GetTimeoutError``, ``ActorUnschedulableError`` (not a
``RayActorError``), ``RayTaskError`` (the actor method raised), ``ObjectLostError``. Nothing
from Ray escapes the block client.

Waiting uses ``ray.wait`` on the outstanding calls, never a blocking ``ray.get`` on the oldest
one while others are in flight (MEASURED.md: that stalled to ~4 calls/s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayError

from kvstore.blockstore.fanout import Target
from kvstore.errors import NodeDead, NodeUnavailable

log = logging.getLogger(__name__)


class RayFanout:
    def __init__(
        self,
        handles: Mapping[Target, Any],
        resolve: Callable[[Target], Any] | None = None,
    ) -> None:
        """``handles``: actor handle per target. ``resolve``: optional way to get a handle for a
        target not in ``handles`` (e.g. a node added later), by actor name."""
        self._handles = dict(handles)
        self._resolve = resolve

    def handle(self, target: Target) -> Any:
        handle = self._handles.get(target)
        if handle is None and self._resolve is not None:
            handle = self._resolve(target)
            if handle is not None:
                self._handles[target] = handle
        return handle

    def submit(self, target: Target, method: str, *args: Any) -> Any:
        handle = self.handle(target)
        if handle is None:
            return _Failed(target, NodeUnavailable(f"no actor for {target}"))
        try:
            ref = getattr(handle, method).remote(*args)
        except RayError as error:
            return _Failed(target, NodeUnavailable(f"{target}.{method}: {error}"))
        # The ticket owns the only reference: a call the client abandons (a late hedged read)
        # frees its result as soon as the client drops the ticket.
        return _Ticket(ref, target)

    def wait(self, tickets: Collection[Any], timeout: float, all_of: bool = False) -> list[Any]:
        failed = [ticket for ticket in tickets if isinstance(ticket, _Failed)]
        if failed:
            return failed
        by_ref = {ticket.ref: ticket for ticket in tickets}
        if not by_ref:
            return []
        refs = list(by_ref)
        wanted = len(refs) if all_of else 1
        ready, rest = ray.wait(refs, num_returns=wanted, timeout=max(0.0, timeout))
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready.extend(more)
        return [by_ref[ref] for ref in ready]

    def result(self, ticket: Any) -> Any:
        if isinstance(ticket, _Failed):
            raise ticket.error
        target = ticket.target
        try:
            return ray.get(ticket.ref, timeout=0.5)
        except ActorDiedError as error:
            if self._resolve is not None:
                # A replacement may be started under the same name: look it up next time.
                self._handles.pop(target, None)
            raise NodeDead(f"{target} died: {_short(error)}") from None
        except RayError as error:  # unavailable, timeout, unschedulable, task error, lost
            log.debug("call to %s failed: %s", target, error)
            raise NodeUnavailable(f"{target}: {type(error).__name__}: {_short(error)}") from None


class _Ticket:
    __slots__ = ("ref", "target")

    def __init__(self, ref: Any, target: Target) -> None:
        self.ref = ref
        self.target = target


class _Failed:
    """A ticket for a call that could not even be submitted."""

    __slots__ = ("error", "target")

    def __init__(self, target: Target, error: NodeUnavailable) -> None:
        self.target = target
        self.error = error


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
