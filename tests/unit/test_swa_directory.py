"""Directory shards and rendezvous sharding: registration, liveness, incarnations."""

from __future__ import annotations

import itertools
import os
from collections import Counter

import pytest

from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument
from kvstore.swa.directory import DirectoryShard, ShardMap, StoreRef, SyncRequest, shard_ids

A = StoreRef("m0", "swa-store-m0")
B = StoreRef("m1", "swa-store-m1")


_SEQ = itertools.count(1)


def request(store: StoreRef, incarnation: str, **fields: object) -> SyncRequest:
    """A sync newer than every one sent before (as a store numbers them)."""
    return SyncRequest(store, incarnation, seq=next(_SEQ), **fields)  # type: ignore[arg-type]


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def shard(timeout: float = 5.0) -> tuple[DirectoryShard, ManualClock]:
    clock = ManualClock()
    return DirectoryShard("e0", owner_timeout_s=timeout, clock=clock), clock


def test_rendezvous_is_deterministic_balanced_and_moves_only_the_lost_shards_keys() -> None:
    keys = [os.urandom(32) for _ in range(3000)]
    three = ShardMap(shard_ids(3))
    again = ShardMap(("e0", "e1", "e2"))
    owners = [three.shard_of(k) for k in keys]
    assert owners == [again.shard_of(k) for k in keys]
    counts = Counter(owners)
    assert set(counts) == {"e0", "e1", "e2"} and min(counts.values()) > 800
    two = ShardMap(("e0", "e2"))
    for k, owner in zip(keys, owners, strict=True):
        if owner != "e1":
            assert two.shard_of(k) == owner  # keys of surviving shards never move
    groups = three.group(keys)
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(keys)))
    assert all(owners[i] == s for s, idx in groups.items() for i in idx)
    assert ShardMap(("only",)).shard_of(keys[0]) == "only"


def test_shard_ids_and_map_validate() -> None:
    assert shard_ids(2) == ("e0", "e1")
    with pytest.raises(InvalidArgument, match="count"):
        shard_ids(0)
    with pytest.raises(InvalidArgument, match="shard_ids"):
        ShardMap(())
    with pytest.raises(InvalidArgument, match="shard_ids"):
        ShardMap(("e0", "e0"))


def test_full_sync_registers_and_delta_unregisters() -> None:
    directory, _ = shard()
    reply = directory.sync(request(A, "inc-a", full=True, register=(key(1), key(2))))
    assert not reply.needs_full and reply.shard_id == "e0"
    assert directory.lookup([key(1), key(2), key(3)]) == [A, A, None]
    reply = directory.sync(request(A, "inc-a", unregister=(key(1),), register=(key(3),)))
    assert not reply.needs_full
    assert directory.lookup([key(1), key(2), key(3)]) == [None, A, A]
    assert directory.stats().entries == 2


def test_unknown_store_delta_is_applied_but_asks_for_a_full_sync() -> None:
    directory, _ = shard()
    reply = directory.sync(request(A, "inc-a", register=(key(1),)))
    assert reply.needs_full
    assert directory.lookup([key(1)]) == [A]
    assert not directory.sync(request(A, "inc-a", full=True, register=(key(2),))).needs_full
    # A full sync replaces the store's view on this shard.
    assert directory.lookup([key(1), key(2)]) == [None, A]


def test_a_new_store_incarnation_drops_what_the_old_one_registered() -> None:
    directory, _ = shard()
    directory.sync(request(A, "old", full=True, register=(key(1), key(2))))
    reply = directory.sync(request(A, "new", register=(key(3),)))
    assert reply.needs_full
    assert directory.lookup([key(1), key(2), key(3)]) == [None, None, A]


def test_a_store_not_heard_from_within_the_owner_timeout_answers_miss() -> None:
    directory, clock = shard(timeout=5)
    directory.sync(request(A, "a", full=True, register=(key(1),)))
    directory.sync(request(B, "b", full=True, register=(key(2),)))
    clock.advance(4)
    directory.sync(request(B, "b"))  # B heartbeats, A is silent
    clock.advance(1.5)  # A last heard 5.5 s ago
    stats = directory.stats()
    assert (stats.stores, stats.live_stores) == (2, 1)
    assert directory.lookup([key(1), key(2)]) == [None, B]
    # The lookup also swept the lost store's entries away (memory hygiene).
    assert directory.stats().stores == 1 and directory.stats().entries == 1
    assert directory.sweep() == []
    # A comes back (partition healed): it must re-register everything.
    assert directory.sync(request(A, "a")).needs_full


def test_an_expired_record_is_treated_as_unknown_even_before_the_sweep() -> None:
    directory, clock = shard(timeout=5)
    directory.sync(request(A, "a", full=True, register=(key(1),)))
    clock.advance(6)
    reply = directory.sync(request(A, "a", register=(key(2),)))
    assert reply.needs_full
    assert directory.lookup([key(1), key(2)]) == [None, A]


def test_several_owners_prefer_the_local_machine_then_the_latest() -> None:
    directory, clock = shard()
    directory.sync(request(A, "a", full=True, register=(key(1),)))
    clock.advance(1)
    directory.sync(request(B, "b", full=True, register=(key(1),)))
    assert directory.lookup([key(1)]) == [B]
    assert directory.lookup([key(1)], prefer_machine="m0") == [A]
    assert directory.lookup([key(1)], prefer_machine="m9") == [B]
    directory.sync(request(B, "b", unregister=(key(1),)))
    assert directory.lookup([key(1)], prefer_machine="m1") == [A]
    stats = directory.stats()
    assert stats.lookups == 4 and stats.hits == 4


def test_each_incarnation_of_a_shard_is_distinct() -> None:
    first, _ = shard()
    second, _ = shard()
    assert first.incarnation != second.incarnation
    assert first.sync(request(A, "a")).shard_incarnation == first.incarnation


def test_sweep_forgets_lost_stores_and_their_keys() -> None:
    directory, clock = shard(timeout=5)
    directory.sync(request(A, "a", full=True, register=(key(1), key(2))))
    clock.advance(5.1)
    assert directory.sweep() == [A]
    stats = directory.stats()
    assert (stats.stores, stats.entries) == (0, 0)


def test_a_sync_overtaken_by_a_newer_one_is_ignored() -> None:
    directory, _ = shard()
    late_full = SyncRequest(A, "a", seq=1, full=True, register=())
    newer_full = SyncRequest(A, "a", seq=2, full=True, register=(key(1),))
    assert not directory.sync(newer_full).needs_full
    # The older full sync (sent first, delivered last) must not wipe key 1.
    assert not directory.sync(late_full).needs_full
    assert directory.lookup([key(1)]) == [A]
    late_delta = SyncRequest(A, "a", seq=2, unregister=(key(1),))
    directory.sync(late_delta)
    assert directory.lookup([key(1)]) == [A]
    assert not directory.sync(SyncRequest(A, "a", seq=3, unregister=(key(1),))).needs_full
    assert directory.lookup([key(1)]) == [None]
