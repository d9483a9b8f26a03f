"""The SWA client over its in-process transport (no Ray): puts register in the directory, lookups
go one call per shard, a lost shard or store is a miss for its keys only, bad input is refused
before anything is sent, and figures add up."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument, StateRejected, StoreError
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey
from kvstore.swa.client import SWAClient
from kvstore.swa.config import SWAConfig
from kvstore.swa.directory import ShardMap
from kvstore.swa.transport import LocalSWATransport, local_swa

GEOMETRY = GeometryConfig.default()
STATE = GEOMETRY.state_size_to_disk


def key(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(32, "little"))


def state(fill: int) -> np.ndarray:
    return np.full(STATE, fill, dtype=np.uint8)


def tier(
    local: str | None = "m0", entrypoints: int = 3, owner_timeout_s: float = 5.0
) -> tuple[SWAClient, LocalSWATransport, ManualClock]:
    clock = ManualClock()
    config = SWAConfig(
        capacity_bytes=32 * STATE, num_entrypoints=entrypoints, owner_timeout_s=owner_timeout_s
    )
    layout, transport = local_swa(("m0", "m1", "m2"), config=config, geometry=GEOMETRY, clock=clock)
    return SWAClient(layout, transport, local_machine=local), transport, clock


def test_a_put_is_registered_found_and_fetched_bit_exact() -> None:
    client, _, _ = tier()
    assert client.put("m1", key(1), 128, state(7)) is True  # registered by the time it returns
    owner = client.lookup([key(1)]).result()[0]
    assert owner is not None and owner.machine_id == "m1"
    fetched = client.get(key(1))
    assert fetched is not None and fetched.owner == owner
    assert np.array_equal(fetched.blob, state(7))
    assert client.lookup([key(2)]).result()[0] is None and client.get(key(2)) is None


def test_lookups_go_one_call_per_shard_and_answer_in_order() -> None:
    client, transport, _ = tier()
    calls: list[tuple[str, int]] = []
    lookup = transport.lookup

    def counting(batch):  # type: ignore[no-untyped-def]
        calls.extend((shard, len(keys)) for shard, (keys, _) in batch.items())
        return lookup(batch)

    transport.lookup = counting  # type: ignore[method-assign]
    keys = [key(i) for i in range(30)]
    for i, k in enumerate(keys[::2]):
        client.put(("m0", "m1", "m2")[i % 3], k, 128 * (i + 1), state(i))
    owners = client.lookup(keys).result()
    assert [o is not None for o in owners] == [i % 2 == 0 for i in range(30)]
    assert sorted(shard for shard, _ in calls) == sorted(client.layout.shards)
    assert sum(count for _, count in calls) == 30


def test_the_local_store_is_preferred_when_several_hold_a_state() -> None:
    client, _, _ = tier(local="m2")
    client.put("m1", key(5), 256, state(1))
    client.put("m2", key(5), 256, state(1))
    owner = client.lookup([key(5)]).result()[0]
    assert owner is not None and owner.machine_id == "m2"
    assert client.lookup([key(5)], prefer_machine="m1").result()[0].machine_id == "m1"  # type: ignore[union-attr]


def test_a_lost_shard_is_a_miss_for_its_keys_only() -> None:
    client, transport, _ = tier()
    shards = ShardMap(client.layout.shards)
    keys = [key(i) for i in range(24)]
    for k in keys:
        client.put("m0", k, 128, state(3))
    lost = client.layout.shards[0]
    transport.down.add(lost)
    owners = client.lookup(keys).result()
    for k, owner in zip(keys, owners, strict=True):
        assert (owner is None) == (shards.shard_of(k) == lost)


def test_a_lost_store_drops_out_after_the_owner_timeout() -> None:
    client, transport, clock = tier(owner_timeout_s=5.0)
    client.put("m1", key(9), 128, state(9))
    name = client.layout.stores["m1"]
    transport.down.add(name)  # the machine is gone: no heartbeats, no fetches
    assert client.get(key(9)) is None  # found in the directory, but its owner does not answer
    clock.advance(6)
    transport.heartbeat()  # the other stores stay alive; m1 is silent
    assert client.lookup([key(9)]).result()[0] is None


def test_bad_input_is_refused_before_anything_is_sent() -> None:
    client, transport, _ = tier()
    with pytest.raises(StateRejected, match="state"):
        client.put("m0", key(1), 128, np.zeros(10, dtype=np.uint8))
    with pytest.raises(StateRejected, match="position"):
        client.put("m0", key(1), 100, state(1))
    with pytest.raises(InvalidArgument, match="machine_id"):
        client.put("m7", key(1), 128, state(1))
    with pytest.raises(InvalidArgument, match="key"):
        client.put("m0", b"short", 128, state(1))
    assert client.stats()["states"] == 0
    transport.down.add(client.layout.stores["m0"])
    with pytest.raises(StoreError, match="not running"):
        client.put("m0", key(1), 128, state(1))


def test_a_blob_of_the_wrong_size_is_a_miss() -> None:
    client, transport, _ = tier()
    client.put("m0", key(4), 128, state(4))
    owner = client.lookup([key(4)]).result()[0]
    assert owner is not None
    agent = transport.agents[owner.store_name]
    agent.store._entries[key(4)].payload = np.zeros(7, dtype=np.uint8)  # a confused store
    assert client.fetch(owner, key(4)) is None


def test_figures_add_up_over_the_stores_and_links_are_measured() -> None:
    client, transport, _ = tier()
    client.put("m0", key(1), 128, state(1))
    client.put("m1", key(2), 128, state(2))
    transport.down.add(client.layout.stores["m2"])
    stats = client.stats()
    assert stats["states"] == 2 and stats["used_bytes"] == 2 * STATE
    assert stats["stores"] == 3 and stats["stores_answering"] == 2
    assert stats["by_machine"]["m2"] is None
    assert client.measure_link("m1") is not None and client.measure_link("m2") is None
