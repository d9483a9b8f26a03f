"""Short-circuit local reads: the node's grant and ``LIVE`` lock, the client-side reader and its
packed replies, the vectorised header check, and the block client reading co-located nodes
from disk (healthy, degraded, damaged, replaced) — never wrong bytes, failures still seen."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from blockstore_tier import Tier

from kvstore.blockstore.fanout import NODE
from kvstore.blockstore.localread import (
    LIVE_NAME,
    LocalReadGrant,
    LocalShardReader,
    open_live,
    wait_unlocked,
)
from kvstore.blockstore.node import StorageNode, split_files
from kvstore.blockstore.shardfile import (
    NODE_HEADER_BYTES,
    SHARD_FILE_HEAD_BYTES,
    data_heads_match,
    payload_hash,
)
from kvstore.ec import Codec
from kvstore.ec.shard import fragment_length
from kvstore.errors import InvalidArgument

CODEC = Codec(10, 2)
BLOCK = 113_920


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"local" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _store(node: StorageNode, i: int, index: int = 0, size: int = BLOCK) -> np.ndarray:
    """Commit shard ``index`` of block ``i`` on ``node``; returns the whole shard file."""
    payload = _payload(i, size)
    shard = CODEC.encode(payload, _key(i))[index]
    assert node.put(5, [_key(i)], [shard], [payload_hash(payload)], [0], [1.0]) == [True]
    assert node.commit(5, [_key(i)]) == [True]
    return np.fromfile(node_path(node, _key(i)), dtype=np.uint8)


def node_path(node: StorageNode, key: bytes) -> Path:
    return Path(node.local_read_grant().data_dir) / "shards" / key.hex()  # type: ignore[union-attr]


def _local_tier(tmp_path: Path) -> Tier:
    return Tier(tmp_path, local_reads=True)


def _warm(tier: Tier, keys: list[bytes]) -> None:
    """Two reads: the first asks every node for a grant, the second adopts them."""
    tier.client.get_blocks(keys)
    tier.client.get_blocks(keys)
    assert tier.client.stats()["local_nodes"] == list(range(12))


def _same(got: np.ndarray | None, want: np.ndarray) -> bool:
    return got is not None and got.tobytes() == want.tobytes()


# --- grant and lock ------------------------------------------------------------------------


def test_a_node_grants_reads_of_its_directory_while_it_lives(tmp_path: Path) -> None:
    node = StorageNode(4, tmp_path / "n4")
    grant = node.local_read_grant()
    assert grant is not None and grant.node_id == 4
    assert grant.data_dir == str((tmp_path / "n4").resolve())
    assert (tmp_path / "n4" / LIVE_NAME).read_bytes() == grant.live_bytes()
    reader = LocalShardReader()
    assert reader.adopt(grant) and reader.nodes == [4] and reader.serving(4)
    node.close()  # the process going away drops its lock
    assert node.local_read_grant() is None
    assert not reader.serving(4) and reader.nodes == []  # forgotten
    assert not reader.adopt(grant)  # a dead node's grant is refused


def test_a_restarted_node_is_a_new_incarnation(tmp_path: Path) -> None:
    first = StorageNode(1, tmp_path)
    old = first.local_read_grant()
    assert old is not None
    reader = LocalShardReader()
    assert reader.adopt(old)
    first.close()
    second = StorageNode(1, tmp_path)
    new = second.local_read_grant()
    assert new is not None and new.nonce != old.nonce
    assert not reader.serving(1)  # the old LIVE file is nobody's any more
    assert not reader.adopt(old)  # its nonce is not the one on disk now
    assert reader.adopt(new) and reader.serving(1)


def test_two_node_objects_on_one_directory_never_both_grant(tmp_path: Path) -> None:
    first = StorageNode(2, tmp_path)
    second = StorageNode(2, tmp_path)  # took over LIVE: the first one's file is gone
    reader = LocalShardReader()
    assert reader.adopt(second.local_read_grant())  # type: ignore[arg-type]
    assert not reader.adopt(first.local_read_grant())  # type: ignore[arg-type]
    assert reader.nodes == []  # adopting anew forgets the node first


def test_a_grant_naming_a_directory_not_seen_here_is_refused(tmp_path: Path) -> None:
    node = StorageNode(3, tmp_path / "n")
    grant = node.local_read_grant()
    assert grant is not None
    reader = LocalShardReader()
    elsewhere = LocalReadGrant(3, str(tmp_path / "other-machine"), grant.nonce)
    assert not reader.adopt(elsewhere)
    forged = LocalReadGrant(3, grant.data_dir, "0" * 32)
    assert not reader.adopt(forged)
    with pytest.raises(InvalidArgument, match="data_dir"):
        LocalReadGrant(3, "relative/path", grant.nonce)
    with pytest.raises(InvalidArgument, match="nonce"):
        LocalReadGrant(3, grant.data_dir, "short")


def test_wait_unlocked_sees_the_node_go(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    live = open_live(tmp_path)
    assert live is not None
    assert not wait_unlocked(live, 0.05)  # still held
    live = open_live(tmp_path)
    assert live is not None
    node.close()
    assert wait_unlocked(live, 1.0)
    assert open_live(tmp_path / "nowhere") is None


# --- the reader's packed replies -------------------------------------------------------------


def test_read_packs_files_like_node_get_and_a_bad_entry_is_missing_only(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    files = [_store(node, i) for i in range(4)]
    reader = LocalShardReader()
    assert reader.adopt(node.local_read_grant())  # type: ignore[arg-type]
    keys = [_key(i) for i in range(4)]
    lengths = [f.size for f in files]
    # the same packed form as the node's own reply
    local = reader.read(0, keys, lengths)
    assert local is not None
    assert [f.tobytes() for f in split_files(local)] == [  # type: ignore[union-attr]
        f.tobytes()
        for f in split_files(node.get(keys))  # type: ignore[union-attr]
    ]
    # entry 1 truncated, entry 2 grown, one key never stored: each is missing, nothing else
    path = node_path(node, keys[1])
    path.write_bytes(path.read_bytes()[:-10])
    grown = node_path(node, keys[2])
    grown.write_bytes(grown.read_bytes() + b"x")
    into = np.full(sum(lengths) + lengths[0], 0xAB, dtype=np.uint8)
    reply = reader.read(0, [*keys, _key(99)], [*lengths, lengths[0]], into)
    assert reply is not None
    buffer, got = reply
    assert got.tolist() == [lengths[0], -1, -1, lengths[3], -1]
    views = split_files(reply)
    assert views[0].tobytes() == files[0].tobytes()  # type: ignore[union-attr]
    assert views[3].tobytes() == files[3].tobytes()  # type: ignore[union-attr]
    assert buffer.base is into or np.shares_memory(buffer, into)  # read where it was told
    with pytest.raises(InvalidArgument, match="into"):
        reader.read(0, keys, lengths, np.zeros(10, dtype=np.uint8))
    node.close()
    assert reader.read(0, keys, lengths) is None  # not serving: ask the node instead


def test_read_shards_reads_headers_and_fragments_where_told(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    file = _store(node, 7, index=2)
    reader = LocalShardReader()
    assert reader.adopt(node.local_read_grant())  # type: ignore[arg-type]
    head = np.zeros(SHARD_FILE_HEAD_BYTES, dtype=np.uint8)
    fragment = np.zeros(file.size - SHARD_FILE_HEAD_BYTES, dtype=np.uint8)
    assert reader.read_shards(_key(7), [0], [[head, fragment]], file.size)
    assert head.tobytes() + fragment.tobytes() == file.tobytes()
    assert not reader.read_shards(_key(7), [0], [[head, fragment]], file.size + 1)
    assert not reader.read_shards(_key(8), [0], [[head, fragment]], file.size)  # absent
    assert not reader.read_shards(_key(7), [5], [[head, fragment]], file.size)  # not granted


# --- vectorised header check -----------------------------------------------------------------


def test_data_heads_match_names_the_block_position_size_and_one_write() -> None:
    keys = [_key(i) for i in range(4)]
    payloads = [_payload(i) for i in range(4)]
    heads = np.zeros((4, 10, SHARD_FILE_HEAD_BYTES), dtype=np.uint8)
    node_head = np.zeros(NODE_HEADER_BYTES, dtype=np.uint8)
    for b, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        node_head[:4] = np.frombuffer(b"KVSN", np.uint8)
        node_head[4] = 1
        node_head[16:32] = np.frombuffer(payload_hash(payload), np.uint8)
        for i, shard in enumerate(CODEC.encode(payload, key)[:10]):
            heads[b, i, :NODE_HEADER_BYTES] = node_head
            heads[b, i, NODE_HEADER_BYTES:] = shard[:64]
    assert data_heads_match(heads, keys, BLOCK, 10, 2).tolist() == [True] * 4
    damaged = heads.copy()
    damaged[1, 3, NODE_HEADER_BYTES + 40] ^= 1  # shard 3 of block 1 names another key
    damaged[2, [4, 5]] = damaged[2, [5, 4]]  # two shards of block 2 swapped places
    damaged[3, 9, 20] ^= 1  # a node header of block 3 names another write
    assert data_heads_match(damaged, keys, BLOCK, 10, 2).tolist() == [True, False, False, False]
    assert data_heads_match(heads, keys, BLOCK + 64, 10, 2).tolist() == [False] * 4
    # parity in place of lost data rows: the positions say which shard each head must be
    indices = np.tile(np.arange(10, dtype=np.uint8), (4, 1))
    assert data_heads_match(heads, keys, BLOCK, 10, 2, indices).all()
    indices[0, 9] = 10
    assert data_heads_match(heads, keys, BLOCK, 10, 2, indices).tolist() == [
        False,
        True,
        True,
        True,
    ]


# --- the block client over co-located nodes --------------------------------------------------


def test_reads_of_co_located_nodes_skip_their_calls_and_are_bit_exact(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    sizes = [1, 100, 3000, 6001, 640 * 10, BLOCK, BLOCK]
    keys = [_key(i) for i in range(len(sizes))]
    payloads = [_payload(i, size) for i, size in enumerate(sizes)]
    assert tier.client.put_blocks(keys, payloads).ok
    lease = tier.client.lookup(keys).lease
    for _ in range(2):  # the first read asks for grants, the next one adopts them
        first = tier.client.get_blocks(keys, lease)
        assert all(_same(g, p) for g, p in zip(first, payloads, strict=True))
    assert tier.client.stats()["local_nodes"] == list(range(12))
    tier.fanout.calls.clear()
    got = tier.client.get_blocks(keys, lease)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert all(g is not None and not g.flags.writeable for g in got)
    with pytest.raises(ValueError):
        got[0].flags.writeable = True  # type: ignore[union-attr]
    assert not [call for call in tier.fanout.calls if call[1] == "get"]  # no node was asked
    assert tier.client.counters["local_fast_blocks"] >= len(keys)


def test_dead_co_located_nodes_are_a_degraded_read_not_a_silent_one(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    keys = [_key(i) for i in range(24)]
    payloads = [_payload(i) for i in range(24)]
    tier.client.put_blocks(keys, payloads)
    _warm(tier, keys)
    for node in (0, 1):  # the processes die: their locks go, their actors fail
        tier.nodes[node].close()
        tier.fanout.dead.add((NODE, node))
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.down_nodes() == [0, 1]  # found by asking them, as without local reads
    placements = {loc.key: loc.placement for loc in tier.client.lookup(keys).lease.blocks}  # type: ignore[union-attr]
    needs_parity = sum(1 for key in keys if {0, 1} & set(placements[key][:10]))
    assert tier.client.counters["degraded_blocks"] == needs_parity
    before = tier.client.counters["local_fast_blocks"]
    again = tier.client.get_blocks(keys)  # now known down: parity read and rebuilt locally
    assert all(_same(g, p) for g, p in zip(again, payloads, strict=True))
    assert tier.client.counters["local_fast_blocks"] == before + len(keys)
    assert tier.client.counters["degraded_blocks"] == 2 * needs_parity


def test_three_dead_nodes_in_a_stripe_make_only_that_block_a_miss(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    keys = [_key(i) for i in range(30)]
    payloads = [_payload(i, 4000) for i in range(30)]
    tier.client.put_blocks(keys, payloads)
    _warm(tier, keys)
    dead = {0, 1, 2}
    for node in dead:
        tier.nodes[node].close()
        tier.fanout.dead.add((NODE, node))
    placements = {loc.key: loc.placement for loc in tier.client.lookup(keys).lease.blocks}  # type: ignore[union-attr]
    lost = {key for key in keys if len(dead & set(placements[key])) >= 3}
    for _ in range(2):  # first read finds them dead, the second knows it
        got = tier.client.get_blocks(keys)
        for key, block, payload in zip(keys, got, payloads, strict=True):
            assert block is None if key in lost else _same(block, payload)


def test_damaged_and_foreign_local_shards_are_never_wrong_bytes(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    keys = [_key(i) for i in range(6)]
    payloads = [_payload(i) for i in range(6)]
    tier.client.put_blocks(keys, payloads)
    _warm(tier, keys)
    placement = tier.client.lookup(keys).lease.blocks[0].placement  # type: ignore[union-attr]
    # a flipped fragment byte in data shard 0, in place (bit rot)
    path = tier.root / f"node-{placement[0]}" / "shards" / keys[0].hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55
    path.write_bytes(bytes(data))
    # data shard 1 replaced by a valid shard of another write of the same key and size
    other = _payload(1000)
    foreign = CODEC.encode(other, keys[0])
    node = tier.nodes[placement[1]]
    node.put(77, [keys[0]], [foreign[1]], [payload_hash(other)], [0], [0.0])
    node.commit(77, [keys[0]])
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    # two more foreign shards: 9 shards of the real write remain -> a miss, never the mix
    for index in (2, 3):
        n = tier.nodes[placement[index]]
        n.put(77, [keys[0]], [foreign[index]], [payload_hash(other)], [0], [0.0])
        n.commit(77, [keys[0]])
    assert tier.client.get_blocks([keys[0]]) == [None]
    rest = tier.client.get_blocks(keys[1:])
    assert all(_same(g, p) for g, p in zip(rest, payloads[1:], strict=True))


def test_a_rewritten_block_reads_as_the_new_write_never_a_mix(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    key = _key(1)
    old, new = _payload(1), _payload(2)
    tier.client.put_blocks([key], [old])
    _warm(tier, [key])
    placement = tier.client.lookup([key]).lease.blocks[0].placement  # type: ignore[union-attr]
    shards = CODEC.encode(new, key)
    # a re-put renames new files over the old ones, node by node; every reader in between
    # sees whole files of one write or the other, and only a block of one write comes back
    for done, (index, node_id) in enumerate(zip(range(12), placement, strict=True), start=1):
        node = tier.nodes[node_id]
        assert node.put(9, [key], [shards[index]], [payload_hash(new)], [0], [2.0]) == [True]
        assert node.commit(9, [key]) == [True]
        block = tier.client.get_blocks([key])[0]
        if done <= 2:
            assert _same(block, old)  # 10 or 11 old shards still decode the old write
        elif done >= 10:
            assert _same(block, new)
        else:
            assert block is None or _same(block, old) or _same(block, new)


def test_a_shard_deleted_behind_the_node_is_asked_of_it_and_reported(tmp_path: Path) -> None:
    tier = _local_tier(tmp_path)
    keys = [_key(i) for i in range(3)]
    payloads = [_payload(i) for i in range(3)]
    tier.client.put_blocks(keys, payloads)
    _warm(tier, keys)
    placement = tier.client.lookup(keys).lease.blocks[0].placement  # type: ignore[union-attr]
    victim = placement[4]
    os.unlink(tier.root / f"node-{victim}" / "shards" / keys[0].hex())
    tier.fanout.calls.clear()
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert ((NODE, victim), "get") in tier.fanout.calls  # the node answered for its file
    assert (keys[0], 4) in tier.nodes[victim].scrub()["corrupt"]  # ... and will get it back


def test_local_reads_can_be_switched_off(tmp_path: Path) -> None:
    tier = Tier(tmp_path)  # the unit tier's default: every read over the fanout
    keys = [_key(i) for i in range(4)]
    tier.client.put_blocks(keys, [_payload(i) for i in range(4)])
    tier.client.get_blocks(keys)
    tier.client.get_blocks(keys)
    assert tier.client.stats()["local_nodes"] == []
    assert not [call for call in tier.fanout.calls if call[1] == "local_read_grant"]
    assert fragment_length(BLOCK, 10) * 10 == BLOCK  # the whole-rows case the rebuild needs
