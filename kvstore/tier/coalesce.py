"""Natural batching: concurrent callers of one operation share a single batched call.

The gateway answers many QueryHits at once, and each needs one round of calls to every meta
shard and an entrypoint. Issued one by one, the cluster-side call rate grows with concurrency
and queues build up; coalesced, the calls per round stay fixed and a round serves everyone
waiting. There is no timer: the first caller runs a batch at once (no added latency when idle);
callers arriving meanwhile join the next batch, which the same leader runs as soon as the first
returns.

A batch that fails because of what one caller asked (``InvalidArgument``) is run again one item
at a time, so that caller gets its error and everyone else coalesced with it gets an answer.
A failure of the cluster itself fails the batch: asked one by one, it would only fail slower.

``Coalescer`` serves callers in threads; ``AsyncCoalescer`` the same for callers on one asyncio
loop (the gateway's hit path), where a batch is run by a task and callers await its answer.
``Coalesced`` puts the two behind one ``Pending`` per call, so a caller of either kind asks
the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from kvstore.errors import InvalidArgument
from kvstore.pending import Pending

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Slot(Generic[Item, Result]):
    __slots__ = ("item", "result", "error", "finished", "wake")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.wake = threading.Event()  # set when served, or when promoted to run the next batch


class Coalescer(Generic[Item, Result]):
    """``call(item)`` → ``batch([items...])[i]``, with concurrent calls merged into one batch.

    ``batch`` must return one result per item, in order. If it raises, every caller of that
    batch gets the exception (after the one-by-one rerun of an ``InvalidArgument``). A leader
    runs one batch, then hands the lead to a waiting caller, so under steady load no caller
    keeps working for others after its own answer is in.
    """

    def __init__(self, batch: Callable[[Sequence[Item]], Sequence[Result]], max_batch: int = 64):
        self._batch = batch
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._pending: list[_Slot[Item, Result]] = []
        self._leading = False
        self.batches = 0
        self.items = 0

    def call(self, item: Item) -> Result:
        slot: _Slot[Item, Result] = _Slot(item)
        with self._lock:
            self._pending.append(slot)
            lead = not self._leading
            self._leading = True
        while True:
            if lead:
                self._run_batch()
            slot.wake.wait()
            slot.wake.clear()
            if slot.finished:
                break
            lead = True  # promoted: run the next batch (which includes this slot)
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]

    def _run_batch(self) -> None:
        with self._lock:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
        try:
            results = self._batch([slot.item for slot in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"batch answered {len(results)} results for {len(batch)}")
            for slot, result in zip(batch, results, strict=True):
                slot.result = result
        except InvalidArgument as error:
            if len(batch) == 1:
                batch[0].error = error
            else:
                for slot in batch:  # one caller's bad request must not fail the others
                    try:
                        slot.result = self._batch([slot.item])[0]
                    except BaseException as alone:
                        slot.error = alone
        except BaseException as error:  # handed to every caller of this batch
            for slot in batch:
                slot.error = error
        with self._lock:
            self.batches += 1
            self.items += len(batch)
            if self._pending:
                self._pending[0].wake.set()  # the next leader
            else:
                self._leading = False
        for slot in batch:
            slot.finished = True
            slot.wake.set()


class AsyncCoalescer(Generic[Item, Result]):
    """``await call(item)`` → ``(await batch([items...]))[i]``; calls made while a batch is in
    flight form the next one. For callers on one asyncio loop (no locks: the loop is the only
    thread); ``batch`` must return one result per item, in order, or raise (every caller of
    that batch gets the exception)."""

    def __init__(
        self, batch: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]], max_batch: int = 64
    ):
        self._batch = batch
        self._max_batch = max_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._running = False
        self.batches = 0
        self.items = 0

    async def call(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if not self._running:
            self._running = True
            # The first caller runs the batches at once; later callers only wait.
            asyncio.get_running_loop().create_task(self._run())
        return await future

    async def _run(self) -> None:
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                try:
                    results = await self._batch([item for item, _ in batch])
                    if len(results) != len(batch):
                        count = f"{len(results)} results for {len(batch)}"
                        raise RuntimeError(f"batch answered {count}")
                except InvalidArgument as error:
                    if len(batch) == 1:
                        if not batch[0][1].done():
                            batch[0][1].set_exception(error)
                    else:
                        await self._one_by_one(batch)
                except BaseException as error:  # handed to every caller of this batch
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    if not isinstance(error, Exception):
                        raise
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        if not future.done():
                            future.set_result(result)
                self.batches += 1
                self.items += len(batch)
        finally:
            self._running = False

    async def _one_by_one(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        """Rerun a batch that one caller's bad request failed, so only that caller fails."""
        for item, future in batch:
            try:
                result = (await self._batch([item]))[0]
            except Exception as alone:
                if not future.done():
                    future.set_exception(alone)
            else:
                if not future.done():
                    future.set_result(result)


class Coalesced(Generic[Item, Result]):
    """One batched operation for callers of both kinds: ``call(item)`` is a ``Pending``
    (``kvstore.pending``) that a thread waits for through a ``Coalescer`` and a loop through
    an ``AsyncCoalescer``; ``batch`` is written once, returning a ``Pending`` itself."""

    def __init__(
        self, batch: Callable[[Sequence[Item]], Pending[Sequence[Result]]], max_batch: int = 64
    ) -> None:
        self.threads: Coalescer[Item, Result] = Coalescer(
            lambda items: batch(items).result(), max_batch
        )

        async def on_loop(items: Sequence[Item]) -> Sequence[Result]:
            return await batch(items)

        self.loop: AsyncCoalescer[Item, Result] = AsyncCoalescer(on_loop, max_batch)

    def call(self, item: Item) -> Pending[Result]:
        return Pending(lambda: self.threads.call(item), lambda: self.loop.call(item))

    @property
    def batches(self) -> int:
        return self.threads.batches + self.loop.batches

    @property
    def items(self) -> int:
        return self.threads.items + self.loop.items
