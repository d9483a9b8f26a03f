"""Per-tenant admission by cost (``kvstore.api.shares``), on a real event loop, no gateway."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.api.shares import CostShares
from kvstore.errors import ConfigError, Overloaded


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


async def _hold(shares: CostShares, tenant: str, cost: int, log: list, release: asyncio.Event):
    async with shares.admit(tenant, cost):
        log.append((tenant, cost, "in"))
        await release.wait()
    log.append((tenant, cost, "out"))


def test_work_within_the_share_runs_at_once_and_more_waits_for_room() -> None:
    async def scenario() -> list:
        shares, log, release = CostShares(100, wait_s=5), [], asyncio.Event()
        first = asyncio.create_task(_hold(shares, "bob", 60, log, release))
        second = asyncio.create_task(_hold(shares, "bob", 60, log, asyncio.Event()))
        await asyncio.sleep(0.05)
        assert shares.running("bob") == 60 and log == [("bob", 60, "in")]  # 120 > 100: waits
        release.set()
        await first
        await asyncio.sleep(0.01)
        assert shares.running("bob") == 60 and log[-1] == ("bob", 60, "in")
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        return [shares.running("bob")]

    assert run(scenario()) == [0]  # a cancelled holder gives its share back


def test_one_tenant_at_its_share_never_holds_back_another() -> None:
    async def scenario() -> None:
        shares, log, release = CostShares(100, wait_s=5), [], asyncio.Event()
        bob = asyncio.create_task(_hold(shares, "bob", 100, log, release))
        await asyncio.sleep(0.01)
        async with shares.admit("alice", 8):  # would wait if the share were global
            assert shares.running("alice") == 8
        release.set()
        await bob

    run(scenario())


def test_a_lookup_larger_than_the_share_runs_alone() -> None:
    async def scenario() -> None:
        shares, log, release = CostShares(100, wait_s=5), [], asyncio.Event()
        big = asyncio.create_task(_hold(shares, "bob", 10_000, log, release))
        small = asyncio.create_task(_hold(shares, "bob", 1, log, release))
        await asyncio.sleep(0.02)
        assert log == [("bob", 10_000, "in")] and shares.running("bob") == 100
        release.set()
        await asyncio.gather(big, small)
        assert ("bob", 1, "in") in log and shares.running("bob") == 0

    run(scenario())


def test_waiters_start_in_arrival_order_so_a_large_one_is_not_starved() -> None:
    async def scenario() -> list:
        shares, log = CostShares(100, wait_s=5), []
        gates = [asyncio.Event() for _ in range(3)]
        holder = asyncio.create_task(_hold(shares, "bob", 50, log, gates[0]))
        await asyncio.sleep(0.01)
        large = asyncio.create_task(_hold(shares, "bob", 100, log, gates[1]))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(_hold(shares, "bob", 10, log, gates[2]))
        await asyncio.sleep(0.01)
        # 50 + 10 would fit, but the large one asked first: the small one waits behind it.
        assert [entry for entry in log if entry[2] == "in"] == [("bob", 50, "in")]
        for gate in gates:
            gate.set()
            await asyncio.sleep(0.01)
        await asyncio.gather(holder, large, small)
        return [entry[1] for entry in log if entry[2] == "in"]

    assert run(scenario()) == [50, 100, 10]


def test_a_wait_past_its_limit_is_refused_naming_the_share_and_leaves_nothing_held() -> None:
    async def scenario() -> str:
        shares, log, release = CostShares(100, wait_s=0.05), [], asyncio.Event()
        holder = asyncio.create_task(_hold(shares, "bob", 100, log, release))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as refused:
            async with shares.admit("bob", 30):
                pass
        release.set()
        await holder
        assert shares.running("bob") == 0
        async with shares.admit("bob", 100):  # the refused waiter left no claim behind
            pass
        return str(refused.value)

    assert "its share is 100" in run(scenario())


@pytest.mark.parametrize(("share", "wait_s"), [(0, 1.0), (10, 0.0)])
def test_a_bad_setting_is_refused_naming_it(share: int, wait_s: float) -> None:
    with pytest.raises(ConfigError):
        CostShares(share, wait_s)
