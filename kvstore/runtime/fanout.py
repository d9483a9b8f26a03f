"""``RayFanout``: the ``Fanout`` of ``kvstore.blockstore.fanout`` over Ray actor handles.

Every Ray failure a caller can see becomes ``NodeUnavailable`` (``NodeDead`` when Ray reports
the actor dead for good): ``ActorDiedError``, ``ActorUnavailableError`` (restarting, or on a
machine not yet declared dead), ``GetTimeoutError``, ``ActorUnschedulableError`` (not a
``RayActorError``), ``RayTaskError`` (the actor method raised), ``ObjectLostError``. Nothing
from Ray escapes the caller. One remote error keeps its kind: a storage node's ``NodeDraining``
(through Ray or over the socket) comes back as ``NodeDraining``, since a writer treats a draining
node differently from a failed one (it places around it, readers keep using it).

Methods in ``fast_methods`` (a storage node's shard calls, a meta shard's lookups and write
calls, an entrypoint's ``lookup``, an SWA store's ``fetch``: the byte and hit paths) go over the
actor's direct socket instead (``kvstore.fastcall``) when it offers one. The first call
to a target goes through Ray while its endpoint is fetched, unless ``prepare`` fetched it up
front (what a block client of a deployment does: no Ray call on its byte path once it runs). A
call the wire cannot carry (a type it lacks, a request or an answer over the frame limit: a
batch larger than the socket is for) goes through Ray. A removed machine's worker can linger
unresponsive (the kernel still accepts on its socket, nobody answers), so under one deadline:

- calls over connections already open go out at ``submit``; a call that needs a new connection
  is dialed in a thread of its own (``fastcall.client.Dialing``), so dialing an unresponsive
  actor (a host cut off: its SYNs go unanswered for the handshake's whole bound) never holds up
  the other calls of the caller, nor the reading of their replies: waiting watches a dial like
  a connection;
- a call given up on (``cancel``: ``gather`` does it at its deadline) has its connection closed
  (or its dial abandoned), so its late reply is never read as another call's, and its endpoint
  forgotten: the next call goes through Ray, which knows whether the actor is still there, and
  asks it for a new one;
- a connection that breaks (a restarted actor) is retried once through Ray, within the deadline;
- an actor that answers the call itself failed (its method raised, or it was too busy to take
  the request: ``fastcall``'s in-flight budget) fails it as ``NodeUnavailable``, not retried.

So callers see the same outcomes either way.

Waiting uses ``ray.wait`` on the outstanding calls, never a blocking ``ray.get`` on the oldest
one while others are in flight (measured with Ray 2.60: that stalled to ~4 calls/s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from ray.exceptions import ActorDiedError, RayError

from kvstore.blockstore.fanout import Target, Ticket
from kvstore.errors import NodeDead, NodeDraining, NodeUnavailable
from kvstore.fastcall.client import Dialing, FastChannel
from kvstore.fastcall.frames import FastConnection, FrameTooLarge, RemoteError, wait_ready
from kvstore.fastcall.handshake import HANDSHAKE_TIMEOUT_S
from kvstore.fastcall.tls import tls_from_env
from kvstore.runtime.endpoints import FastChannels
from kvstore.wire import WireError

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")
T = TypeVar("T", bound=Ticket[Any])

#: ``result`` of a call not yet reported done waits this long for it.
_RESULT_WAIT_S = 0.5


class RayFanout:
    def __init__(
        self,
        handles: Mapping[Target[Any], Any],
        resolve: Callable[[Target[Any]], Any] | None = None,
        fast_methods: Collection[Callable[..., Any]] = (),
    ) -> None:
        """``handles``: actor handle per target. ``resolve``: optional way to get a handle for a
        target not in ``handles`` (e.g. a node added later), by actor name. ``fast_methods``:
        methods (of a calls Protocol, e.g. ``MetaShardCalls.lookup_wire``) called over the
        actor's direct socket when it offers one (``fast_endpoint()``) and the call passes no
        keyword arguments; through Ray otherwise."""
        self._handles: dict[Target[Any], Any] = dict(handles)
        self._resolve = resolve
        self._fast_methods = frozenset(fast_methods)
        # TLS where the operator set it (the same variables every process of the cluster reads).
        self._fast = FastChannels(tls=tls_from_env()[1])

    def prepare(self, targets: Iterable[Target[Any]], timeout_s: float) -> list[Target[Any]]:
        """Fetch the direct-socket endpoints of ``targets`` now (all at once, waiting up to
        ``timeout_s``), so that their first fast calls do not go through Ray; returns the
        targets still without one (no actor, no socket, no answer in time: those keep going
        through Ray and are asked again later)."""
        handles = {target: self.handle(target) for target in targets}
        missing = [target for target, handle in handles.items() if handle is None]
        live = {target: handle for target, handle in handles.items() if handle is not None}
        return missing + self._fast.prepare(live, timeout_s)

    def handle(self, target: Target[Any]) -> Any:
        handle = self._handles.get(target)
        if handle is None and self._resolve is not None:
            handle = self._resolve(target)
            if handle is not None:
                self._handles[target] = handle
        return handle

    # --- Fanout ----------------------------------------------------------------------------

    def submit(
        self,
        target: Target[A],
        method: Callable[Concatenate[A, P], R],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Ticket[R]:
        call: _Call[R] = _Call(target, method.__name__, args, kwargs)
        handle = self.handle(target)
        if handle is None:
            call.fail(NodeUnavailable(f"no actor for {target}"))
            return call
        channel = None
        if method in self._fast_methods and not kwargs:
            channel = self._fast.get(target, handle)
        if channel is None:
            self._send_via_ray(call, handle)
        else:
            call.channel = channel
            self._start_fast(call)
        return call

    def wait(self, tickets: Collection[T], timeout: float, all_of: bool = False) -> list[T]:
        deadline = time.monotonic() + max(0.0, timeout)
        calls: list[_Call[Any]] = [ticket for ticket in tickets if isinstance(ticket, _Call)]
        if any(call.done for call in calls):
            deadline = time.monotonic()  # failed at submit or already read: report them now
        while True:
            fast = [call for call in calls if call.conn is not None or call.dial is not None]
            slow = [call for call in calls if call.ref is not None and not call.done]
            # One kind in flight: block on it. Both (rare: a fallback during an actor
            # restart): poll each in turn.
            both = bool(fast and slow)
            left = max(0.0, deadline - time.monotonic())
            if fast:
                self._wait_fast(fast, 0.0 if both else left)
            if slow:
                self._wait_ray(slow, 0.0 if both else left, all_of)
            done = {call for call in calls if call.done}
            finished = not (fast or slow) or len(done) == len(calls) or (done and not all_of)
            if finished or time.monotonic() >= deadline:
                return [ticket for ticket in tickets if ticket in done]
            if both:
                time.sleep(min(left, 0.001))

    async def wait_all_async(self, tickets: Collection[Ticket[Any]], timeout: float) -> None:
        """Until every call is done or ``timeout`` passed, the waiting done by the running
        asyncio loop: a socket call's reply is read when the loop sees its connection readable,
        a Ray call's when its ``ObjectRef`` resolves (a socket that broke meanwhile has its call
        retried through Ray, within the same deadline). A call being dialed is watched the same
        way, then its reply."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + max(0.0, timeout)
        calls = [ticket for ticket in tickets if isinstance(ticket, _Call)]
        while True:
            waits: list[asyncio.Future[Any]] = []
            readers: list[int] = []
            refs: list[tuple[_Call[Any], Any]] = []
            for call in calls:
                if call.done:
                    continue
                watched = call.conn if call.conn is not None else call.dial
                if watched is not None:
                    done: asyncio.Future[None] = loop.create_future()
                    fd = watched.fileno()
                    loop.add_reader(fd, self._readable, loop, fd, call, done)
                    readers.append(fd)
                    waits.append(done)
                elif call.ref is not None:
                    future = call.ref.future()
                    refs.append((call, future))
                    waits.append(asyncio.wrap_future(future))
            left = deadline - time.monotonic()
            if not waits or left <= 0:
                return
            try:
                await asyncio.wait(waits, timeout=left)
            finally:
                for fd in readers:
                    loop.remove_reader(fd)
                for wait in waits:
                    wait.cancel()  # not finished in time: ``gather`` cancels the call itself
            for call, future in refs:
                call.ray_done = call.ray_done or future.done()
            for call in calls:  # after the readers are gone: ``_dialed`` closes the dial's fd
                if call.dial is not None and call.dial.finished():
                    self._dialed(call)
            if all(call.done for call in calls) or time.monotonic() >= deadline:
                return

    def _readable(
        self, loop: asyncio.AbstractEventLoop, fd: int, call: _Call[Any], done: Any
    ) -> None:
        loop.remove_reader(fd)
        if call.conn is not None and call.conn.fileno() == fd:
            self._read(call)  # the reply is in: a plain read (or EOF) that does not block long
        # (a dial that is over is taken once every reader is removed: see ``wait_all_async``)
        if not done.done():
            done.set_result(None)

    def result(self, ticket: Ticket[R]) -> R:
        if not isinstance(ticket, _Call):
            raise TypeError(f"not a RayFanout ticket: {ticket!r}")
        if ticket.outcome is None and ticket.ref is None:
            self.wait([ticket], _RESULT_WAIT_S)
            if ticket.dial is not None:  # still dialing: nobody will take it now
                ticket.dial.abandon()
                ticket.dial = None
        if ticket.outcome is not None:
            ok, value = ticket.outcome
            if not ok:
                raise value
            return value
        target = ticket.target
        if ticket.ref is None:
            raise NodeUnavailable(f"{target}.{ticket.method} did not answer")
        try:
            return ray.get(ticket.ref, timeout=_RESULT_WAIT_S)
        except ActorDiedError as error:
            if self._resolve is not None:
                # A replacement may be started under the same name: look it up next time.
                self._handles.pop(target, None)
            raise NodeDead(f"{target} died: {_short(error)}") from None
        except RayError as error:  # unavailable, timeout, unschedulable, task error, lost
            cause = getattr(error, "cause", None)  # a RayTaskError: what the method raised
            if isinstance(cause, NodeDraining):
                raise NodeDraining(f"{target}: {cause}") from None
            log.debug("call to %s failed: %s", target, error)
            raise NodeUnavailable(f"{target}: {type(error).__name__}: {_short(error)}") from None

    def cancel(self, tickets: Iterable[Ticket[Any]]) -> None:
        for call in tickets:
            if not isinstance(call, _Call) or call.channel is None:
                continue  # a Ray call: its result is freed with the ticket
            if call.conn is not None or call.dial is not None:
                # Its late reply must never be read as another call's. And no answer in time:
                # the endpoint may belong to a process that is going away.
                if call.conn is not None:
                    call.conn.close()
                    call.conn = None
                if call.dial is not None:
                    call.dial.abandon()
                    call.dial = None
                self._fast.forget(call.target, call.channel)
            call.channel = None

    # --- the direct socket path ------------------------------------------------------------

    def _start_fast(self, call: _Call[Any]) -> None:
        """Send ``call`` over a free connection of its channel, or dial a new one for it in the
        background: ``submit`` never waits on a dial."""
        assert call.channel is not None
        try:
            started = call.channel.send_or_dial(call.method, call.args, HANDSHAKE_TIMEOUT_S)
        except Exception as error:
            self._not_started(call, error)
            return
        if isinstance(started, Dialing):
            call.dial = started
        else:
            call.conn = started

    def _dialed(self, call: _Call[Any]) -> None:
        """``call``'s dial is over: its reply comes on the new connection, or it goes another
        way."""
        assert call.dial is not None
        outcome = call.dial.take()
        call.dial = None
        if isinstance(outcome, Exception):
            self._not_started(call, outcome)
        else:
            call.conn = outcome

    def _not_started(self, call: _Call[Any], error: Exception) -> None:
        """What sending ``call`` on its socket raised decides where it goes instead."""
        if isinstance(error, (OSError, EOFError)):
            log.debug("fast call to %s did not start: %s", call.target, error)
            self._via_ray_instead(call)
        elif isinstance(error, (TypeError, WireError)):  # not for this wire: the channel is fine
            log.debug("%s.%s goes through Ray: %s", call.target, call.method, error)
            self._via_ray_instead(call, forget=False)
        else:
            raise error

    def _wait_fast(self, calls: list[_Call[Any]], timeout: float) -> None:
        """Read the replies that are in and take the dials that are over, waiting up to
        ``timeout`` for the first."""
        watched: dict[FastConnection | Dialing, _Call[Any]] = {}
        for call in calls:
            key = call.conn if call.conn is not None else call.dial
            assert key is not None
            watched[key] = call
        for ready in wait_ready(list(watched), timeout):
            call = watched[ready]
            if ready is call.dial:
                self._dialed(call)
            else:
                self._read(call)

    def _read(self, call: _Call[Any]) -> None:
        """The reply of a socket call that is ready to read."""
        channel, conn = call.channel, call.conn
        assert channel is not None and conn is not None
        call.conn = None
        try:
            call.succeed(channel.finish(conn))
        except FrameTooLarge as error:  # a batch beyond the socket's frames: the channel is fine
            log.debug("%s.%s goes through Ray: %s", call.target, call.method, error)
            self._via_ray_instead(call, forget=False)
        except RemoteError as error:
            call.fail(_remote_failure(call.target, str(error)))
        except (OSError, EOFError) as error:
            # The socket went stale (the actor restarted on a new port, or died): ask once
            # more through Ray, which knows whether a replacement is up.
            log.debug("fast call to %s lost its connection: %r", call.target, error)
            self._via_ray_instead(call)

    def _via_ray_instead(self, call: _Call[Any], forget: bool = True) -> None:
        """Make this call through Ray: the socket failed (``forget`` its endpoint: asked for
        again through Ray) or cannot carry it."""
        assert call.channel is not None
        if forget:
            self._fast.forget(call.target, call.channel)
        call.channel = None
        self._send_via_ray(call, self.handle(call.target))

    # --- through Ray -----------------------------------------------------------------------

    def _send_via_ray(self, call: _Call[Any], handle: Any) -> None:
        if handle is None:
            call.fail(NodeUnavailable(f"no actor for {call.target}"))
            return
        try:
            call.ref = getattr(handle, call.method).remote(*call.args, **call.kwargs)
        except RayError as error:
            call.fail(NodeUnavailable(f"{call.target}.{call.method}: {error}"))
        # The ticket owns the only reference to the result: a call the caller abandons (a late
        # hedged read) frees it as soon as the caller drops the ticket. Its arguments are
        # not needed any more.
        call.args, call.kwargs = (), {}

    @staticmethod
    def _wait_ray(calls: list[_Call[Any]], timeout: float, all_of: bool) -> None:
        by_ref = {call.ref: call for call in calls}
        refs = list(by_ref)
        ready, rest = ray.wait(refs, num_returns=len(refs) if all_of else 1, timeout=timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready.extend(more)
        for ref in ready:
            by_ref[ref].ray_done = True


class _Call(Ticket[R]):
    """One call: over the actor's socket (``conn``; ``dial`` while its connection is being
    made) or through Ray (``ref``), until its ``outcome`` is known (``(ok, value or error)``)."""

    __slots__ = ("args", "kwargs", "channel", "conn", "dial", "ref", "ray_done", "outcome")

    def __init__(
        self, target: Target[Any], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        super().__init__(target, method)
        self.args = args
        self.kwargs = kwargs
        self.channel: FastChannel | None = None
        self.conn: FastConnection | None = None
        self.dial: Dialing | None = None
        self.ref: Any = None
        self.ray_done = False
        self.outcome: tuple[bool, Any] | None = None

    @property
    def done(self) -> bool:
        """Whether ``result`` answers without waiting."""
        return self.outcome is not None or self.ray_done

    def succeed(self, value: Any) -> None:
        self.outcome = (True, value)
        self.args, self.kwargs = (), {}

    def fail(self, error: NodeUnavailable) -> None:
        self.outcome = (False, error)
        self.args, self.kwargs = (), {}


def _remote_failure(target: Target[Any], text: str) -> NodeUnavailable:
    """What a socket call's remote error (``"<type name>: <message>"``, ``fastcall``) becomes:
    ``NodeDraining`` for a draining node's refusal, ``NodeUnavailable`` for anything else."""
    if text.startswith(f"{NodeDraining.__name__}:"):
        return NodeDraining(f"{target}: {text}")
    return NodeUnavailable(f"{target}: {text}")


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
