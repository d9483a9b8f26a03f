"""The block client over plain nodes and meta shards in one process (no Ray): the write rule,
degraded and hedged reads, misses instead of exceptions, never wrong bytes."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
from blockstore_tier import Tier

from kvstore.blockstore.fanout import META, NODE
from kvstore.blockstore.placement import place
from kvstore.blockstore.records import Lease
from kvstore.ec import Codec
from kvstore.errors import ConfigError, InvalidArgument


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"client" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = 6000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    return Tier(tmp_path)


def _same(got: np.ndarray | None, want: np.ndarray) -> bool:
    return got is not None and got.tobytes() == want.tobytes()


def _flip_last_byte(shard: np.ndarray) -> np.ndarray:
    shard[-1] ^= 0x55
    return shard


def test_put_lookup_get_round_trip_is_bit_exact(tier: Tier) -> None:
    keys = [_key(i) for i in range(8)]
    payloads = [_payload(i, 3000 + 997 * i) for i in range(8)]
    result = tier.client.put_blocks(keys, payloads, "agent")
    assert result.stored == keys and result.ok
    found = tier.client.lookup(keys)
    assert found.hit_blocks == 8 and found.lease is not None
    assert [b.size for b in found.lease.blocks] == [p.size for p in payloads]
    got = tier.client.get_blocks(keys, found.lease)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert got[0] is not None and not got[0].flags.writeable
    assert all(_same(g, p) for g, p in zip(tier.client.get_blocks(keys), payloads, strict=True))
    tier.client.release(found.lease)
    again = tier.client.put_blocks(keys[:2], [b"x", b"y"])
    assert again.existing == keys[:2] and again.stored == []
    stats = tier.metas[0].stats()
    assert stats["bytes_by_class"]["agent"] > 0


def test_lookup_is_the_longest_consecutive_prefix_and_leases_only_it(tier: Tier) -> None:
    keys = [_key(i) for i in range(6)]
    tier.client.put_blocks([keys[i] for i in (0, 1, 2, 4, 5)], [_payload(i) for i in range(5)])
    found = tier.client.lookup(keys)
    assert found.hit_blocks == 3 and found.keys == keys[:3]
    tier.client.flush_releases()  # blocks beyond the prefix are given back without waiting
    assert _leased(tier) == set(keys[:3])  # blocks 4, 5 were leased by their shard, then released
    assert tier.client.lookup([_key(99)] + keys).hit_blocks == 0
    assert tier.client.get_blocks([_key(99)]) == [None]


def _leased(tier: Tier) -> set[bytes]:
    return {
        bytes(k)
        for m in tier.metas.values()
        for k, count in zip(
            m.snapshot_table().column("key").to_pylist(),
            m.snapshot_table().column("lease_count").to_pylist(),
            strict=True,
        )
        if count
    }


def test_a_release_without_waiting_rides_on_the_next_lookup(tmp_path: Path) -> None:
    tier = Tier(tmp_path, release_batch_s=1.0)  # the flusher waits long: the lookup comes first
    keys = [_key(i) for i in range(40)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(40)])
    first = tier.client.lookup(keys[:20])
    assert _leased(tier) == set(keys[:20])
    tier.client.release_many([first.lease], wait=False)
    assert _leased(tier) == set(keys[:20])  # deferred, not sent yet
    tier.fanout.calls.clear()
    second = tier.client.lookup(keys[20:])
    assert _leased(tier) == set(keys[20:])  # the first lease went back with this lookup
    assert all(method == "lookup_wire" for _, method in tier.fanout.calls), tier.fanout.calls
    tier.client.release(second.lease)  # waited for: sent at once
    assert _leased(tier) == set()


def test_a_deferred_release_is_sent_by_itself_when_no_lookup_comes(tmp_path: Path) -> None:
    tier = Tier(tmp_path, release_batch_s=0.01)
    keys = [_key(i) for i in range(12)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(12)])
    tier.client.release_many([tier.client.lookup(keys).lease], wait=False)
    deadline = time.monotonic() + 10
    while _leased(tier) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _leased(tier) == set()
    assert any(method == "release" for _, method in tier.fanout.calls)


def test_a_release_by_stale_rows_finds_its_keys_again(tier: Tier) -> None:
    keys = [_key(i) for i in range(30)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(30)])
    lease = tier.client.lookup(keys).lease
    assert lease is not None and lease.rows is not None
    # Rows that no longer name these keys (as after a meta shard restart): all row 0.
    shuffled = Lease(
        lease.lease_id,
        lease.until,
        lease.key_words,
        lease.placements,
        lease.sizes,
        np.zeros_like(lease.rows),
    )
    tier.client.release(shuffled)
    assert _leased(tier) == set()


def test_bytes_and_arrays_of_any_dtype_are_payloads(tier: Tier) -> None:
    floats = np.linspace(0, 1, 999, dtype=np.float32)
    tier.client.put_blocks([_key(1), _key(2)], [b"hello" * 999, floats])
    got = tier.client.get_blocks([_key(1), _key(2)])
    assert got[0] is not None and got[0].tobytes() == b"hello" * 999
    assert got[1] is not None and got[1].tobytes() == floats.tobytes()


def test_bad_arguments_are_typed_errors(tier: Tier) -> None:
    with pytest.raises(InvalidArgument, match="payloads"):
        tier.client.put_blocks([_key(1)], [])
    with pytest.raises(InvalidArgument, match="keys"):
        tier.client.put_blocks([_key(1), _key(1)], [b"a", b"b"])
    with pytest.raises(InvalidArgument, match=r"keys\[0\]"):
        tier.client.lookup([b"short"])
    with pytest.raises(ConfigError, match="traffic_class"):
        tier.client.put_blocks([_key(1)], [b"a"], "nope")


def test_two_dead_nodes_cost_nothing_three_in_a_stripe_make_it_a_miss(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(40)]
    payloads = [_payload(i) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    tier.fanout.dead |= {(NODE, 0), (NODE, 5)}
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    tier.fanout.dead.add((NODE, 9))
    placements = place(keys, range(14), 12)
    lost = (np.isin(placements, [0, 5, 9]).sum(axis=1) >= 3).tolist()
    assert any(lost) and not all(lost)
    got = tier.client.get_blocks(keys)
    for g, p, is_lost in zip(got, payloads, lost, strict=True):
        assert (g is None) if is_lost else _same(g, p)
    hit = tier.client.lookup(keys).hit_blocks
    assert hit == lost.index(True)


def test_reads_rebuilt_from_parity_are_counted_as_degraded(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(40)]
    payloads = [_payload(i) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    assert all(_same(g, p) for g, p in zip(tier.client.get_blocks(keys), payloads, strict=True))
    assert tier.client.counters["degraded_blocks"] == 0
    tier.fanout.dead |= {(NODE, 2), (NODE, 7)}
    placements = place(keys, range(14), 12)
    # Shards 0..9 are data: a block is degraded when a data shard sat on a dead node.
    needs_parity = int(np.isin(placements[:, :10], [2, 7]).any(axis=1).sum())
    assert needs_parity > 0
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.counters["degraded_blocks"] == needs_parity


def test_a_hung_node_is_hedged_around(tmp_path: Path) -> None:
    tier = Tier(tmp_path, call_timeout_s=3.0)
    keys = [_key(i) for i in range(10)]
    payloads = [_payload(i) for i in range(10)]
    tier.client.put_blocks(keys, payloads)
    tier.fanout.hung.add((NODE, 3))
    started = time.monotonic()
    got = tier.client.get_blocks(keys)
    assert time.monotonic() - started < tier.config.call_timeout_s
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.stats()["hedged_reads"] >= 1


def test_a_dead_meta_shard_is_a_miss_and_a_failed_put_never_an_exception(tier: Tier) -> None:
    keys = [_key(i) for i in range(12)]
    tier.client.put_blocks(keys, [_payload(i) for i in range(12)])
    tier.fanout.dead |= {(META, i) for i in range(tier.config.meta_shards)}
    assert tier.client.lookup(keys).hit_blocks == 0
    assert tier.client.get_blocks(keys) == [None] * 12
    assert tier.client.put_blocks([_key(50)], [b"x"]).failed == [_key(50)]


def test_a_put_around_a_dead_node_lands_on_healthy_ones(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    tier.fanout.dead.add((NODE, 2))
    keys = [_key(i) for i in range(20)]
    assert tier.client.put_blocks(keys, [_payload(i) for i in range(20)]).ok
    assert tier.nodes[2].usage()["shards"] == 0
    found = tier.client.lookup(keys)
    assert found.lease is not None
    assert all(2 not in block.placement for block in found.lease.blocks)
    tier.fanout.dead.add((NODE, 3))
    tier.client._retry_at.clear()  # forget what it learnt: the put must discover it itself
    tier.fanout.dead.discard((NODE, 2))
    more = [_key(i) for i in range(100, 120)]
    assert tier.client.put_blocks(more, [_payload(i) for i in range(20)]).ok


def test_fewer_than_twelve_live_nodes_means_the_put_fails_cleanly(tier: Tier) -> None:
    tier.fanout.dead.add((NODE, 0))
    result = tier.client.put_blocks([_key(1)], [b"payload"])
    assert result.failed == [_key(1)]
    tier.client._retry_at.clear()
    tier.fanout.dead.clear()
    assert tier.client.put_blocks([_key(1)], [b"payload"]).stored == [_key(1)]


def _die_before_commit(tier: Tier, key: bytes, payload: np.ndarray) -> None:
    """A writer that reserved, wrote every shard pending, and died before any commit mark."""
    token = 4242
    shard = int(tier.client._by_meta([key]).popitem()[0])
    tier.metas[shard].begin_put([key], token)
    stripe = Codec().encode(payload, key)
    placement = place([key], range(len(tier.nodes)), 12)[0]
    for index, node in enumerate(placement):
        assert tier.nodes[int(node)].put(
            token, [key], [stripe[index]], [0], [tier.clock.now()]
        ) == [True]


def test_a_writer_dying_mid_put_leaves_nothing_visible_ever(tier: Tier) -> None:
    key = _key(7)
    _die_before_commit(tier, key, _payload(7))
    assert tier.client.lookup([key]).hit_blocks == 0
    assert tier.client.get_blocks([key]) == [None]
    for shard in range(tier.config.meta_shards):  # a restarted meta shard does not resurrect it
        tier.rebuild_meta(shard)
    assert tier.client.lookup([key]).hit_blocks == 0
    # the reservation ran out; a new writer stores the block normally
    tier.clock.advance(tier.config.put_reservation_s + 1)
    assert tier.client.put_blocks([key], [_payload(8)]).ok
    got = tier.client.get_blocks([key])[0]
    assert _same(got, _payload(8))
    # and the dead writer's pending shards are reclaimed after the grace period
    tier.clock.advance(tier.config.orphan_grace_s + 1)
    for node in tier.nodes.values():
        node.reclaim_orphans(lambda keys: [True] * len(keys), tier.config.orphan_grace_s)
        assert node.usage()["pending"] == 0


def test_a_restarted_meta_shard_rebuilds_every_committed_block(tier: Tier) -> None:
    keys = [_key(i) for i in range(30)]
    payloads = [_payload(i) for i in range(30)]
    tier.client.put_blocks(keys, payloads, "chatbot")
    sizes = {k: p.size for k, p in zip(keys, payloads, strict=True)}
    for shard in range(tier.config.meta_shards):
        rebuilt = tier.rebuild_meta(shard)
        held = rebuilt.snapshot_table().column("key").to_pylist()
        assert rebuilt.stored_bytes_by_class()["chatbot"] == sum(sizes[k] for k in held)
    assert tier.client.lookup(keys).hit_blocks == 30
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))


def test_corrupt_and_foreign_shards_are_never_decoded_into_wrong_bytes(tier: Tier) -> None:
    keys = [_key(i) for i in range(6)]
    payloads = [_payload(i) for i in range(6)]
    tier.client.put_blocks(keys, payloads)
    placement = tier.client.lookup(keys).lease.blocks[0].placement  # type: ignore[union-attr]
    # a flipped byte in the fragment of shard 0 that its node did not catch (bit rot)
    tier.tamper(int(placement[0]), keys[0], _flip_last_byte)
    # replace shard 1 with a *valid* shard of a different payload of the same key and size,
    # as an old write of the key that raced a re-put would leave it
    other = Codec().encode(_payload(1000), keys[0])
    second = tier.nodes[placement[1]]
    token = 77
    second.put(token, [keys[0]], [other[1]], [0], [0.0])
    second.commit(token, [keys[0]])
    got = tier.client.get_blocks([keys[0]])[0]
    assert _same(got, payloads[0])
    # two more foreign shards: 8 shards of the real payload remain -> a miss, not garbage
    for index in (2, 3):
        n = tier.nodes[placement[index]]
        n.put(token, [keys[0]], [other[index]], [0], [0.0])
        n.commit(token, [keys[0]])
    assert tier.client.get_blocks([keys[0]]) == [None]
    rest = tier.client.get_blocks(keys[1:])
    assert all(_same(g, p) for g, p in zip(rest, payloads[1:], strict=True))


def test_a_shard_with_a_damaged_header_is_left_out_and_counted(tier: Tier) -> None:
    keys = [_key(i) for i in range(3)]
    payloads = [_payload(i) for i in range(3)]
    tier.client.put_blocks(keys, payloads)
    blocks = tier.client.lookup(keys).lease.blocks  # type: ignore[union-attr]
    # data shards, so the reader needs them (or parity in their place)
    tier.tamper(blocks[0].placement[4], keys[0], lambda shard: shard[:10])  # shorter than a header
    tier.tamper(blocks[1].placement[5], keys[1], lambda shard: np.zeros_like(shard))  # no magic
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))  # parity stood in
    assert tier.client.counters["corrupt_shards"] >= 2


def test_a_rewritten_block_reads_as_the_new_write_never_a_mix(tier: Tier) -> None:
    key = _key(1)
    old, new = _payload(1), _payload(2)
    tier.client.put_blocks([key], [old])
    placement = tier.client.lookup([key]).lease.blocks[0].placement  # type: ignore[union-attr]
    shards = Codec().encode(new, key)
    # A re-put commits the new write's shards over the old ones node by node: readers in
    # between see whole shards of one write or the other, and only ever a block of one write.
    for done, (index, node_id) in enumerate(zip(range(12), placement, strict=True), start=1):
        node = tier.nodes[int(node_id)]
        assert node.put(9, [key], [shards[index]], [0], [2.0]) == [True]
        assert node.commit(9, [key]) == [True]
        block = tier.client.get_blocks([key])[0]
        if done <= 2:
            assert _same(block, old)  # 10 or 11 old shards still decode the old write
        elif done >= 10:
            assert _same(block, new)
        else:
            assert block is None  # neither write has k shards: a miss, never the mix
