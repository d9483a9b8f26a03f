"""Storage node: the segment log, pending vs committed, restart, scrub, orphans, compaction."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.node import StorageNode, split_shards
from kvstore.blockstore.segments import (
    COMMIT,
    RECORD_BYTES,
    SEGMENT_HEADER_BYTES,
    find_shard_records,
    record_header,
)
from kvstore.clock import ManualClock
from kvstore.ec import Codec
from kvstore.ec.shard import parse_shard, payload_hash
from kvstore.errors import ConfigError, InvalidArgument, StoreError

CODEC = Codec(10, 2)
SMALL = StorageNodeConfig(fsync="never", segment_bytes=64 * 1024)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _block(i: int, size: int = 4000) -> tuple[bytes, np.ndarray, list[np.ndarray]]:
    key = _key(i)
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    return key, payload, CODEC.encode(payload, key)


def _put(node: StorageNode, token: int, items: list[int], index: int = 0) -> list[bool]:
    blocks = [_block(i) for i in items]
    return node.put(
        token,
        [b[0] for b in blocks],
        [b[2][index] for b in blocks],
        [1] * len(blocks),
        [1000.0 + i for i in items],
    )


def _stored(node: StorageNode, items: list[int], token: int = 5) -> None:
    assert all(_put(node, token, items))
    assert all(node.commit(token, [_key(i) for i in items]))


def _shards(node: StorageNode, keys: list[bytes]) -> list[np.ndarray | None]:
    return split_shards(node.get(keys))


def _reopen(node: StorageNode, tmp_path: Path, config: StorageNodeConfig = SMALL) -> StorageNode:
    node.close()
    return StorageNode(node.node_id, tmp_path, config)


def _segment_paths(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "segments").iterdir())


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_pending_shards_are_invisible_until_committed(tmp_path: Path, fsync: str) -> None:
    node = StorageNode(3, tmp_path, StorageNodeConfig(fsync=fsync))
    assert _put(node, 7, [1, 2], index=4) == [True, True]
    assert _shards(node, [_key(1), _key(2)]) == [None, None]
    assert node.usage()["pending"] == 2 and node.usage()["shards"] == 0
    assert node.commit(99, [_key(1)]) == [False]  # another writer's token commits nothing
    assert node.commit(7, [_key(1), _key(2)]) == [True, True]
    shards = _shards(node, [_key(1), _key(2), _key(3)])
    assert shards[2] is None
    key, payload, encoded = _block(1)
    assert shards[0] is not None
    assert bytes(shards[0]) == bytes(encoded[4])  # the codec shard, nothing in front of it
    header = parse_shard(shards[0])
    assert (header.key, header.index) == (key, 4)
    assert header.payload_hash.to_bytes(8, "big") == payload_hash(payload)
    assert node.holds([_key(1), _key(3)]) == [True, False]
    assert [p.name for p in _segment_paths(tmp_path)] == ["0000000000000001.seg"]
    table = node.manifest()
    hashes = {payload_hash(_block(i)[1]) for i in (1, 2)}
    assert set(table.column("payload_hash").to_pylist()) == hashes
    assert set(table.column("class_id").to_pylist()) == {1}


def test_a_restarted_node_serves_its_committed_shards_and_keeps_pending_ones(
    tmp_path: Path,
) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _put(node, 5, [1, 2, 3])
    node.commit(5, [_key(1), _key(2)])
    before = _shards(node, [_key(1), _key(2)])
    manifest = node.manifest().sort_by("key")
    used = node.usage()["bytes_used"]
    again = _reopen(node, tmp_path)  # only the directory survives
    assert [bytes(f) for f in _shards(again, [_key(1), _key(2)])] == [bytes(f) for f in before]  # type: ignore[arg-type]
    usage = again.usage()
    assert (usage["bytes_used"], usage["shards"], usage["pending"]) == (used, 2, 1)
    assert again.manifest().sort_by("key").equals(manifest)  # every field found again
    assert again.commit(5, [_key(3)]) == [True]  # the pending write can still commit
    third = _reopen(again, tmp_path)
    assert third.holds([_key(1), _key(2), _key(3)]) == [True, True, True]


def test_one_process_serves_a_directory(tmp_path: Path) -> None:
    node = StorageNode(1, tmp_path)
    with pytest.raises(StoreError, match="held by another process"):
        StorageNode(1, tmp_path, lock_timeout_s=0.1)
    node.close()
    StorageNode(1, tmp_path).close()  # free again once the first one stopped


def test_a_closed_node_holds_no_descriptor(tmp_path: Path) -> None:
    """Its segments, its lock and both of its directories are given back by ``close`` (the
    directories were left to the garbage collector before), and a second close is harmless."""
    before = set(os.listdir("/proc/self/fd"))
    node = StorageNode(1, tmp_path)
    key, _, shards = _block(1)
    assert node.put(7, [key], [shards[0]], [0], [1.0]) == [True]
    assert len(set(os.listdir("/proc/self/fd")) - before) >= 4
    node.close()
    node.close()
    assert set(os.listdir("/proc/self/fd")) - before == set()


def test_a_data_dir_of_another_node_is_refused(tmp_path: Path) -> None:
    StorageNode(1, tmp_path).close()
    with pytest.raises(ConfigError, match="data_dir"):
        StorageNode(2, tmp_path)


def test_many_shards_make_few_files(tmp_path: Path) -> None:
    config = StorageNodeConfig(fsync="never", segment_bytes=256 * 1024)
    node = StorageNode(0, tmp_path, config)
    for start in range(0, 600, 100):
        _stored(node, list(range(start, start + 100)))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    logged = 600 * (2 * RECORD_BYTES + CODEC.shard_length(4000))  # shards and commit marks
    assert len(files) <= 2 + logged // config.segment_bytes + 1  # NODE, LOCK, the segments
    assert node.usage()["segments"] == len(_segment_paths(tmp_path)) > 1  # it rolled
    again = _reopen(node, tmp_path, config)
    assert again.usage()["shards"] == 600


def test_a_torn_tail_is_cut_off_and_appends_continue_after_it(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _stored(node, [1, 2])
    _put(node, 6, [3, 4])  # the node dies while this batch is landing: cut into its last shard
    node.close()
    tail = _segment_paths(tmp_path)[-1]
    os.truncate(tail, tail.stat().st_size - 100)
    again = StorageNode(0, tmp_path, SMALL)
    assert again.stats()["damaged_records"] == 1
    assert again.holds([_key(1), _key(2)]) == [True, True]
    assert again.usage()["pending"] == 1  # shard 3 landed whole; shard 4 is gone
    assert again.commit(6, [_key(3), _key(4)]) == [True, False]
    _stored(again, [5])
    third = _reopen(again, tmp_path)
    assert third.holds([_key(1), _key(2), _key(3), _key(4), _key(5)]) == [True] * 3 + [False, True]
    assert third.stats()["damaged_records"] == 0  # the torn bytes were cut, not left behind


def test_a_crafted_record_with_the_last_u64_lsn_is_refused_and_the_node_goes_on(
    tmp_path: Path,
) -> None:
    """A record with a good checksum and LSN 2**64-1 at the tail: replaying it would move the
    next LSN past the u64 field (every later put and commit failing); it is damage instead."""
    node = StorageNode(0, tmp_path, SMALL)
    _stored(node, [1])
    node.close()
    with open(_segment_paths(tmp_path)[-1], "ab") as tail:
        tail.write(record_header(COMMIT, 2**64 - 1, _key(9), token=5, target_lsn=1))
    again = StorageNode(0, tmp_path, SMALL)
    assert again.stats()["damaged_records"] == 1
    _stored(again, [2])
    third = _reopen(again, tmp_path)
    assert third.holds([_key(1), _key(2)]) == [True, True]
    third.close()


def _flip_whole_bytes(data: bytearray, at: int) -> None:
    data[at : at + 200] = os.urandom(200)  # the header and the start of the shard


def _flip_length(data: bytearray, at: int) -> None:
    data[at + 40] ^= 0x5A  # magic intact: the bulk framing walks onto it, with a wrong length


def _flip_checksum(data: bytearray, at: int) -> None:
    data[at + 90] ^= 0x5A


@pytest.mark.parametrize("damage", [_flip_whole_bytes, _flip_length, _flip_checksum])
def test_damage_in_the_middle_loses_only_the_record_it_covers(
    tmp_path: Path, damage: Callable[[bytearray, int], None]
) -> None:
    """Garbage over a record, or a header whose magic survived but not its checksum (which
    covers the length): the scan drops that record and finds the ones after it again."""
    node = StorageNode(0, tmp_path, SMALL)
    for i in range(1, 6):
        _stored(node, [i], token=10 + i)
    node.close()
    path = _segment_paths(tmp_path)[-1]
    data = bytearray(path.read_bytes())
    shard_len = CODEC.shard_length(4000)
    damage(data, SEGMENT_HEADER_BYTES + 2 * (2 * RECORD_BYTES + shard_len))  # block 3's record
    path.write_bytes(bytes(data))
    again = StorageNode(0, tmp_path, SMALL)
    assert again.stats()["damaged_records"] == 1
    assert again.holds([_key(i) for i in range(1, 6)]) == [True, True, False, True, True]
    for i, shard in zip((1, 2, 4, 5), _shards(again, [_key(i) for i in (1, 2, 4, 5)]), strict=True):
        assert shard is not None and bytes(shard) == bytes(_block(i)[2][0])


def test_a_corrupt_shard_body_in_a_sealed_segment_is_a_miss_after_scrub(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    for start in range(0, 40, 10):
        _stored(node, list(range(start, start + 10)))
    first = _segment_paths(tmp_path)[0]
    data = bytearray(first.read_bytes())
    at = SEGMENT_HEADER_BYTES + RECORD_BYTES + 500  # inside the fragment of the first shard
    data[at] ^= 0xFF
    first.write_bytes(bytes(data))
    shard = _shards(node, [_key(0)])[0]
    assert shard is not None  # the node does not check on read: the reader does, end to end
    report = node.scrub(limit=100)
    assert report["corrupt"] == [(_key(0), 0)]
    assert node.holds([_key(0), _key(1)]) == [False, True]
    assert _reopen(node, tmp_path).holds([_key(0), _key(1)]) == [False, True]  # stays out


@pytest.mark.parametrize("batch", ["list", "array"])
def test_bad_shards_and_full_nodes_are_refused(tmp_path: Path, batch: str) -> None:
    key, _, shards = _block(1)
    other, _, other_shards = _block(2)
    record = RECORD_BYTES + CODEC.shard_length(4000)
    capacity = SEGMENT_HEADER_BYTES + record + record // 2
    node = StorageNode(0, tmp_path, StorageNodeConfig(capacity_bytes=capacity))
    flipped = shards[0].copy()
    flipped[100] ^= 1
    rows = [flipped, other_shards[0], other_shards[0]]
    results = node.put(
        1, [key, key, other], np.stack(rows) if batch == "array" else rows, [0] * 3, [0.0] * 3
    )
    assert results == [False, False, True]  # corrupt; belongs to another key; fits
    assert node.put(2, [other], [other_shards[1]], [0], [0.0]) == [False]  # full
    with pytest.raises(InvalidArgument, match="shards"):
        node.put(3, [key], [], [], [])


@pytest.mark.parametrize("fsync", ["never", "batch"])
def test_a_batch_as_one_array_stores_what_a_list_stores(tmp_path: Path, fsync: str) -> None:
    """The client's form of a put (one 2-D array of the node's shards, checked as a whole):
    every damaged header field or body refuses its shard alone, and the rest are stored and
    served byte for byte, after a restart too."""
    blocks = [_block(i) for i in range(8)]
    keys = [b[0] for b in blocks]
    rows = np.stack([b[2][i % 12] for i, b in enumerate(blocks)])
    # Row -> byte flipped: magic, index, version, k, payload length, key (each checksummed
    # again, so the field's own check must refuse it), and a fragment byte (checksum only).
    damage = {1: 8, 2: 12, 3: 13, 4: 14, 5: 20, 6: 40, 7: 500}
    for row, at in damage.items():
        rows[row, at] ^= 0x41
        if row != 7:
            rows[row, :8] = np.frombuffer(xxhash.xxh3_64_digest(rows[row, 8:]), np.uint8)
    node = StorageNode(0, tmp_path, StorageNodeConfig(fsync=fsync))
    assert node.put(9, keys, rows, [1] * 8, [0.0] * 8) == [True] + [False] * 7
    assert node.commit(9, keys) == [True] + [False] * 7
    assert node.stats()["put_refused"] == 7
    node = _reopen(node, tmp_path, StorageNodeConfig(fsync=fsync))
    got = _shards(node, keys)
    assert got[0] is not None and np.array_equal(got[0], blocks[0][2][0])
    assert got[1:] == [None] * 7


def test_a_batch_as_one_array_writes_the_bytes_a_list_writes(tmp_path: Path) -> None:
    # A whole 2-D batch goes to the log as one buffer, each header before its row; a list goes
    # as header and body buffers. The segment files must not tell them apart.
    blocks = [_block(i) for i in range(8)]
    keys = [b[0] for b in blocks]
    shards = [b[2][i % 12] for i, b in enumerate(blocks)]
    files = []
    for name, batch in (("list", shards), ("rows", np.stack(shards))):
        node = StorageNode(0, tmp_path / name, SMALL, ManualClock(5.0))
        assert node.put(9, keys, batch, [1] * 8, [0.0] * 8, True) == [True] * 8
        files.append([path.read_bytes() for path in _segment_paths(tmp_path / name)])
        again = _reopen(node, tmp_path / name)
        assert [bytes(s) for s in _shards(again, keys)] == [bytes(s) for s in shards]  # type: ignore[arg-type]
    assert files[0] == files[1]


def test_delete_respects_not_after_and_survives_restart(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _stored(node, [1, 2])
    assert node.delete([_key(1), _key(2)], not_after=1001.5) == 1  # block 2 created at 1002
    assert node.holds([_key(1), _key(2)]) == [False, True]
    _put(node, 6, [3])
    assert node.abort(6, [_key(3)]) == 1
    assert node.usage()["pending"] == 0
    again = _reopen(node, tmp_path)
    assert again.holds([_key(1), _key(2)]) == [False, True]
    # Aborts write no record: the aborted shard comes back pending, an orphan to reclaim.
    assert again.usage()["pending"] == 1


def test_a_newer_write_replaces_the_committed_shard_across_restarts(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _stored(node, [1], token=5)
    _put(node, 6, [1], index=3)
    assert bytes(_shards(node, [_key(1)])[0]) == bytes(_block(1)[2][0])  # type: ignore[arg-type]
    node.commit(6, [_key(1)])
    assert bytes(_shards(node, [_key(1)])[0]) == bytes(_block(1)[2][3])  # type: ignore[arg-type]
    again = _reopen(node, tmp_path)
    assert bytes(_shards(again, [_key(1)])[0]) == bytes(_block(1)[2][3])  # type: ignore[arg-type]


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_a_put_with_commit_is_readable_at_once_and_stays_committed_across_restarts(
    tmp_path: Path, fsync: str
) -> None:
    node = StorageNode(0, tmp_path, StorageNodeConfig(fsync=fsync, segment_bytes=64 * 1024))
    _stored(node, [1], token=5)  # an older write of key 1, in two steps
    blocks = [_block(i) for i in (1, 2, 3)]
    keys = [b[0] for b in blocks]
    assert node.put(6, keys, [b[2][3] for b in blocks], [1] * 3, [2000.0] * 3, True) == [True] * 3
    assert node.usage()["pending"] == 0 and node.usage()["shards"] == 3
    assert node.stats()["commits"] == 1 + 3
    wanted = [bytes(b[2][3]) for b in blocks]  # the newer write replaced key 1's shard
    assert [bytes(s) for s in _shards(node, keys)] == wanted  # type: ignore[arg-type]
    record = RECORD_BYTES + CODEC.shard_length(4000)
    usage = node.usage()
    assert usage["live_bytes"] == 3 * record
    # Dead: the replaced shard and its COMMIT mark; the new shards wrote no mark of their own.
    assert usage["dead_bytes"] == SEGMENT_HEADER_BYTES + record + RECORD_BYTES
    again = _reopen(node, tmp_path)
    assert [bytes(s) for s in _shards(again, keys)] == wanted  # type: ignore[arg-type]
    assert again.usage()["pending"] == 0 and again.usage()["shards"] == 3
    assert again.commit(6, keys) == [False] * 3  # nothing pending to commit


def test_a_pending_and_a_committed_put_of_one_key_replay_as_they_were(tmp_path: Path) -> None:
    # The same writer's pending shard of a key, then a put of the key committed as written: the
    # pending one stays (an orphan for the scrub) both live and after a replay of the log.
    node = StorageNode(0, tmp_path, SMALL)
    _put(node, 7, [1], index=2)
    key, _, encoded = _block(1)
    assert node.put(7, [key], [encoded[5]], [1], [1000.0], True) == [True]
    state = (node.usage()["pending"], node.usage()["shards"], node.usage()["bytes_used"])
    again = _reopen(node, tmp_path)
    assert (again.usage()["pending"], again.usage()["shards"], again.usage()["bytes_used"]) == state
    assert state[:2] == (1, 1)
    assert bytes(_shards(again, [key])[0]) == bytes(encoded[5])  # type: ignore[arg-type]


def test_a_segment_removed_behind_the_nodes_back_is_reported_by_the_next_scrub(
    tmp_path: Path,
) -> None:
    # Found by the chaos runs: a read that meets missing bytes must not forget them silently,
    # or repair never learns the stripe lost a shard.
    node = StorageNode(0, tmp_path, SMALL)
    _put(node, 5, [1, 2], index=4)
    node.commit(5, [_key(1), _key(2)])
    os.truncate(_segment_paths(tmp_path)[0], SEGMENT_HEADER_BYTES)
    assert _shards(node, [_key(1)]) == [None]
    report = node.scrub(limit=10)
    assert sorted(report["corrupt"]) == sorted([(_key(1), 4), (_key(2), 4)])  # type: ignore[type-var]
    assert node.scrub(limit=10)["corrupt"] == []  # reported once


def test_orphans_are_reclaimed_only_after_the_grace_period(tmp_path: Path) -> None:
    clock = ManualClock(10_000.0)
    node = StorageNode(0, tmp_path, SMALL, clock=clock)
    _put(node, 5, [1, 2, 3])
    node.commit(5, [_key(1), _key(2)])  # block 3 stays pending: its writer died
    asked: list[list[bytes]] = []

    def referenced(keys: list[bytes]) -> list[bool]:
        asked.append(list(keys))
        return [key == _key(1) for key in keys]

    assert node.reclaim_orphans(referenced, grace_s=60) == {
        "pending_reclaimed": 0,
        "committed_reclaimed": 0,
    }
    clock.advance(61)
    assert node.reclaim_orphans(referenced, grace_s=60) == {
        "pending_reclaimed": 1,
        "committed_reclaimed": 1,
    }
    assert sorted(asked[-1]) == sorted([_key(1), _key(2)])
    assert node.holds([_key(1), _key(2)]) == [True, False]
    assert node.usage()["pending"] == 0


def test_compaction_reclaims_dead_bytes_and_keeps_every_live_shard(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    items = list(range(120))
    for start in range(0, 120, 12):
        _stored(node, items[start : start + 12])
    _put(node, 9, [500, 501])  # pending shards in an old segment must move too
    for start in range(0, 120, 12):
        _stored(node, [start + 12 + 1000], token=8)  # roll past them
    node.delete([_key(i) for i in items if i % 4])  # three quarters dead
    before = node.usage()
    assert before["dead_bytes"] > before["live_bytes"]
    moved = node.compact(budget_bytes=1 << 30)
    after = node.usage()
    assert moved["segments_removed"] > 0
    assert after["bytes_used"] < before["bytes_used"] and after["dead_bytes"] < before["dead_bytes"]
    kept = [i for i in items if i % 4 == 0]
    for i, shard in zip(kept, _shards(node, [_key(i) for i in kept]), strict=True):
        assert shard is not None and bytes(shard) == bytes(_block(i)[2][0])
    assert node.commit(9, [_key(500), _key(501)]) == [True, True]  # moved, still committable
    live = node.usage()["live_bytes"]
    again = _reopen(node, tmp_path)
    assert again.holds([_key(i) for i in items]) == [i % 4 == 0 for i in items]
    assert again.holds([_key(500), _key(501)]) == [True, True]
    assert again.usage()["live_bytes"] == live


def test_compaction_is_bounded_per_call_and_resumes(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    for start in range(0, 200, 20):
        _stored(node, list(range(start, start + 20)))
    node.delete([_key(i) for i in range(200) if i % 3])
    record = RECORD_BYTES + CODEC.shard_length(4000)
    steps = []
    for _ in range(100):
        step = node.compact(budget_bytes=3 * record)
        steps.append(step)
        assert step["bytes_moved"] <= 3 * record + record  # one record past the budget at most
        if not step["bytes_moved"] and not step["segments_removed"]:
            break
    assert sum(s["segments_removed"] for s in steps) > 0
    kept = [i for i in range(200) if i % 3 == 0]
    assert node.holds([_key(i) for i in kept]) == [True] * len(kept)
    again = _reopen(node, tmp_path)
    assert again.holds([_key(i) for i in range(200)]) == [i % 3 == 0 for i in range(200)]


def test_marks_outlive_compaction_while_their_shard_is_on_disk(tmp_path: Path) -> None:
    # A DELETE mark whose shard sits in an older segment must be copied when its own segment is
    # compacted, or a restart would serve the deleted shard again.
    config = StorageNodeConfig(fsync="never", segment_bytes=16 * 1024)
    node = StorageNode(0, tmp_path, config)
    _stored(node, list(range(0, 20)))  # segment 1: these shards, nearly all live to the end
    _stored(node, list(range(100, 120)))  # segment 2 (the first is full)
    node.delete([_key(0)])  # its mark lands in segment 2 ...
    node.delete([_key(i) for i in range(100, 120)])  # ... which is then mostly dead
    _stored(node, list(range(200, 210)))  # segment 3: segment 2 is sealed
    first, second = (str(p) for p in _segment_paths(tmp_path)[:2])
    assert node.locate([_key(1)])[0][0] == first  # type: ignore[index]
    assert node.compact(budget_bytes=1 << 30)["segments_removed"] == 1
    assert [str(p) for p in _segment_paths(tmp_path)][:1] == [first]
    assert second not in [str(p) for p in _segment_paths(tmp_path)]
    again = _reopen(node, tmp_path, config)
    assert again.holds([_key(0), _key(1), _key(100), _key(200)]) == [False, True, False, True]


def test_a_crash_between_a_compaction_copy_and_the_removal_keeps_one_shard(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    for start in range(0, 60, 12):
        _stored(node, list(range(start, start + 12)))
    node.delete([_key(i) for i in range(0, 24) if i % 2])
    first = _segment_paths(tmp_path)[0]
    saved = first.read_bytes()
    node.compact(budget_bytes=1 << 30)
    node.close()
    if not first.exists():
        first.write_bytes(saved)  # as if the node died before it removed the segment
    again = StorageNode(0, tmp_path, SMALL)
    expected = [not (i < 24 and i % 2) for i in range(60)]
    assert again.holds([_key(i) for i in range(60)]) == expected
    assert again.usage()["shards"] == sum(expected)
    again.delete([_key(0)])
    again.compact(budget_bytes=1 << 30)
    assert _reopen(again, tmp_path).holds([_key(0), _key(2)]) == [False, True]


def test_usage_counts_the_log_on_disk(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _put(node, 5, [1, 2, 3])
    _put(node, 5, [1])  # a retried put of the same shard replaces its pending one
    node.commit(5, [_key(1), _key(2)])
    node.abort(5, [_key(3)])
    node.delete([_key(2)])
    usage = node.usage()
    on_disk = sum(p.stat().st_blocks * 512 for p in _segment_paths(tmp_path))
    record = RECORD_BYTES + CODEC.shard_length(4000)
    assert usage["bytes_used"] == on_disk
    assert (usage["shards"], usage["pending"], usage["live_bytes"]) == (1, 0, record)
    assert usage["dead_bytes"] > 3 * record  # three dead shards and the marks


def test_capacity_from_the_disk_keeps_the_reserve_free(tmp_path: Path) -> None:
    # A reserve as large as the whole disk: nothing may be written, whatever is free.
    full = StorageNode(0, tmp_path / "a", StorageNodeConfig(disk_reserve_fraction=0.999999))
    assert _put(full, 5, [1]) == [False]
    usage = full.usage()
    assert (usage["headroom_bytes"], usage["capacity_bytes"]) == (0, usage["bytes_used"])
    assert usage["capacity_from_disk"] == 1
    # No reserve: the node may hold what it holds plus what the disk has free.
    roomy = StorageNode(
        1, tmp_path / "b", StorageNodeConfig(disk_reserve_fraction=0, disk_reserve_bytes=0)
    )
    assert _put(roomy, 5, [1]) == [True]
    usage = roomy.usage()
    disk = os.statvfs(tmp_path)
    free = disk.f_bavail * disk.f_frsize
    assert usage["capacity_bytes"] == usage["bytes_used"] + usage["headroom_bytes"]
    # What the disk has free, as it was a moment ago: other processes on this machine write
    # and delete meanwhile.
    assert 0 < usage["headroom_bytes"] and abs(usage["headroom_bytes"] - free) < 1 << 30
    same_disk = {full.usage()["filesystem"], roomy.usage()["filesystem"]}
    assert len(same_disk) == 1  # both dirs are on one filesystem: one identity
    # An explicit capacity is the operator's, whatever the disk says.
    fixed = StorageNode(2, tmp_path / "c", StorageNodeConfig(capacity_bytes=10**15))
    assert fixed.usage()["capacity_bytes"] == 10**15
    assert fixed.usage()["capacity_from_disk"] == 0


def test_shard_records_are_found_from_the_files_alone(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, SMALL)
    _stored(node, [1, 2])
    located = node.locate([_key(1)])
    assert find_shard_records(tmp_path, _key(1)) == located  # while it serves: no lock taken
    assert find_shard_records(tmp_path, _key(3)) == []
    where = node.locate([_key(2)])
    node.close()
    assert find_shard_records(tmp_path, _key(2)) == where
