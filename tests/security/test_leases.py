"""Security review of ``kvstore up`` (issue 15), finding 4: lease exhaustion.

The attack: a QueryHit repeating one key took a lease per copy; 23 of them pinned a block at
the uint16 counter's 65,535, after which every lookup including that block raised — and since
concurrent QueryHits are coalesced into one meta-shard call, unrelated tenants' lookups in the
same batch failed too. Now: keys are checked for repeats before anything is leased, the counter
saturates instead of raising, a batch one request fails is answered one by one, and each tenant
has a lease cap so one cannot push another's leases out of the gateway's bounded table.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
from conftest import Tenants
from test_tenants import payloads, prompt

from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.blockstore.index import BlockIndex
from kvstore.errors import InvalidArgument
from kvstore.tier.coalesce import AsyncCoalescer, Coalescer
from kvstore.tier.records import HitRequest

NOW = 1_700_000_000.0


def test_a_query_repeating_one_key_is_refused_before_any_lease(
    stub: pb_grpc.KVStoreStub, tenants: Tenants
) -> None:
    _, keys = prompt(tenants, 201, 1)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, payloads(keys), "chatbot")
    request = pb.QueryHitRequest(
        block_keys_packed=keys[0] * 500, prompt_len=500 * 128 + 200, take_lease=True
    )
    with tenants.client("bob") as bob:
        held = bob.stats().extra.get("open_leases")
        with pytest.raises(grpc.RpcError) as error:
            stub.QueryHit(request, metadata=tenants.auth("bob"))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_keys[1]" in (error.value.details() or "")
        assert bob.stats().extra.get("open_leases") == held


def test_a_lease_counter_saturates_instead_of_failing_the_lookup() -> None:
    index = BlockIndex(stripe_width=12)
    rows = index.upsert(
        np.ones((1, 4), dtype=np.uint64), np.zeros((1, 12), dtype=np.int64), [100], [0], NOW
    )
    for _ in range(3):  # 90,000 leases on one block: past the uint16 counter
        index.acquire_lease(np.repeat(rows, 30_000), NOW + 60)
    assert index.is_leased(rows, NOW).all()
    # Saturated: how many it stands for is lost, so releases never free it early ...
    index.release_lease(np.repeat(rows, 90_000))
    assert index.is_leased(rows, NOW + 30).all()
    # ... only the lease's end does.
    assert not index.is_leased(rows, NOW + 61).any()


def _batch(items: Sequence[int]) -> list[int]:
    """A batched call that fails as a whole when one item is bad (as a meta shard does)."""
    if any(item < 0 for item in items):
        raise InvalidArgument("keys", f"bad request {min(items)}")
    return [item * 10 for item in items]


def test_one_bad_request_does_not_fail_the_others_coalesced_with_it() -> None:
    gate, first_in = threading.Event(), threading.Event()

    def slow(items: Sequence[int]) -> list[int]:
        first_in.set()
        gate.wait(5)  # the first batch holds the others back so they coalesce
        return _batch(items)

    coalescer: Coalescer[int, int] = Coalescer(slow)
    results: dict[int, object] = {}

    def ask(item: int) -> None:
        try:
            results[item] = coalescer.call(item)
        except InvalidArgument as error:
            results[item] = error

    threads = [threading.Thread(target=ask, args=(item,)) for item in (0, 1, -1, 2, 3)]
    threads[0].start()
    assert first_in.wait(5)  # the first batch is in flight: the next four form one batch
    for thread in threads[1:]:
        thread.start()
    while len(coalescer._pending) < 4:
        threading.Event().wait(0.01)
    gate.set()
    for thread in threads:
        thread.join(10)
    assert coalescer.items >= 5 and coalescer.batches >= 2
    assert isinstance(results.pop(-1), InvalidArgument)
    assert results == {0: 0, 1: 10, 2: 20, 3: 30}

    async def on_a_loop() -> list[object]:
        async def batch(items: Sequence[int]) -> list[int]:
            await asyncio.sleep(0.01)
            return _batch(items)

        loop_coalescer: AsyncCoalescer[int, int] = AsyncCoalescer(batch)
        return await asyncio.gather(
            *(loop_coalescer.call(item) for item in (5, -2, 6)), return_exceptions=True
        )

    five, bad, six = asyncio.run(on_a_loop())
    assert (five, six) == (50, 60) and isinstance(bad, InvalidArgument)


def test_a_tenants_lease_cap_keeps_it_from_crowding_out_the_others(tenants: Tenants) -> None:
    tokens, keys = prompt(tenants, 202, 2)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, payloads(keys, 2), "chatbot")
        leases = [bob.query_hit(HitRequest(token_ids=tokens)).lease_id for _ in range(8)]
        assert all(leases)
        with pytest.raises(grpc.RpcError) as error:  # bob's cap is 8
            bob.query_hit(HitRequest(token_ids=tokens))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bob" in (error.value.details() or "")
        with tenants.client("alice") as alice:  # unaffected
            alice.put_blocks(keys, payloads(keys), "chatbot")
            hit = alice.query_hit(HitRequest(token_ids=tokens))
            assert hit.lease_id
            assert [r.payload for r in alice.get_blocks(keys, hit.lease_id)] == payloads(keys)
        for lease in leases:
            assert bob.release_lease(lease or "")
        assert bob.query_hit(HitRequest(token_ids=tokens, take_lease=True)).lease_id
