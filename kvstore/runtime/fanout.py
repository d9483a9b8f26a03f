"""``RayFanout``: the block tier's ``Fanout`` over Ray actor handles.

Every Ray failure a caller can see becomes ``NodeUnavailable`` (``NodeDead`` when Ray reports
the actor dead for good): ``ActorDiedError``, ``ActorUnavailableError`` (restarting, or on a
machine not yet declared dead), ``GetTimeoutError``, ``ActorUnschedulableError`` (not a
``RayActorError``), ``RayTaskError`` (the actor method raised), ``ObjectLostError``. Nothing
from Ray escapes the block client.

Methods named in ``fast_methods`` (a meta shard's ``lookup_wire``: the hit path) go over the
actor's direct socket instead (``kvstore.runtime.fastcall``) when it offers one; a broken socket
is retried once through Ray, so callers see the same outcomes either way.

Waiting uses ``ray.wait`` on the outstanding calls, never a blocking ``ray.get`` on the oldest
one while others are in flight (MEASURED.md: that stalled to ~4 calls/s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from multiprocessing.connection import Connection
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayError

from kvstore.blockstore.fanout import Target
from kvstore.errors import NodeDead, NodeUnavailable
from kvstore.runtime.fastcall import FastChannel, FastChannels, RemoteError, wait_ready

log = logging.getLogger(__name__)

#: A socket call whose connection broke is retried once through Ray, waiting at most this long.
_RETRY_TIMEOUT_S = 5.0


class RayFanout:
    def __init__(
        self,
        handles: Mapping[Target, Any],
        resolve: Callable[[Target], Any] | None = None,
        fast_methods: Collection[str] = (),
    ) -> None:
        """``handles``: actor handle per target. ``resolve``: optional way to get a handle for a
        target not in ``handles`` (e.g. a node added later), by actor name. ``fast_methods``:
        methods called over the actor's direct socket (``kvstore.runtime.fastcall``) when it
        offers one (``fast_endpoint()``); through Ray otherwise."""
        self._handles = dict(handles)
        self._resolve = resolve
        self._fast_methods = frozenset(fast_methods)
        self._fast = FastChannels()

    def handle(self, target: Target) -> Any:
        handle = self._handles.get(target)
        if handle is None and self._resolve is not None:
            handle = self._resolve(target)
            if handle is not None:
                self._handles[target] = handle
        return handle

    # --- the direct socket path ----------------------------------------------------------

    def _submit_fast(self, target: Target, handle: Any, method: str, args: Any) -> Any:
        channel = self._fast.get(target, handle)
        if channel is None:
            return None
        try:
            return _FastTicket(channel.start(method, args), channel, target, method, args)
        except (OSError, EOFError) as error:
            log.debug("fast call to %s failed to start: %s", target, error)
            self._fast.forget(target, channel)
            return None  # the caller goes through Ray this time

    # --- Fanout ----------------------------------------------------------------------------

    def submit(self, target: Target, method: str, *args: Any) -> Any:
        handle = self.handle(target)
        if handle is None:
            return _Failed(target, NodeUnavailable(f"no actor for {target}"))
        if method in self._fast_methods:
            ticket = self._submit_fast(target, handle, method, args)
            if ticket is not None:
                return ticket
        return self.submit_via_ray(target, method, *args)

    def submit_via_ray(self, target: Target, method: str, *args: Any) -> Any:
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
        fast = [ticket for ticket in tickets if isinstance(ticket, _FastTicket)]
        if fast:
            if len(fast) < len(tickets):
                return self._wait_mixed(tickets, timeout, all_of)
            return self._wait_fast(fast, timeout, all_of)
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

    def _wait_fast(self, tickets: list[_FastTicket], timeout: float, all_of: bool) -> list[Any]:
        by_conn = {ticket.conn: ticket for ticket in tickets}
        deadline = time.monotonic() + max(0.0, timeout)
        ready = wait_ready(list(by_conn), timeout)
        while all_of and len(ready) < len(by_conn):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            rest = [conn for conn in by_conn if conn not in ready]
            ready.extend(wait_ready(rest, left))
        return [by_conn[conn] for conn in ready]

    def _wait_mixed(self, tickets: Collection[Any], timeout: float, all_of: bool) -> list[Any]:
        """Socket and Ray calls at once (rare: a fallback during an actor restart): poll both."""
        fast = [ticket for ticket in tickets if isinstance(ticket, _FastTicket)]
        slow = [ticket for ticket in tickets if not isinstance(ticket, _FastTicket)]
        deadline = time.monotonic() + max(0.0, timeout)
        ready: list[Any] = []
        while True:
            ready.extend(self._wait_fast(fast, 0.0, False))
            ready.extend(self.wait(slow, 0.0, False))
            left = deadline - time.monotonic()
            if left <= 0 or (ready and not all_of) or len(ready) == len(tickets):
                return ready
            fast = [ticket for ticket in fast if ticket not in ready]
            slow = [ticket for ticket in slow if ticket not in ready]
            time.sleep(min(left, 0.001))

    def result(self, ticket: Any) -> Any:
        if isinstance(ticket, _Failed):
            raise ticket.error
        if isinstance(ticket, _FastTicket):
            try:
                return ticket.channel.finish(ticket.conn)
            except RemoteError as error:
                raise NodeUnavailable(f"{ticket.target}: {error}") from None
            except (OSError, EOFError) as error:
                # The socket went stale (the actor restarted on a new port, or died): ask once
                # more through Ray, which knows whether a replacement is up.
                log.debug("fast call to %s lost its connection: %r", ticket.target, error)
                self._fast.forget(ticket.target, ticket.channel)
                retry = self.submit_via_ray(ticket.target, ticket.method, *ticket.args)
                if not isinstance(retry, _Ticket):
                    return self.result(retry)
                try:
                    return ray.get(retry.ref, timeout=_RETRY_TIMEOUT_S)
                except RayError as again:
                    raise NodeUnavailable(f"{ticket.target}: {_short(again)}") from None
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


class _FastTicket:
    __slots__ = ("conn", "channel", "target", "method", "args")

    def __init__(
        self, conn: Connection, channel: FastChannel, target: Target, method: str, args: Any
    ) -> None:
        self.conn = conn
        self.channel = channel
        self.target = target
        self.method = method
        self.args = args


class _Failed:
    """A ticket for a call that could not even be submitted."""

    __slots__ = ("error", "target")

    def __init__(self, target: Target, error: NodeUnavailable) -> None:
        self.target = target
        self.error = error


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
