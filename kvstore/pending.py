"""``Pending``: a result on its way, waited for from a thread or from an asyncio loop.

The hit path is asked both ways: by threads (an engine, a tool, the gateway's pool) and from the
gateway's event loop, where a parked thread per QueryHit would cap its concurrency. Rather than a
sync and an ``_async`` twin of every call on the way down, each layer returns one ``Pending``
and maps what comes back with ``then``; only the bottom says how to wait each way (the fanout's
``gather`` and ``gather_async``, a coalescer's thread and loop forms). A caller picks its side
once: ``pending.result()`` in a thread, ``await pending`` on a loop.

Nothing is sent until the first wait (the bottom's thunks run then), so a ``Pending`` that is
never waited for costs nothing; each is waited for once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

R = TypeVar("R", covariant=True)
S = TypeVar("S")


class Pending(Generic[R]):
    """``result()`` from a thread, ``await`` from a loop: the same answer either way."""

    __slots__ = ("_wait", "_wait_async")

    def __init__(self, wait: Callable[[], R], wait_async: Callable[[], Awaitable[R]]) -> None:
        self._wait = wait
        self._wait_async = wait_async

    @classmethod
    def done(cls, value: S) -> Pending[S]:
        """An answer already here (an in-process part: nothing to wait for)."""

        async def ready() -> S:
            return value

        return Pending(lambda: value, ready)

    @classmethod
    def of(cls, compute: Callable[[], S]) -> Pending[S]:
        """An answer computed when waited for, in the waiter's thread or on its loop (an
        in-process part that does not block: files, stand-ins)."""

        async def computed() -> S:
            return compute()

        return Pending(compute, computed)

    def then(self, step: Callable[[R], S]) -> Pending[S]:
        """The answer mapped by ``step`` (run in whichever side waits)."""
        wait, wait_async = self._wait, self._wait_async

        async def mapped() -> S:
            return step(await wait_async())

        return Pending(lambda: step(wait()), mapped)

    def recover(self, error: type[BaseException], fallback: Callable[[Any], S]) -> Pending[R | S]:
        """The answer, or ``fallback(exception)`` when waiting raised ``error``."""
        wait, wait_async = self._wait, self._wait_async

        def waited() -> R | S:
            try:
                return wait()
            except error as raised:
                return fallback(raised)

        async def awaited() -> R | S:
            try:
                return await wait_async()
            except error as raised:
                return fallback(raised)

        return Pending(waited, awaited)

    @staticmethod
    def all(parts: Sequence[Pending[S]]) -> Pending[list[S]]:
        """Every part's answer, in order: one after another from a thread, together on a loop
        (where they share a round of calls)."""

        if len(parts) == 1:  # nothing to run together: no task for the loop to schedule
            return parts[0].then(lambda answer: [answer])

        async def together() -> list[S]:
            return list(await asyncio.gather(*(part._wait_async() for part in parts)))

        return Pending(lambda: [part.result() for part in parts], together)

    def result(self) -> R:
        """Wait in this thread."""
        return self._wait()

    def __await__(self) -> Generator[Any, None, R]:
        return self._wait_async().__await__()
