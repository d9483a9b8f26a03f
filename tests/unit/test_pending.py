"""``Pending``: one result, waited for from a thread or from a loop, mapped once for both."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.pending import Pending


def both_ways(pending_of: object) -> tuple[object, object]:
    """The answer of a fresh ``Pending`` waited for from this thread, and of another one
    awaited on a loop."""
    make = pending_of  # a zero-argument callable making a new Pending each time
    in_thread = make().result()  # type: ignore[operator]

    async def on_loop() -> object:
        return await make()  # type: ignore[operator]

    return in_thread, asyncio.run(on_loop())


def test_each_side_waits_its_own_way_for_the_same_answer() -> None:
    waited: list[str] = []

    def make() -> Pending[int]:
        def in_thread() -> int:
            waited.append("thread")
            return 41

        async def on_loop() -> int:
            await asyncio.sleep(0)
            waited.append("loop")
            return 41

        return Pending(in_thread, on_loop).then(lambda value: value + 1)

    assert both_ways(make) == (42, 42)
    assert waited == ["thread", "loop"]


def test_then_maps_in_order_and_done_and_of_answer_on_both_sides() -> None:
    assert both_ways(lambda: Pending.done([1, 2]).then(len).then(str)) == ("2", "2")
    computed: list[int] = []
    lazy = Pending.of(lambda: computed.append(1) or len(computed))
    assert computed == []  # nothing runs until it is waited for
    assert lazy.result() == 1 and computed == [1]


def test_an_error_reaches_the_waiter_on_either_side() -> None:
    def failing() -> int:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        Pending.of(failing).then(lambda value: value + 1).result()

    async def awaited() -> int:
        return await Pending.of(failing)

    with pytest.raises(KeyError):
        asyncio.run(awaited())


def test_a_thread_wait_runs_in_the_callers_thread() -> None:
    seen: list[str] = []
    pending = Pending.of(lambda: seen.append(threading.current_thread().name))
    worker = threading.Thread(target=pending.result, name="asker")
    worker.start()
    worker.join()
    assert seen == ["asker"]


def test_all_answers_in_order_and_recover_stands_in_for_one_error() -> None:
    def make() -> Pending[list[int]]:
        parts = [Pending.done(1), Pending.of(lambda: 2), Pending.done(3)]
        return Pending.all(parts)

    assert both_ways(make) == ([1, 2, 3], [1, 2, 3])

    def gone() -> int:
        raise KeyError("gone")

    def recovered() -> Pending[int | str]:
        return Pending.of(gone).recover(KeyError, lambda error: f"miss: {error}")

    assert both_ways(recovered) == ("miss: 'gone'", "miss: 'gone'")
    with pytest.raises(KeyError):  # another kind of error is not recovered
        Pending.of(gone).recover(ValueError, lambda error: 0).result()
