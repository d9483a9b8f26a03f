"""The gateway's byte budget (``kvstore.api.budget``), who is calling (``kvstore.api.auth``), the
coalescers' isolation of one caller's bad request (``kvstore.tier.coalesce``) and
``LeaseTable.peek``."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.api.auth import Authenticator, bearer_token, certificate_subject
from kvstore.api.budget import MIB, BudgetLimits, ByteBudget
from kvstore.clock import ManualClock
from kvstore.errors import (
    ConfigError,
    InvalidArgument,
    NodeUnavailable,
    Overloaded,
    StoreError,
    Unauthenticated,
)
from kvstore.tenants import DEFAULT_TENANT, TenantDirectory
from kvstore.tier.coalesce import AsyncCoalescer, Coalescer
from kvstore.tier.leases import LeaseTable

SECRET = b"s" * 32

# --- ByteBudget ---------------------------------------------------------------------------------


def limits(**overrides: float) -> BudgetLimits:
    values: dict[str, Any] = {
        "total_bytes": 8 * MIB,
        "tenant_bytes": 4 * MIB,
        "connection_bytes": 2 * MIB,
        "wait_s": 30.0,
    }
    values.update(overrides)
    return BudgetLimits(**values)


async def spin() -> None:
    """Let every ready task run (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_reservations_that_fit_are_held_and_given_back() -> None:
    async def main() -> None:
        budget = ByteBudget(limits())
        await budget.acquire(MIB, "alice", "c1")
        await budget.acquire(MIB, "alice", "c1")  # the connection's cap exactly
        await budget.acquire(2 * MIB, "alice", "c2")
        await budget.acquire(2 * MIB, "bob", "c3")
        assert (budget.total, budget.held_by("alice"), budget.held_by("bob")) == (
            6 * MIB,
            4 * MIB,
            2 * MIB,
        )
        budget.release(2 * MIB, "alice", "c1")
        budget.release(0, "alice", "c2")  # nothing to give back
        assert (budget.total, budget.held_by("alice")) == (4 * MIB, 2 * MIB)
        budget.release(2 * MIB, "alice", "c2")
        budget.release(2 * MIB, "bob", "c3")
        assert (budget.total, budget.held_by("alice"), budget.held_by("bob")) == (0, 0, 0)

    asyncio.run(main())


def test_a_reservation_waits_and_is_woken_by_a_release() -> None:
    async def main() -> None:
        budget = ByteBudget(limits())
        await budget.acquire(2 * MIB, "alice", "c1")
        waiting = asyncio.ensure_future(budget.acquire(MIB, "alice", "c1"))  # connection full
        await spin()
        assert not waiting.done() and budget.held_by("alice") == 2 * MIB
        budget.release(MIB, "alice", "c1")
        await asyncio.wait_for(waiting, 10)
        assert waiting.exception() is None
        assert (budget.total, budget.held_by("alice")) == (2 * MIB, 2 * MIB)

    asyncio.run(main())


def test_a_release_that_leaves_no_room_for_the_waiter_keeps_it_waiting() -> None:
    async def main() -> None:
        budget = ByteBudget(limits(total_bytes=5 * MIB))
        await budget.acquire(2 * MIB, "alice", "a1")
        await budget.acquire(2 * MIB, "alice", "a2")  # alice at her tenant cap
        await budget.acquire(MIB, "bob", "b1")  # the last MiB of the total
        waiting = asyncio.ensure_future(budget.acquire(MIB, "alice", "a3"))
        await spin()
        budget.release(MIB, "bob", "b1")  # room in the total, none in alice's cap
        await spin()
        assert not waiting.done()
        budget.release(MIB, "alice", "a1")
        await asyncio.wait_for(waiting, 10)
        assert (budget.held_by("alice"), budget.total) == (4 * MIB, 4 * MIB)

    asyncio.run(main())


def test_a_reservation_that_never_gets_room_times_out_naming_tenant_and_connection() -> None:
    async def main() -> None:
        budget = ByteBudget(limits(wait_s=0.05))
        await budget.acquire(2 * MIB, "alice", "c1")
        with pytest.raises(Overloaded) as raised:
            await budget.acquire(MIB, "alice", "c1")
        message = str(raised.value)
        assert "'alice'" in message and f"holds {2 * MIB}" in message
        assert f"this connection {2 * MIB}" in message and "0.05 s" in message
        assert raised.value.grpc_status == "RESOURCE_EXHAUSTED"
        # Nothing was reserved by the refused request.
        assert (budget.total, budget.held_by("alice")) == (2 * MIB, 2 * MIB)
        await budget.acquire(MIB, "alice", "c2")  # another connection still fits

    asyncio.run(main())


def test_one_reservation_larger_than_a_cap_is_refused_at_once() -> None:
    async def main() -> None:
        budget = ByteBudget(limits(wait_s=600.0))  # a wait would hang the test
        for size in (2 * MIB + 1, 4 * MIB, 9 * MIB):
            with pytest.raises(Overloaded, match=f"would hold {size} bytes at once"):
                await asyncio.wait_for(budget.acquire(size, "alice", "c1"), 60)
        assert budget.total == 0
        await budget.acquire(2 * MIB, "alice", "c1")  # at the smallest cap: fits

    asyncio.run(main())


def test_the_tenant_cap_is_per_tenant() -> None:
    async def main() -> None:
        budget = ByteBudget(limits(wait_s=0.05))
        await budget.acquire(2 * MIB, "alice", "a1")
        await budget.acquire(2 * MIB, "alice", "a2")
        with pytest.raises(Overloaded, match="'alice'"):
            await budget.acquire(MIB, "alice", "a3")  # a fresh connection: alice is full
        await budget.acquire(2 * MIB, "bob", "b1")  # bob is not
        await budget.acquire(2 * MIB, "bob", "b2")
        assert (budget.held_by("alice"), budget.held_by("bob"), budget.total) == (
            4 * MIB,
            4 * MIB,
            8 * MIB,
        )
        with pytest.raises(Overloaded, match="'carol'"):
            await budget.acquire(MIB, "carol", "c1")  # now the total is full

    asyncio.run(main())


def test_budget_limits_are_checked() -> None:
    for field, value in (
        ("total_bytes", MIB - 1),
        ("tenant_bytes", 0),
        ("connection_bytes", 1),
        ("wait_s", 0),
    ):
        with pytest.raises(ConfigError) as raised:
            limits(**{field: value})
        assert raised.value.field == field


# --- bearer_token and Authenticator -------------------------------------------------------------


def test_bearer_token_takes_exactly_one_bearer_header() -> None:
    assert bearer_token([]) is None
    assert bearer_token([("user-agent", "grpc"), ("x-other", "Bearer no")]) is None
    assert bearer_token([("authorization", "Bearer tok-1")]) == b"tok-1"
    assert bearer_token([("authorization", "bearer tok-2")]) == b"tok-2"
    assert bearer_token([("authorization", "BEARER tok-3")]) == b"tok-3"
    assert bearer_token([("authorization", "BeArEr  tok-4  ")]) == b"tok-4"
    assert bearer_token([("authorization", b"Bearer tok-5")]) == b"tok-5"
    with pytest.raises(Unauthenticated, match="2 authorization headers"):
        bearer_token([("authorization", "Bearer a"), ("authorization", "Bearer a")])
    for value in ("Basic dXNlcjpwYXNz", "Bearer", "Bearertok", "tok", ""):
        with pytest.raises(Unauthenticated, match="not 'Bearer <token>'"):
            bearer_token([("authorization", value)])


def _tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(
        "[tenants.alice]\n"
        'tokens = ["alice-token-00001"]\n'
        'subjects = ["alice-engine"]\n'
        "[tenants.bob]\n"
        'tokens = ["bob-token-0000001"]\n'
    )
    os.chmod(path, 0o600)
    return path


def test_an_open_gateway_serves_everyone_as_the_default_tenant() -> None:
    auth = Authenticator(TenantDirectory(SECRET))
    assert auth.open
    tenant = auth.tenant([])
    assert (tenant.name, tenant.admin) == (DEFAULT_TENANT, True)
    with pytest.raises(Unauthenticated, match="wrong bearer token"):
        auth.tenant([("authorization", "Bearer whatever-it-is")])  # no tokens: none is right
    assert not Authenticator(TenantDirectory(SECRET), client_certificates=True).open


def test_a_token_names_its_tenant_and_a_missing_or_wrong_one_is_refused(tmp_path: Path) -> None:
    auth = Authenticator(TenantDirectory(SECRET, tokens_file=_tokens_file(tmp_path)))
    assert not auth.open
    assert auth.tenant([("authorization", "Bearer alice-token-00001")]).name == "alice"
    assert auth.tenant([("authorization", b"bearer bob-token-0000001")]).name == "bob"
    with pytest.raises(Unauthenticated, match="missing bearer token"):
        auth.tenant([])
    with pytest.raises(Unauthenticated, match="wrong bearer token"):
        auth.tenant([("authorization", "Bearer alice-token-00002")])
    with pytest.raises(Unauthenticated, match="authorization headers"):
        auth.tenant(
            [
                ("authorization", "Bearer alice-token-00001"),
                ("authorization", "Bearer bob-token-0000001"),
            ]
        )
    static = Authenticator(TenantDirectory(SECRET, static_token="the-static-token-1"))
    assert static.tenant([("authorization", "Bearer the-static-token-1")]).name == DEFAULT_TENANT
    with pytest.raises(Unauthenticated, match="missing"):
        static.tenant([])


def test_a_client_certificate_subject_names_its_tenant(tmp_path: Path) -> None:
    directory = TenantDirectory(SECRET, tokens_file=_tokens_file(tmp_path))
    auth = Authenticator(directory, client_certificates=True)
    context = {"x509_common_name": [b"alice-engine"]}
    assert certificate_subject(context) == "alice-engine"
    assert auth.tenant([], context).name == "alice"
    with pytest.raises(Unauthenticated, match="'stranger' is no tenant's"):
        auth.tenant([], {"x509_common_name": [b"stranger"]})
    for missing in (None, {}, {"x509_common_name": []}):
        with pytest.raises(Unauthenticated, match="no client certificate common name"):
            auth.tenant([], missing)
    # A bearer token, when given, is what names the tenant.
    assert auth.tenant([("authorization", "Bearer bob-token-0000001")], context).name == "bob"
    with pytest.raises(Unauthenticated, match="wrong bearer token"):
        auth.tenant([("authorization", "Bearer nobody-token-00")], context)


# --- coalescer isolation ------------------------------------------------------------------------

BAD = 13


class _Announcing(list):  # type: ignore[type-arg]
    """The coalescer's queue of callers, telling when a caller joined it."""

    def __init__(self, joined: threading.Semaphore) -> None:
        super().__init__()
        self._joined = joined

    def append(self, item: object) -> None:
        super().append(item)
        self._joined.release()


def _threaded_batch_of(
    items: list[int], batch: Any, coalescer_calls: list[list[int]]
) -> dict[int, object]:
    """Run ``call(item)`` for each item in threads so that items[1:] form ONE batch (the first
    runs alone while they queue behind it); returns item -> result or exception."""
    gate = threading.Event()
    first_running = threading.Event()

    def held(batch_items: Sequence[int]) -> list[int]:
        coalescer_calls.append(list(batch_items))
        if len(coalescer_calls) == 1:
            first_running.set()
            assert gate.wait(30)
        return batch(batch_items)

    joined = threading.Semaphore(0)
    coalescer: Coalescer[int, int] = Coalescer(held)
    coalescer._pending = _Announcing(joined)
    outcome: dict[int, object] = {}

    def caller(item: int) -> None:
        try:
            outcome[item] = coalescer.call(item)
        except BaseException as error:  # recorded for the assertions
            outcome[item] = error

    threads = [threading.Thread(target=caller, args=(item,)) for item in items]
    threads[0].start()
    assert first_running.wait(30)
    for thread in threads[1:]:
        thread.start()
    for _ in items:
        assert joined.acquire(timeout=30)  # every caller is queued
    gate.set()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return outcome


def _batch_failing_on_bad(error: type[Exception]) -> Any:
    def batch(items: Sequence[int]) -> list[int]:
        if BAD in items:
            if error is InvalidArgument:
                raise InvalidArgument(f"items[{list(items).index(BAD)}]", "unlucky")
            raise error("the cluster is down")
        return [item * 10 for item in items]

    return batch


def test_threaded_one_bad_item_fails_alone() -> None:
    calls: list[list[int]] = []
    outcome = _threaded_batch_of([1, 2, BAD, 4, 5], _batch_failing_on_bad(InvalidArgument), calls)
    assert outcome[1] == 10 and outcome[2] == 20 and outcome[4] == 40 and outcome[5] == 50
    assert isinstance(outcome[BAD], InvalidArgument)
    assert calls[0] == [1] and sorted(calls[1]) == [2, 4, 5, BAD]
    assert sorted(map(tuple, calls[2:])) == [(2,), (4,), (5,), (BAD,)]  # one by one, once


@pytest.mark.parametrize("error", [StoreError, NodeUnavailable, Overloaded])
def test_threaded_a_cluster_failure_fails_the_whole_batch_without_reruns(
    error: type[Exception],
) -> None:
    calls: list[list[int]] = []
    outcome = _threaded_batch_of([1, 2, BAD, 4], _batch_failing_on_bad(error), calls)
    assert outcome[1] == 10
    assert all(isinstance(outcome[item], error) for item in (2, BAD, 4))
    assert len(calls) == 2 and sorted(calls[1]) == [2, 4, BAD]  # no rerun one by one


def test_threaded_a_batch_of_one_bad_item_is_not_rerun() -> None:
    calls: list[list[int]] = []

    def batch(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        raise InvalidArgument("items[0]", "bad")

    coalescer: Coalescer[int, int] = Coalescer(batch)
    with pytest.raises(InvalidArgument):
        coalescer.call(BAD)
    assert calls == [[BAD]]


def _async_batch_of(items: list[int], batch: Any, calls: list[list[int]]) -> dict[int, object]:
    async def main() -> dict[int, object]:
        gate = asyncio.Event()

        async def held(batch_items: Sequence[int]) -> list[int]:
            calls.append(list(batch_items))
            if len(calls) == 1:
                await gate.wait()
            return batch(batch_items)

        coalescer: AsyncCoalescer[int, int] = AsyncCoalescer(held)
        first = asyncio.ensure_future(coalescer.call(items[0]))
        await spin()  # the first batch is running, held at the gate
        rest = [asyncio.ensure_future(coalescer.call(item)) for item in items[1:]]
        await spin()
        gate.set()
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        return dict(zip(items, answers, strict=True))

    return asyncio.run(main())


def test_async_one_bad_item_fails_alone() -> None:
    calls: list[list[int]] = []
    outcome = _async_batch_of([1, 2, BAD, 4, 5], _batch_failing_on_bad(InvalidArgument), calls)
    assert {item: outcome[item] for item in (1, 2, 4, 5)} == {1: 10, 2: 20, 4: 40, 5: 50}
    assert isinstance(outcome[BAD], InvalidArgument)
    assert calls == [[1], [2, BAD, 4, 5], [2], [BAD], [4], [5]]


@pytest.mark.parametrize("error", [StoreError, NodeUnavailable, Overloaded])
def test_async_a_cluster_failure_fails_the_whole_batch_without_reruns(
    error: type[Exception],
) -> None:
    calls: list[list[int]] = []
    outcome = _async_batch_of([1, 2, BAD, 4], _batch_failing_on_bad(error), calls)
    assert outcome[1] == 10
    assert all(isinstance(outcome[item], error) for item in (2, BAD, 4))
    assert calls == [[1], [2, BAD, 4]]


# --- LeaseTable.peek ----------------------------------------------------------------------------


class _Lease:
    def __init__(self, lease_id: str, until: float) -> None:
        self.lease_id = lease_id
        self.until = until


def test_peek_finds_a_lease_in_its_time_and_leaves_it_in_the_table() -> None:
    clock = ManualClock(1000.0)
    table: LeaseTable[_Lease] = LeaseTable(10, clock)
    lease = _Lease("l1", until=1010.0)
    assert table.add(lease) == []
    assert table.peek("l1") is lease
    assert table.peek("l1") is lease and len(table) == 1  # not taken
    assert table.peek("l2") is None
    clock.advance(10)
    assert table.peek("l1") is lease  # at its end: still valid
    clock.advance(0.5)
    assert table.peek("l1") is None  # past it
    assert len(table) == 1  # peek drops nothing: the sweep does
    assert table.sweep() == [lease] and len(table) == 0
    table.add(_Lease("l3", until=2000.0))
    assert table.take("l3") is not None
    assert table.peek("l3") is None  # taken
