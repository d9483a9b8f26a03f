"""Storage node: crash-safe shard files, pending vs committed, restart, cache, scrub, orphans."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.node import StorageNode, split_files
from kvstore.blockstore.shardfile import NODE_HEADER_BYTES, parse_node_header, payload_hash
from kvstore.clock import ManualClock
from kvstore.ec import Codec
from kvstore.errors import ConfigError, InvalidArgument

CODEC = Codec(10, 2)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _block(i: int, size: int = 4000) -> tuple[bytes, np.ndarray, list[np.ndarray], bytes]:
    key = _key(i)
    payload = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
    return key, payload, CODEC.encode(payload, key), payload_hash(payload)


def _put(node: StorageNode, token: int, items: list[int], index: int = 0) -> list[bool]:
    blocks = [_block(i) for i in items]
    return node.put(
        token,
        [b[0] for b in blocks],
        [b[2][index] for b in blocks],
        [b[3] for b in blocks],
        [1] * len(blocks),
        [1000.0 + i for i in items],
    )


def _files(node: StorageNode, keys: list[bytes]) -> list[np.ndarray | None]:
    return split_files(node.get(keys))


def _disk_bytes(data_dir: Path) -> int:
    """Disk bytes of the shard files (committed and pending) under ``data_dir``."""
    files = [*(data_dir / "shards").iterdir(), *(data_dir / "pending").iterdir()]
    return sum(path.lstat().st_blocks * 512 for path in files)


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_pending_shards_are_invisible_until_committed(tmp_path: Path, fsync: str) -> None:
    node = StorageNode(3, tmp_path, StorageNodeConfig(fsync=fsync))
    assert _put(node, 7, [1, 2], index=4) == [True, True]
    assert _files(node, [_key(1), _key(2)]) == [None, None]
    assert node.usage()["pending"] == 2 and node.usage()["shards"] == 0
    assert node.commit(99, [_key(1)]) == [False]  # another writer's token commits nothing
    assert node.commit(7, [_key(1), _key(2)]) == [True, True]
    files = _files(node, [_key(1), _key(2), _key(3)])
    assert files[2] is None
    key, payload, shards, digest = _block(1)
    assert files[0] is not None
    assert bytes(files[0][NODE_HEADER_BYTES:]) == bytes(shards[4])
    header = parse_node_header(files[0])
    assert (header.payload_hash, header.class_id, header.token, header.created) == (
        digest,
        1,
        7,
        1001.0,
    )
    assert node.holds([_key(1), _key(3)]) == [True, False]
    assert sorted(os.listdir(tmp_path / "shards")) == sorted([_key(1).hex(), _key(2).hex()])
    assert os.listdir(tmp_path / "pending") == []


def test_a_restarted_node_serves_its_committed_shards_and_keeps_pending_ones(
    tmp_path: Path,
) -> None:
    node = StorageNode(0, tmp_path)
    _put(node, 5, [1, 2, 3])
    node.commit(5, [_key(1), _key(2)])
    before = _files(node, [_key(1), _key(2)])
    used = node.usage()["bytes_used"]
    del node
    again = StorageNode(0, tmp_path)  # a crash and restart: only the directory survives
    assert [bytes(f) for f in _files(again, [_key(1), _key(2)])] == [bytes(f) for f in before]
    usage = again.usage()
    assert {k: usage[k] for k in ("node_id", "bytes_used", "shards", "pending")} == {
        "node_id": 0,
        "bytes_used": used,
        "shards": 2,
        "pending": 1,
    }
    assert used == _disk_bytes(tmp_path)  # the blocks the files take, found again by a scan
    assert again.commit(5, [_key(3)]) == [True]  # the pending write can still commit
    table = again.manifest()
    assert sorted(table.column("key").to_pylist()) == sorted([_key(1), _key(2), _key(3)])
    assert set(table.column("class_id").to_pylist()) == {1}


def test_snapshot_speeds_up_restart_and_matches_the_directory(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    _put(node, 5, list(range(6)))
    node.commit(5, [_key(i) for i in range(6)])
    assert node.snapshot() == 6
    node.delete([_key(0)])  # after the snapshot: the directory is the truth
    again = StorageNode(0, tmp_path)
    assert sorted(again.manifest().column("key").to_pylist()) == sorted(
        _key(i) for i in range(1, 6)
    )


def test_a_data_dir_of_another_node_is_refused(tmp_path: Path) -> None:
    StorageNode(1, tmp_path)
    with pytest.raises(ConfigError, match="data_dir"):
        StorageNode(2, tmp_path)


def test_torn_files_found_at_start_go_to_quarantine(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    _put(node, 5, [1])
    node.commit(5, [_key(1)])
    (tmp_path / "shards" / _key(2).hex()).write_bytes(b"torn")
    again = StorageNode(0, tmp_path)
    assert again.holds([_key(1), _key(2)]) == [True, False]
    assert len(os.listdir(tmp_path / "quarantine")) == 1


def test_bad_shards_and_full_disks_are_refused(tmp_path: Path) -> None:
    key, _, shards, digest = _block(1)
    other, _, other_shards, _ = _block(2)
    block = os.statvfs(tmp_path).f_bsize  # a ~500-byte shard file takes one disk block
    node = StorageNode(0, tmp_path, StorageNodeConfig(capacity_bytes=block * 3 // 2))
    flipped = shards[0].copy()
    flipped[100] ^= 1
    results = node.put(
        1,
        [key, key, other],
        [flipped, other_shards[0], other_shards[0]],
        [digest] * 3,
        [0] * 3,
        [0.0] * 3,
    )
    assert results == [False, False, True]  # corrupt; belongs to another key; fits
    assert node.put(2, [other], [other_shards[1]], [digest], [0], [0.0]) == [False]  # full
    with pytest.raises(InvalidArgument, match="shards"):
        node.put(3, [key], [], [], [], [])


def test_delete_respects_not_after_and_abort_frees_pending(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path)
    _put(node, 5, [1, 2])
    node.commit(5, [_key(1), _key(2)])
    assert node.delete([_key(1), _key(2)], not_after=1001.5) == 1  # block 2 created at 1002
    assert node.holds([_key(1), _key(2)]) == [False, True]
    _put(node, 6, [3])
    assert node.abort(6, [_key(3)]) == 1
    assert node.usage()["pending"] == 0
    assert os.listdir(tmp_path / "pending") == []


def test_read_cache_is_bounded_and_survives_nothing_stale(tmp_path: Path) -> None:
    shard_file = NODE_HEADER_BYTES + CODEC.shard_length(4000)
    node = StorageNode(0, tmp_path, StorageNodeConfig(read_cache_bytes=3 * shard_file))
    _put(node, 5, list(range(6)))
    node.commit(5, [_key(i) for i in range(6)])
    for _ in range(2):
        _files(node, [_key(i) for i in range(6)])
    assert node.stats()["cache_bytes"] <= 3 * shard_file
    node.delete([_key(5)])
    assert _files(node, [_key(5)]) == [None]


def test_scrub_quarantines_corrupt_shards(tmp_path: Path) -> None:
    node = StorageNode(0, tmp_path, StorageNodeConfig(read_cache_bytes=0))
    _put(node, 5, [1, 2, 3])
    node.commit(5, [_key(1), _key(2), _key(3)])
    path = tmp_path / "shards" / _key(2).hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    report = node.scrub(limit=10)
    assert report["checked"] == 3
    assert report["corrupt"] == [(_key(2), 0)]
    assert node.holds([_key(1), _key(2), _key(3)]) == [True, False, True]
    assert len(os.listdir(tmp_path / "quarantine")) == 1


def test_a_shard_file_deleted_behind_the_nodes_back_is_reported_by_the_next_scrub(
    tmp_path: Path,
) -> None:
    # Found by the chaos runs: a read that meets a vanished file must not forget it silently,
    # or repair never learns the stripe lost a shard.
    node = StorageNode(0, tmp_path, StorageNodeConfig(read_cache_bytes=0))
    _put(node, 5, [1, 2], index=4)
    node.commit(5, [_key(1), _key(2)])
    os.unlink(tmp_path / "shards" / _key(1).hex())
    assert _files(node, [_key(1)]) == [None]
    report = node.scrub(limit=10)
    assert report["corrupt"] == [(_key(1), 4)]
    assert node.scrub(limit=10)["corrupt"] == []  # reported once


def test_orphans_are_reclaimed_only_after_the_grace_period(tmp_path: Path) -> None:
    clock = ManualClock(10_000.0)
    node = StorageNode(0, tmp_path, clock=clock)
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


def test_usage_counts_disk_blocks_through_put_retry_commit_replace_abort_delete(
    tmp_path: Path,
) -> None:
    node = StorageNode(0, tmp_path, StorageNodeConfig(fsync="never"))
    _put(node, 5, [1, 2, 3])
    _put(node, 5, [1])  # a retried put of the same shard replaces its pending file
    assert node.usage()["bytes_used"] == _disk_bytes(tmp_path) > 0
    node.commit(5, [_key(1), _key(2)])
    _put(node, 6, [1])
    node.commit(6, [_key(1)])  # a newer write of key 1 replaces the committed one
    assert node.usage()["bytes_used"] == _disk_bytes(tmp_path)
    node.abort(5, [_key(3)])
    node.delete([_key(2)])
    assert node.usage() | {"headroom_bytes": 0, "capacity_bytes": 0} == {
        "node_id": 0,
        "bytes_used": _disk_bytes(tmp_path),
        "capacity_bytes": 0,
        "capacity_from_disk": 1,
        "filesystem": node.usage()["filesystem"],
        "headroom_bytes": 0,
        "shards": 1,
        "pending": 0,
    }


def test_capacity_from_the_disk_keeps_the_reserve_free(tmp_path: Path) -> None:
    # A reserve as large as the whole disk: nothing may be written, whatever is free.
    full = StorageNode(0, tmp_path / "a", StorageNodeConfig(disk_reserve_fraction=0.999999))
    assert _put(full, 5, [1]) == [False]
    usage = full.usage()
    assert (usage["headroom_bytes"], usage["capacity_bytes"], usage["bytes_used"]) == (0, 0, 0)
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
    # and delete meanwhile (a bound taken before the node's own statvfs failed when the disk
    # freed 78 KB in between).
    assert 0 < usage["headroom_bytes"] and abs(usage["headroom_bytes"] - free) < 1 << 30
    same_disk = {full.usage()["filesystem"], roomy.usage()["filesystem"]}
    assert len(same_disk) == 1  # both dirs are on one filesystem: one identity
    # An explicit capacity is the operator's, whatever the disk says.
    fixed = StorageNode(2, tmp_path / "c", StorageNodeConfig(capacity_bytes=10**15))
    assert fixed.usage()["capacity_bytes"] == 10**15
    assert fixed.usage()["capacity_from_disk"] == 0
