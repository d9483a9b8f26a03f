"""Natural batching: concurrent calls share batches, results go to the right caller."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvstore.tier.coalesce import Coalescer


def test_a_lone_call_is_a_batch_of_one() -> None:
    seen: list[list[int]] = []

    def batch(items: Sequence[int]) -> list[int]:
        seen.append(list(items))
        return [item * 2 for item in items]

    coalescer: Coalescer[int, int] = Coalescer(batch)
    assert coalescer.call(21) == 42
    assert seen == [[21]]


def test_concurrent_calls_are_merged_and_each_gets_its_own_answer() -> None:
    gate = threading.Event()
    first_running = threading.Event()
    sizes: list[int] = []

    def batch(items: Sequence[int]) -> list[int]:
        if not sizes and not first_running.is_set():
            first_running.set()
            gate.wait(timeout=10)  # hold the first batch so the others queue behind it
        sizes.append(len(items))
        return [item + 1000 for item in items]

    coalescer: Coalescer[int, int] = Coalescer(batch)
    results: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, coalescer.call(i)))
        for i in range(20)
    ]
    threads[0].start()
    assert first_running.wait(timeout=10)  # the first call is running its batch
    for thread in threads[1:]:
        thread.start()
    for _ in range(10_000):
        if len(coalescer._pending) == 19:
            break
        threading.Event().wait(0.001)
    gate.set()
    for thread in threads:
        thread.join(timeout=10)
    assert results == {i: i + 1000 for i in range(20)}
    assert sizes[0] == 1 and sum(sizes) == 20 and len(sizes) < 20  # the 19 rode together


def test_an_error_reaches_every_caller_of_that_batch() -> None:
    def batch(items: Sequence[int]) -> list[int]:
        raise ValueError(f"boom {list(items)}")

    coalescer: Coalescer[int, int] = Coalescer(batch)
    with pytest.raises(ValueError, match="boom"):
        coalescer.call(1)
    # The coalescer is not wedged by the failure.
    coalescer._batch = lambda items: list(items)
    assert coalescer.call(7) == 7


def test_async_calls_made_while_a_batch_runs_form_the_next_one() -> None:
    """On one asyncio loop: the first call runs at once, the calls made meanwhile share the next
    batch, each caller gets its own answer, and a failing batch fails its callers only."""
    import asyncio

    from kvstore.tier.coalesce import AsyncCoalescer

    sizes: list[list[int]] = []

    async def batch(items: Sequence[int]) -> list[int]:
        sizes.append(list(items))
        await asyncio.sleep(0.01)  # in flight: later callers queue behind it
        if 13 in items:
            raise ValueError("unlucky batch")
        return [item * 10 for item in items]

    async def main() -> None:
        coalescer: AsyncCoalescer[int, int] = AsyncCoalescer(batch)
        first = asyncio.ensure_future(coalescer.call(1))
        await asyncio.sleep(0)  # the first batch is running
        rest = [asyncio.ensure_future(coalescer.call(i)) for i in (2, 3, 4)]
        assert await first == 10
        assert [await r for r in rest] == [20, 30, 40]
        assert sizes == [[1], [2, 3, 4]]
        assert (coalescer.batches, coalescer.items) == (2, 4)
        doomed = asyncio.ensure_future(coalescer.call(13))
        with pytest.raises(ValueError, match="unlucky"):
            await doomed
        assert await coalescer.call(5) == 50  # the coalescer goes on after a failed batch

    asyncio.run(main())
