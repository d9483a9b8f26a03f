"""A store agent and in-process directory shards: registrations survive lost, late and
reordered syncs, replaced entrypoints and TTL/LRU evictions."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument, StateRejected
from kvstore.swa.agent import StoreAgent
from kvstore.swa.directory import DirectoryShard, ShardMap, StoreRef, shard_ids
from kvstore.swa.store import SWAStore

STATE = 1024
REF = StoreRef("m0", "swa-store-m0")


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def blob(fill: int) -> np.ndarray:
    return np.full(STATE, fill, dtype=np.uint8)


class World:
    """A store agent plus E in-process shards; ``deliver`` is the network."""

    def __init__(self, shards: int = 3, capacity_states: int = 100, ttl_s: float = 60) -> None:
        self.clock = ManualClock()
        self.map = ShardMap(shard_ids(shards))
        self.shards = {
            s: DirectoryShard(s, owner_timeout_s=100, clock=self.clock) for s in self.map.ids
        }
        store = SWAStore(
            max_state_bytes=STATE,
            capacity_bytes=capacity_states * STATE,
            ttl_s=ttl_s,
            clock=self.clock,
        )
        self.agent = StoreAgent(store, REF, self.map)

    def deliver(self, shard_id: str) -> None:
        request, ticket = self.agent.outgoing(shard_id)
        self.agent.on_reply(ticket, self.shards[shard_id].sync(request))

    def heartbeat(self) -> None:
        self.agent.tick()
        for shard_id in self.map.ids:
            self.deliver(shard_id)

    def lookup(self, keys: list[bytes]) -> list[StoreRef | None]:
        return [self.shards[self.map.shard_of(k)].lookup([k])[0] for k in keys]


def test_puts_reach_the_directory_through_heartbeats() -> None:
    world = World()
    keys = [key(n) for n in range(20)]
    for n, k in enumerate(keys):
        world.agent.put(k, 128 * (n + 1), blob(n))
    assert set(world.agent.dirty_shards()) == set(world.map.ids)
    assert world.lookup(keys) == [None] * 20
    assert not any(world.agent.is_registered(k) for k in keys)
    world.heartbeat()
    assert world.lookup(keys) == [REF] * 20
    assert all(world.agent.is_registered(k) for k in keys)
    assert world.agent.pending_count() == 0 and world.agent.dirty_shards() == []


def test_a_rejected_put_changes_nothing() -> None:
    world = World()
    world.heartbeat()
    with pytest.raises(StateRejected):
        world.agent.put(key(1), 100, blob(1))
    with pytest.raises(InvalidArgument):
        world.agent.put(b"bad", 128, blob(1))
    assert world.agent.pending_count() == 0 and len(world.agent.store) == 0


def test_lru_eviction_and_ttl_expiry_unregister() -> None:
    world = World(capacity_states=2, ttl_s=30)
    world.agent.put(key(1), 128, blob(1))
    world.agent.put(key(2), 256, blob(2))
    world.heartbeat()
    assert world.agent.put(key(3), 384, blob(3)) == [key(1)]
    world.heartbeat()
    assert world.lookup([key(1), key(2), key(3)]) == [None, REF, REF]
    world.clock.advance(20)
    assert world.agent.get(key(3)) is not None
    world.clock.advance(15)  # key 2 idle 35 s > 30, key 3 idle 15 s
    world.heartbeat()
    assert world.lookup([key(2), key(3)]) == [None, REF]


def test_a_failed_sync_keeps_changes_pending_until_one_succeeds() -> None:
    world = World(shards=1)
    world.heartbeat()
    world.agent.put(key(1), 128, blob(1))
    request, ticket = world.agent.outgoing("e0")
    assert request.register == (key(1),)
    world.agent.on_failure(ticket)  # lost on the way
    assert world.lookup([key(1)]) == [None]
    world.heartbeat()
    assert world.lookup([key(1)]) == [REF]


def test_a_late_reply_does_not_clear_a_newer_change_of_the_same_key() -> None:
    world = World(shards=1, capacity_states=1)
    world.heartbeat()
    world.agent.put(key(1), 128, blob(1))
    request, ticket = world.agent.outgoing("e0")  # carries register(key 1)
    world.agent.put(key(2), 256, blob(2))  # evicts key 1: unregister(key 1) is newer
    reply = world.shards["e0"].sync(request)
    world.agent.on_reply(ticket, reply)  # the old reply arrives
    assert world.lookup([key(1)]) == [REF]  # registration applied, eviction not yet sent
    world.heartbeat()
    assert world.lookup([key(1), key(2)]) == [None, REF]


def test_a_replaced_entrypoint_gets_everything_back_at_the_next_heartbeat() -> None:
    world = World(shards=3)
    keys = [key(n) for n in range(30)]
    for n, k in enumerate(keys):
        world.agent.put(k, 128 * (n + 1), blob(n))
    world.heartbeat()
    assert world.lookup(keys) == [REF] * 30
    # e1 dies and a fresh, empty e1 replaces it: its keys are misses, the others still hit.
    world.shards["e1"] = DirectoryShard("e1", owner_timeout_s=100, clock=world.clock)
    on_e1 = [k for k in keys if world.map.shard_of(k) == "e1"]
    assert on_e1
    assert all(owner is None for owner in world.lookup(on_e1))
    assert all(world.lookup([k])[0] == REF for k in keys if k not in on_e1)
    world.heartbeat()  # e1 answers needs_full to a bare heartbeat
    request, _ = world.agent.outgoing("e1")
    assert request.full and set(request.register) == set(on_e1)
    world.heartbeat()
    assert world.lookup(keys) == [REF] * 30


def test_changes_made_while_a_full_sync_is_in_flight_stay_pending() -> None:
    world = World(shards=1)
    world.agent.put(key(1), 128, blob(1))
    request, ticket = world.agent.outgoing("e0")
    assert request.full and request.register == (key(1),)
    world.agent.put(key(2), 256, blob(2))
    world.agent.on_reply(ticket, world.shards["e0"].sync(request))
    assert world.agent.dirty_shards() == ["e0"]
    world.heartbeat()
    assert world.lookup([key(1), key(2)]) == [REF, REF]


def test_outgoing_to_an_unknown_shard_is_an_error() -> None:
    with pytest.raises(InvalidArgument, match="shard_id"):
        World().agent.outgoing("e9")


def test_a_timed_out_sync_delivered_late_cannot_undo_newer_registrations() -> None:
    world = World(shards=1)
    early, early_ticket = world.agent.outgoing("e0")  # first heartbeat: full, holds nothing
    assert early.full and early.register == ()
    world.agent.on_failure(early_ticket)  # the caller gave up waiting...
    world.agent.put(key(1), 128, blob(1))
    world.deliver("e0")  # ...a newer full sync with key 1 gets through
    assert world.lookup([key(1)]) == [REF]
    reply = world.shards["e0"].sync(early)  # ...and then the old one arrives after all
    assert not reply.needs_full
    assert world.lookup([key(1)]) == [REF]
