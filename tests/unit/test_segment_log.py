"""The segment log alone, over files in memory (as LevelDB's log tests run over a string):
records written, read back after a reopen; a torn tail dropped and cut off; damage in the middle
losing only what it covers; a crafted LSN at the top of the u64 space refused at reopen; a failed
write leaving nothing behind."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from segment_records import BODY_BYTES, key, marks, shards

from kvstore.blockstore.logfiles import DiskFiles, MemoryFiles
from kvstore.blockstore.segmentlog import AppendFailed, SegmentLog
from kvstore.blockstore.segments import (
    COMMIT,
    MAX_LSN,
    RECORD_BYTES,
    RESERVE_AHEAD_BYTES,
    SEGMENT_HEADER,
    SEGMENT_HEADER_BYTES,
    SEGMENT_MAGIC,
    SHARD,
    record_header,
    segment_name,
)
from kvstore.clock import ManualClock
from kvstore.privatefs import PrivateDir

RECORD = RECORD_BYTES + BODY_BYTES


def open_log(files: MemoryFiles, segment_bytes: int = 1 << 20) -> SegmentLog:
    return SegmentLog(files, segment_bytes=segment_bytes, fsync="batch", clock=ManualClock())


def records(log: SegmentLog) -> list[tuple[int, int, int, bytes]]:
    """(segment, offset, lsn, key) of every record the log reads back, in file order."""
    return [
        (seq, int(entry["offset"]), int(entry["record"]["lsn"]), bytes(entry["record"]["key"]))
        for seq, table in log.entry_tables()
        for entry in table
    ]


def body(log: SegmentLog, seq: int, offset: int) -> bytes:
    into = bytearray(BODY_BYTES)
    assert log.read(seq, offset + RECORD_BYTES, BODY_BYTES, memoryview(into))
    return bytes(into)


def test_records_written_are_read_back_after_a_reopen() -> None:
    files = MemoryFiles()
    log = open_log(files)
    seq, offsets, bodies = shards(log, [key(1), key(2), key(3)])
    marks(log, COMMIT, [(key(1), 1, 1)])
    assert offsets == [SEGMENT_HEADER_BYTES + n * RECORD for n in range(3)]
    log.close()

    again = open_log(files)
    assert records(again) == [
        (seq, offsets[0], 1, key(1)),
        (seq, offsets[1], 2, key(2)),
        (seq, offsets[2], 3, key(3)),
        (seq, offsets[2] + RECORD, 4, key(1)),
    ]
    assert [body(again, seq, offset) for offset in offsets] == bodies
    assert again.damaged_records == 0
    assert again.take_lsns(1) == 5  # LSNs go on after the last one read back


def test_a_batch_is_one_write() -> None:
    files = MemoryFiles()
    log = open_log(files)
    before = files.writes
    shards(log, [key(n) for n in range(50)])
    marks(log, COMMIT, [(key(n), 1, n + 1) for n in range(50)])
    assert files.writes == before + 2


def test_segments_roll_and_sealed_ones_are_read_back_from_their_footer() -> None:
    files = MemoryFiles()
    log = open_log(files, segment_bytes=SEGMENT_HEADER_BYTES + 2 * RECORD)
    for n in range(5):
        shards(log, [key(n)])
    shards(log, [key(10 + n) for n in range(4)])  # larger than a segment: one of its own
    written = records(log)
    assert len(log) == len(files.data) == 4
    assert sorted(log.sealed()) == [1, 2, 3]
    log.close()

    again = open_log(files, segment_bytes=SEGMENT_HEADER_BYTES + 2 * RECORD)
    assert records(again) == written
    assert sorted(again.sealed()) == [1, 2, 3] and again.open_seq == 4


def test_a_torn_tail_is_dropped_and_cut_off_and_appends_go_on_after_it() -> None:
    files = MemoryFiles()
    log = open_log(files)
    shards(log, [key(1), key(2)])
    log.close()
    data = files.data[segment_name(1)]
    del data[-50:]  # the last record's body half written

    again = open_log(files)
    assert [r[3] for r in records(again)] == [key(1)]
    assert again.damaged_records == 1
    assert len(data) == SEGMENT_HEADER_BYTES + RECORD  # the torn bytes are gone
    seq, offsets, _ = shards(again, [key(3)])
    assert offsets == [SEGMENT_HEADER_BYTES + RECORD]
    again.close()
    assert [r[3] for r in records(open_log(files))] == [key(1), key(3)]


def test_a_corrupt_record_is_detected_and_loses_only_itself() -> None:
    files = MemoryFiles()
    log = open_log(files)
    shards(log, [key(1), key(2), key(3)])
    log.close()
    files.data[segment_name(1)][SEGMENT_HEADER_BYTES + RECORD + 60] ^= 0xFF  # key(2)'s header

    again = open_log(files)
    assert [r[3] for r in records(again)] == [key(1), key(3)]
    assert again.damaged_records == 1


@pytest.mark.parametrize("sealed", [False, True])
def test_a_crafted_lsn_at_the_top_of_the_u64_space_is_refused_at_reopen(sealed: bool) -> None:
    """A record with a good checksum and LSN 2**64-1 would set the next LSN past the field:
    every later append would raise OverflowError. It is left out as damage instead."""
    files = MemoryFiles()
    log = open_log(files, segment_bytes=SEGMENT_HEADER_BYTES + 3 * RECORD)
    shards(log, [key(1)])
    crafted = record_header(SHARD, 2**64 - 1, key(2), token=1, body_len=BODY_BYTES)
    log.append(crafted, [bytes(BODY_BYTES)])
    if sealed:
        shards(log, [key(3), key(4)])  # rolls: the crafted record is in a footer now
    log.close()

    again = open_log(files)
    assert key(2) not in [r[3] for r in records(again)]
    assert again.damaged_records == 1
    assert again.next_lsn <= MAX_LSN
    shards(again, [key(5)])  # appends work, and go on working after another reopen
    again.close()
    assert records(open_log(files))[-1][3] == key(5)


def test_a_segment_header_naming_an_lsn_beyond_the_space_is_not_used() -> None:
    files = MemoryFiles()
    open_log(files).close()
    crafted = SEGMENT_HEADER.pack(SEGMENT_MAGIC, 1, 2**64 - 1, 0.0, bytes(24), bytes(8))
    crafted = crafted[:56] + xxhash.xxh3_64_digest(crafted[:56])  # a good checksum
    files.data[segment_name(1)][:SEGMENT_HEADER_BYTES] = crafted
    again = open_log(files)
    assert again.next_lsn == 1
    shards(again, [key(1)])
    assert records(again)[-1][2] == 1


def test_a_failed_write_leaves_nothing_behind() -> None:
    files = MemoryFiles()
    log = open_log(files)
    shards(log, [key(1)])
    files.fail_writes = True
    with pytest.raises(AppendFailed):
        shards(log, [key(2)])
    files.fail_writes = False
    shards(log, [key(3)])
    log.close()
    assert [r[3] for r in records(open_log(files))] == [key(1), key(3)]


def test_removing_a_sealed_segment_removes_its_file_but_never_the_open_one() -> None:
    files = MemoryFiles()
    log = open_log(files, segment_bytes=SEGMENT_HEADER_BYTES + RECORD)
    shards(log, [key(1)])
    shards(log, [key(2)])
    assert list(log.sealed()) == [1]
    log.remove(1)
    assert sorted(files.data) == [segment_name(2)] and len(log) == 1
    with pytest.raises(ValueError, match="open"):
        log.remove(log.open_seq)
    assert not log.read(1, SEGMENT_HEADER_BYTES, 1, memoryview(bytearray(1)))
    assert [r[3] for r in records(log)] == [key(2)]


# --- the page cache holds only the newest appends ----------------------------------------------


def test_the_page_cache_is_told_to_drop_the_oldest_appends_past_the_bound() -> None:
    files = MemoryFiles()
    batch = 2 * RECORD
    log = SegmentLog(
        files,
        segment_bytes=SEGMENT_HEADER_BYTES + 3 * batch,
        fsync="batch",
        clock=ManualClock(),
        cached_bytes=2 * batch,
    )
    placed = [shards(log, [key(2 * n), key(2 * n + 1)])[:2] for n in range(5)]
    # Five batches of two records, three a segment: the oldest three were let go, in order,
    # each as the range its batch was written to; the newest two are kept.
    assert files.dropped == [(segment_name(seq), offsets[0], batch) for seq, offsets in placed[:3]]
    log.remove(1)  # a segment compaction emptied: nothing of it is left to drop
    shards(log, [key(20), key(21)])
    assert files.dropped[3:] == [(segment_name(placed[3][0]), placed[3][1][0], batch)]
    assert len(records(log)) == 6  # what was let go is still there: the cache is not the log


def test_without_a_bound_nothing_is_dropped() -> None:
    files = MemoryFiles()
    log = open_log(files)  # cached_bytes None
    for n in range(20):
        shards(log, [key(n)])
    assert files.dropped == []


def _resident_pages(path: str, offset: int, length: int) -> int:
    """How many of the pages wholly inside [offset, offset + length) of the file are in the
    page cache (``mincore`` over a mapping that is never touched)."""
    page = mmap.PAGESIZE
    first, end = -(-offset // page), (offset + length) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        address = np.frombuffer(mapped, np.uint8).ctypes.data + first * page
        pages = (ctypes.c_ubyte * (end - first))()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        if libc.mincore(ctypes.c_void_p(address), (end - first) * page, pages) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(bit & 1 for bit in pages)
    finally:
        mapped.close()


def test_on_disk_pages_past_the_bound_leave_the_page_cache_and_their_bytes_stay(
    tmp_path: Path,
) -> None:
    # What the test stands on, said first: this filesystem caches writes and lets them go when
    # told (a disk filesystem does; tmpfs keeps its pages whatever it is told).
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 20))
    with open(probe, "rb+") as handle:
        os.fdatasync(handle.fileno())
        cached = _resident_pages(str(probe), 0, 1 << 20)
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert cached and not _resident_pages(str(probe), 0, 1 << 20), f"{tmp_path}: not a disk"
    directory = PrivateDir.open(tmp_path / "segments", "segments", check_parent=False)
    log = SegmentLog(
        DiskFiles(directory),
        segment_bytes=64 << 20,
        fsync="batch",
        clock=ManualClock(),
        cached_bytes=1 << 20,
    )
    body = 256 << 10
    placed = [shards(log, [key(n)], body_bytes=body) for n in range(8)]
    path = log.where(log.open_seq)
    record = RECORD_BYTES + body
    pages = body // mmap.PAGESIZE
    # 1 MiB holds the newest three records: the first five left the cache (a page or two at
    # each edge may stay), the newest three did not.
    assert _resident_pages(path, placed[0][1][0], 5 * record) <= 10
    assert _resident_pages(path, placed[5][1][0], 3 * record) >= 3 * pages - 3
    for seq, offsets, bodies in placed:  # and every byte is still there, read from the disk
        into = bytearray(body)
        assert log.read(seq, offsets[0] + RECORD_BYTES, body, memoryview(into))
        assert bytes(into) == bodies[0]
    log.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_a_batch_of_headers_is_the_records_one_at_a_time_and_each_checks(
    monkeypatch: pytest.MonkeyPatch, in_c: bool
) -> None:
    """``record_headers`` fills a batch's checksums in one C call (``_shardsums.row_sums`` over
    each header's first 88 bytes), or with the loop it stands in for: either way each header is
    byte for byte what ``record_header`` makes of its record alone, and a scan keeps them all;
    a header with one byte changed fails its checksum at the scan and is lost, alone."""
    from kvstore.blockstore import segments

    if not in_c:
        monkeypatch.setattr(segments, "_sums", None)
    else:
        assert segments._sums is not None  # built with the package (CI builds it)
    keys = [key(n) for n in range(7)]
    fields = {"token": 2**64 - 3, "class_id": 4, "index": 11, "created": 5.5, "stamp": 6.25}
    lengths = [0, 64, 11_456, 1, 2**32 - 1, 96, 7]
    heads = segments.record_headers(SHARD, 40, keys, body_len=lengths, flags=1, **fields)
    assert bytes(heads) == b"".join(
        record_header(SHARD, 40 + n, k, body_len=lengths[n], flags=1, **fields)  # type: ignore[arg-type]
        for n, k in enumerate(keys)
    )
    marks = segments.record_headers(COMMIT, 9, keys[:3], token=[1, 2, 3], target_lsn=[4, 5, 6])
    files = MemoryFiles()
    log = open_log(files)
    log.append(marks, [b""] * 3)
    damaged = bytearray(marks)
    damaged[RECORD_BYTES + 50] ^= 1  # the second mark's token
    log.append(damaged, [b""] * 3)
    log.close()
    again = open_log(files)
    assert [lsn for _, _, lsn, _ in records(again)] == [9, 10, 11, 9, 11]
    assert again.damaged_records == 1


def test_an_open_segment_has_blocks_ahead_of_its_appends_and_a_sealed_one_gives_them_back(
    tmp_path: Path,
) -> None:
    directory = PrivateDir.open(tmp_path / "segments", "segments", check_parent=False)
    log = SegmentLog(
        DiskFiles(directory), segment_bytes=4 << 20, fsync="batch", clock=ManualClock()
    )
    body = 256 << 10
    first = shards(log, [key(0)], body_bytes=body)
    status = os.stat(log.where(first[0]))
    # The size is what was written (where a reopen stops reading); the blocks run ahead.
    assert status.st_size == SEGMENT_HEADER_BYTES + RECORD_BYTES + body
    assert status.st_blocks * 512 >= RESERVE_AHEAD_BYTES
    n = 1
    while log.open_seq == first[0]:  # appends until the segment rolls (16 of them)
        shards(log, [key(n)], body_bytes=body)
        n += 1
    sealed = os.stat(log.where(first[0]))
    assert sealed.st_blocks * 512 < sealed.st_size + (64 << 10)  # nothing held past its end
    log.close()
    again = SegmentLog(
        DiskFiles(directory), segment_bytes=4 << 20, fsync="batch", clock=ManualClock()
    )
    assert body_of(again, first) == first[2][0]
    again.close()


def body_of(log: SegmentLog, placed: tuple[int, list[int], list[bytes]]) -> bytes:
    seq, offsets, bodies = placed
    into = bytearray(len(bodies[0]))
    assert log.read(seq, offsets[0] + RECORD_BYTES, len(into), memoryview(into))
    return bytes(into)
