"""How clients reach the cluster's actors: submit calls, wait for some, read outcomes.

The block tier's logic (which nodes to ask, hedging, decoding, the write protocol, repair, GC)
is written against this small protocol so it runs unchanged over Ray
(``kvstore.runtime.fanout.RayFanout``) and in-process over plain objects (``LocalFanout``, for
unit tests, with switches to make a target dead or hung).

A call names its method through the Protocol of what the target offers
(``kvstore.blockstore.calls``), never by a string, so mypy checks the arguments, the result type
and that the method belongs to the target's kind::

    ticket = fanout.submit(node_target(3), StorageNodeCalls.holds, keys)
    held = fanout.result(ticket)  # list[bool]

The fanouts dispatch by the method's name. ``gather`` is the one way to wait for many calls
under one deadline (``gathered``: the same as a ``kvstore.pending.Pending``, for callers on
either side of an asyncio loop).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, Protocol, TypeVar

from kvstore.errors import NodeUnavailable
from kvstore.pending import Pending

NODE = "node"
META = "meta"
#: SWA entrypoints (directory shards); their ids are shard names (strings).
ENTRY = "entry"

P = ParamSpec("P")
R = TypeVar("R")
#: What a target offers (a Protocol of its calls); ties a target to the methods it answers.
Offers = TypeVar("Offers", covariant=True)
A = TypeVar("A")  # the same, as a free parameter of ``submit``
T = TypeVar("T", bound="Ticket[Any]")


class Target(NamedTuple, Generic[Offers]):
    """``(kind, id)`` of one actor, e.g. ``("node", 3)`` or ``("entry", "e0")``; typed with
    what it offers (``kvstore.blockstore.calls.node_target``). Equal to the plain tuple."""

    kind: str
    id: int | str

    def __str__(self) -> str:
        return f"{self.kind} {self.id}"


class Ticket(Generic[R]):
    """One call in flight (hashable by identity); ``R`` is its result type."""

    __slots__ = ("target", "method")

    def __init__(self, target: Target[Any], method: str) -> None:
        self.target = target
        self.method = method

    def __repr__(self) -> str:
        return f"<{self.target}.{self.method}>"


class Fanout(Protocol):
    def submit(
        self,
        target: Target[A],
        method: Callable[Concatenate[A, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Ticket[R]:
        """Start ``method(*args, **kwargs)`` on ``target``. Never blocks on a dial
        (``RayFanout`` dials a new socket in the background). Wait for every call, or cancel
        it: its reply, or its dial, holds a connection until then."""
        ...

    def wait(self, tickets: Collection[T], timeout: float, all_of: bool = False) -> list[T]:
        """Tickets of ``tickets`` that are done, waiting up to ``timeout`` s for at least one
        (``all_of``: for all of them)."""
        ...

    async def wait_all_async(self, tickets: Collection[Ticket[Any]], timeout: float) -> None:
        """``wait(tickets, timeout, all_of=True)`` for a caller on an asyncio loop: the loop
        keeps serving while the calls are in flight (no thread parks on them)."""
        ...

    def result(self, ticket: Ticket[R]) -> R:
        """Outcome of a done ticket; raises ``NodeUnavailable`` when the target failed."""
        ...

    def cancel(self, tickets: Iterable[Ticket[Any]]) -> None:
        """The caller gave up on ``tickets`` (their deadline passed)."""
        ...


def gather(
    fanout: Fanout, tickets: Iterable[Ticket[R]], timeout: float
) -> dict[Ticket[R], R | NodeUnavailable]:
    """Wait up to ``timeout`` s for every ticket; each maps (in the order given) to its result
    or to the ``NodeUnavailable`` it failed with. A call not answered in time fails naming its
    target and method, and is cancelled."""
    return _collect(fanout, list(tickets), time.monotonic() + timeout, timeout)


async def gather_async(
    fanout: Fanout, tickets: Iterable[Ticket[R]], timeout: float
) -> dict[Ticket[R], R | NodeUnavailable]:
    """``gather`` for a caller on an asyncio loop (the gateway's hit path): the same outcomes,
    the waiting done by the loop."""
    order = list(tickets)
    await fanout.wait_all_async(order, timeout)
    return _collect(fanout, order, time.monotonic(), timeout)


def gathered(
    fanout: Fanout, tickets: Iterable[Ticket[R]], timeout: float
) -> Pending[dict[Ticket[R], R | NodeUnavailable]]:
    """``gather`` as a ``Pending``: waited for from a thread (``gather``) or from a loop
    (``gather_async``), whichever side the caller is on."""
    order = list(tickets)
    return Pending(
        lambda: gather(fanout, order, timeout), lambda: gather_async(fanout, order, timeout)
    )


def _collect(
    fanout: Fanout, order: list[Ticket[R]], deadline: float, timeout: float
) -> dict[Ticket[R], R | NodeUnavailable]:
    outcomes: dict[Ticket[R], R | NodeUnavailable] = {}
    pending = set(order)
    while pending:  # at least one look, even with the deadline already reached
        left = max(0.0, deadline - time.monotonic())
        ready = fanout.wait(list(pending), left)
        for ticket in ready:
            pending.discard(ticket)
            try:
                outcomes[ticket] = fanout.result(ticket)
            except NodeUnavailable as error:
                outcomes[ticket] = error
        if not ready and time.monotonic() >= deadline:
            break
    if pending:
        fanout.cancel(pending)
    for ticket in pending:
        outcomes[ticket] = NodeUnavailable(
            f"{ticket.target}.{ticket.method} did not answer in {timeout} s"
        )
    return {ticket: outcomes[ticket] for ticket in order}


class LocalFanout:
    """Runs calls synchronously on plain objects; ``dead`` targets fail, ``hung`` never answer,
    ``late_once`` never answer their next call and are served normally after it (a node slow
    for one read). ``calls`` logs ``(target, method name)`` of every call."""

    def __init__(self, targets: Mapping[Target[Any], object]) -> None:
        self.targets: dict[Target[Any], object] = dict(targets)
        self.dead: set[Target[Any]] = set()
        self.hung: set[Target[Any]] = set()
        self.late_once: set[Target[Any]] = set()
        self.calls: list[tuple[Target[Any], str]] = []
        self._outcomes: dict[Ticket[Any], tuple[bool, Any]] = {}
        self._never: set[Ticket[Any]] = set()
        # The plain objects behind it are single-threaded (like an actor); the block client's
        # release flusher thread calls in too.
        self._lock = threading.RLock()

    def submit(
        self,
        target: Target[A],
        method: Callable[Concatenate[A, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Ticket[R]:
        with self._lock:
            return self._submit(Ticket(target, method.__name__), args, kwargs)

    def _submit(
        self, ticket: Ticket[R], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Ticket[R]:
        target, method = ticket.target, ticket.method
        self.calls.append((target, method))
        if target in self.hung or target in self.late_once:
            self.late_once.discard(target)
            self._never.add(ticket)
            return ticket
        if target in self.dead or target not in self.targets:
            self._outcomes[ticket] = (False, NodeUnavailable(f"{target} is down"))
            return ticket
        served = self.targets[target]
        try:
            value = getattr(served, method)(*args, **kwargs)
            self._outcomes[ticket] = (True, value)
        except Exception as error:  # the remote side raised: the caller sees a failed target
            self._outcomes[ticket] = (False, NodeUnavailable(f"{target}.{method}: {error!r}"))
        after = getattr(served, "after_reply", None)
        if after is not None:  # what a served actor does once its reply is out (fastcall)
            after()
        return ticket

    def wait(self, tickets: Collection[T], timeout: float, all_of: bool = False) -> list[T]:
        ready = [ticket for ticket in tickets if ticket not in self._never]
        hung = len(ready) < len(tickets)
        if hung and timeout > 0 and (all_of or not ready):
            time.sleep(timeout)  # a hung ticket never becomes ready: waiting is all one can do
        return ready

    async def wait_all_async(self, tickets: Collection[Ticket[Any]], timeout: float) -> None:
        if any(ticket in self._never for ticket in tickets) and timeout > 0:
            await asyncio.sleep(timeout)  # a hung call never answers: the deadline passes

    def result(self, ticket: Ticket[R]) -> R:
        with self._lock:
            ok, value = self._outcomes.pop(ticket)
        if not ok:
            raise value
        return value

    def cancel(self, tickets: Iterable[Ticket[Any]]) -> None:
        """Nothing runs in the background here: a hung call simply never answers."""
