"""Compaction alone, over a segment log in memory and its index: live records survive (their
bytes readable where the index says), emptied segments are removed, and a replay of what is left
gives the index compaction left (DELETE and COMMIT marks copied while their shard is on disk)."""

from __future__ import annotations

from segment_records import BODY_BYTES, body_at, commit, delete, key, put

from kvstore.blockstore.compaction import Compaction
from kvstore.blockstore.logfiles import MemoryFiles
from kvstore.blockstore.segmentlog import SegmentLog
from kvstore.blockstore.segments import RECORD_BYTES, SEGMENT_HEADER_BYTES, segment_name
from kvstore.blockstore.shardindex import ShardIndex
from kvstore.clock import ManualClock

#: A segment holds one batch: 8 SHARD records and their 8 COMMIT records.
SEGMENT_BYTES = SEGMENT_HEADER_BYTES + 8 * (2 * RECORD_BYTES + BODY_BYTES)
LIVE_FRACTION = 0.25


def open_log(files: MemoryFiles) -> SegmentLog:
    return SegmentLog(files, segment_bytes=SEGMENT_BYTES, fsync="batch", clock=ManualClock())


def where(index: ShardIndex) -> dict[bytes, tuple[int, int, int]]:
    """Each committed key's (segment, offset, lsn)."""
    return {
        k: (index.get("seg", row), index.get("offset", row), index.get("lsn", row))
        for k, row in index.committed.items()
    }


def filled() -> tuple[MemoryFiles, SegmentLog, ShardIndex, dict[bytes, bytes]]:
    """A log of one segment per batch: the first mostly live (key 0 deleted), four with one live
    shard or none, one of DELETE marks only (sealed by the last batch's roll)."""
    files = MemoryFiles()
    log, index = open_log(files), ShardIndex()
    bodies: dict[bytes, bytes] = {}
    deleted = False
    for batch in [range(8), *(range(100 + 8 * b, 108 + 8 * b) for b in range(4)), range(200, 208)]:
        if batch.start == 200:
            delete(log, index, [key(n) for n in [0, *range(100, 132)] if n not in (105, 120)])
            deleted = True
        keys = [key(n) for n in batch]
        bodies |= put(log, index, keys)
        commit(log, index, keys)
    assert deleted and len(log.sealed()) == 6
    return files, log, index, bodies


def one_pass(log: SegmentLog) -> int:
    """A budget of every sealed byte: what one pass over the log may move. (Not more: a sealed
    segment of copied marks counts no live bytes, so a budget without end would move them on
    and on.)"""
    return sum(log.sealed().values())


def test_compaction_keeps_live_records_and_removes_emptied_segments() -> None:
    files, log, index, bodies = filled()
    survivors = [key(n) for n in [*range(1, 8), 105, 120, *range(200, 208)]]
    assert sorted(index.committed) == sorted(survivors)
    emptied = [seq for seq in log.sealed() if not index.live_bytes(seq)]
    assert emptied  # the deletes left segments with nothing live
    mostly_live = [
        seq for seq, size in log.sealed().items() if index.live_bytes(seq) > LIVE_FRACTION * size
    ]
    assert mostly_live == [1]
    moving = {index.get("seg", index.committed[key(n)]) for n in (105, 120)}

    done = Compaction(log, index, live_fraction=LIVE_FRACTION).compact(one_pass(log))

    assert done["segments_removed"] >= len(emptied) and done["bytes_moved"] > 0
    for seq in emptied:
        assert segment_name(seq) not in files.data and log.segment(seq) is None
    for seq in moving:  # their one live shard was moved out
        assert segment_name(seq) not in files.data
    assert segment_name(1) in files.data  # above the live fraction: left as it is
    assert sorted(index.committed) == sorted(survivors)
    for k in survivors:
        assert body_at(log, index, k) == bodies[k]
    assert sum(index.live.values()) == len(survivors) * (RECORD_BYTES + BODY_BYTES)


def test_a_replay_after_compaction_gives_the_same_index() -> None:
    files, log, index, bodies = filled()
    Compaction(log, index, live_fraction=LIVE_FRACTION).compact(one_pass(log))
    log.close()

    again, replayed = open_log(files), ShardIndex()
    replayed.replay(again.entry_tables())
    assert where(replayed) == where(index)
    assert dict(replayed.live) == dict(index.live)
    # Key 0's shard is still in segment 1: its DELETE mark was copied out of the segment of
    # marks that compaction removed, else the replay would serve it again.
    assert key(0) not in replayed.committed and key(1) in replayed.committed
    for k in replayed.committed:
        assert body_at(again, replayed, k) == bodies[k]


def test_compaction_stops_within_its_budget_and_resumes() -> None:
    files, log, index, bodies = filled()
    emptied = [seq for seq in log.sealed() if not index.live_bytes(seq)]
    compaction = Compaction(log, index, live_fraction=LIVE_FRACTION)
    steps = 0
    while any(log.segment(seq) is not None for seq in emptied):
        step = compaction.compact(budget_bytes=RECORD_BYTES + 1)
        assert step["bytes_moved"] <= 2 * (RECORD_BYTES + BODY_BYTES)
        steps += 1
        assert steps < 1000
    assert steps > 3  # it did stop mid-segment and resume
    for k in index.committed:
        assert body_at(log, index, k) == bodies[k]
    log.close()
    replayed = ShardIndex()
    replayed.replay(open_log(files).entry_tables())
    assert where(replayed) == where(index)
