"""The in-memory index of a storage node's log: where each shard record is, what its header
said, which are committed, and how many live bytes each segment holds.

Rows live in numpy columns (~60 bytes a shard, plus the dict entry mapping its key to its row),
not in Python objects: a node indexing millions of shards keeps that in RAM. ``replay`` rebuilds
the whole index from the records of every segment (the rule is in ``kvstore.blockstore.node``).

The index owns its maps and columns: callers read them (``committed``, ``pending``, ``live``
as read-only mappings, ``column`` as read-only arrays) and change them only through the methods
below, which keep them in step: a record is live exactly while a row points at it, so the live
bytes of a segment move with every row added, dropped or moved, here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from kvstore.blockstore.segments import COMMIT, DELETE, FLAG_COMMITTED, RECORD_BYTES, SHARD


class ShardIndex:
    """Where each indexed shard record is and what its header said, in columns (one row per
    shard: ~60 bytes of arrays, plus the dict entry that maps its key to the row)."""

    _COLUMNS = (
        ("seg", np.uint32),
        ("offset", np.uint64),
        ("body_len", np.uint32),
        ("index", np.uint8),
        ("class_id", np.uint8),
        ("created", np.float64),
        ("stamp", np.float64),
        ("lsn", np.uint64),
        ("payload_len", np.uint64),
        ("payload_hash", np.uint64),
    )

    def __init__(self, capacity: int = 1024) -> None:
        self._columns = {name: np.zeros(capacity, dtype) for name, dtype in self._COLUMNS}
        self._free = list(range(capacity - 1, -1, -1))
        self._committed: dict[bytes, int] = {}
        self._pending: dict[tuple[bytes, int], int] = {}  # (key, writer token) -> row
        #: segment seq -> bytes of the records rows point at (the rest of the file is dead)
        self._live: dict[int, int] = {}

    # --- reading ---------------------------------------------------------------------------

    @property
    def committed(self) -> Mapping[bytes, int]:
        """Key -> row of its committed shard (read-only, always current)."""
        return MappingProxyType(self._committed)

    @property
    def pending(self) -> Mapping[tuple[bytes, int], int]:
        """(key, writer token) -> row of a shard written but not committed (read-only)."""
        return MappingProxyType(self._pending)

    @property
    def live(self) -> Mapping[int, int]:
        """Segment seq -> bytes of the records rows point at (read-only)."""
        return MappingProxyType(self._live)

    def live_bytes(self, seq: int) -> int:
        return self._live.get(seq, 0)

    def live_total(self) -> int:
        return sum(self._live.values())

    def column(self, name: str) -> np.ndarray:
        """One column, every row (free ones too), as a read-only view."""
        view = self._columns[name].view()
        view.flags.writeable = False
        return view

    def places(self, rows: np.ndarray) -> np.ndarray:
        """Where the records of ``rows`` are: (segment, offset, body bytes) a row, int64, a new
        array (one call for a read's rows)."""
        out = np.empty((len(rows), 3), np.int64)
        columns = self._columns
        out[:, 0] = columns["seg"][rows]
        out[:, 1] = columns["offset"][rows]
        out[:, 2] = columns["body_len"][rows]
        return out

    def get(self, name: str, row: int) -> int:
        return int(self._columns[name][row])

    def record_bytes(self, row: int) -> int:
        return RECORD_BYTES + int(self._columns["body_len"][row])

    # --- changes ---------------------------------------------------------------------------

    def add(
        self, token: int, keys: Sequence[bytes], committed: bool = False, **values: Any
    ) -> list[int]:
        """Index ``keys``' new SHARD records, written by ``token``, as pending, or as committed
        (a put that is its own commit mark); their columns set from ``values`` (per row or
        one). What a new record replaces is dropped, as a replay of the log replaces it: a
        pending shard of the same key and token (a retried put) for a pending one, the key's
        committed shard for a committed one. Returns the rows."""
        rows, at = self._add_many(len(keys), **values)
        if committed:
            held: dict[Any, int] = self._committed
            names: Sequence[Any] = keys
        else:
            held, names = self._pending, [(key, token) for key in keys]
        for name, row in zip(names, rows, strict=True):
            older = held.get(name)
            if older is not None:
                self._drop(older)
            held[name] = row
        # Counted in per segment at once, not a row at a time (the order against the drops
        # above does not change the sums). A put's batch is one append: one segment.
        seqs = self._columns["seg"][at]
        sizes = self._columns["body_len"][at].astype(np.int64) + RECORD_BYTES
        groups = (
            [(int(seqs[0]), sizes)]
            if len(seqs) and (seqs == seqs[0]).all()
            else [(seq, sizes[seqs == seq]) for seq in np.unique(seqs).tolist()]
        )
        for seq, of_seq in groups:
            live = self._live.get(seq, 0) + int(of_seq.sum())
            if live:
                self._live[seq] = live
            else:
                self._live.pop(seq, None)
        return rows

    def commit(self, key: bytes, token: int) -> bool:
        """``token``'s pending shard of ``key`` becomes its committed one (an older committed
        shard is dropped); False when there is no such pending shard."""
        return self.commit_many([key], token) == 1

    def commit_many(self, keys: Sequence[bytes], token: int) -> int:
        """``commit`` of each of ``keys`` (distinct) in one call, as a node commits a batch;
        returns how many had a pending shard of ``token``."""
        pending, committed = self._pending, self._committed
        done = 0
        for key in keys:
            row = pending.pop((key, token), None)
            if row is None:
                continue
            old = committed.get(key)
            if old is not None:
                self._drop(old)
            committed[key] = row
            done += 1
        return done

    def abort(self, key: bytes, token: int) -> bool:
        """Drop ``token``'s pending shard of ``key``; False when there is none."""
        row = self._pending.pop((key, token), None)
        if row is not None:
            self._drop(row)
        return row is not None

    def forget(self, key: bytes) -> bool:
        """Drop ``key``'s committed shard; False when there is none."""
        row = self._committed.pop(key, None)
        if row is not None:
            self._drop(row)
        return row is not None

    def move(self, row: int, seq: int, offset: int) -> None:
        """Row ``row``'s record now lies at (``seq``, ``offset``): a compaction copy."""
        self._count(row, -1)
        self._columns["seg"][row] = seq
        self._columns["offset"][row] = offset
        self._count(row, 1)

    def _add_many(self, count: int, **values: Any) -> tuple[list[int], np.ndarray]:
        """Rows for ``count`` new shards, their columns set from ``values`` (per row or one):
        the rows as a list and as an array."""
        if not count:  # (``self._free[-0:]`` would be every free row)
            return [], np.zeros(0, np.int64)
        while len(self._free) < count:
            self._grow_to(2 * len(self._columns["seg"]))
        rows = self._free[-count:][::-1]
        del self._free[-count:]
        at = np.array(rows, np.int64)
        for name, value in values.items():
            self._columns[name][at] = value
        return rows, at

    def _count(self, row: int, sign: int) -> None:
        """Count row ``row``'s record in (1) or out of (-1) its segment's live bytes; a segment
        nothing points into has no entry (as after ``replay``)."""
        seq = self.get("seg", row)
        live = self._live.get(seq, 0) + sign * self.record_bytes(row)
        if live:
            self._live[seq] = live
        else:
            self._live.pop(seq, None)

    def _drop(self, row: int) -> None:
        """Forget a row: its record becomes dead bytes."""
        self._count(row, -1)
        self._free.append(row)

    def live_row(self, seq: int, offset: int, key: bytes, token: int) -> tuple[int, bool] | None:
        """The index row pointing at the SHARD record at (seq, offset), and whether it is the
        committed one; None when the record is dead."""
        columns = self._columns
        for row, committed in (
            (self._committed.get(key), True),
            (self._pending.get((key, token)), False),
        ):
            if row is not None and columns["seg"][row] == seq and columns["offset"][row] == offset:
                return row, committed
        return None

    def replay(self, tables: list[tuple[int, np.ndarray]]) -> int:
        """Rebuild a fresh index from every record of ``tables`` ((segment seq, ENTRY_DTYPE
        entries) each), applied in LSN order, ties by segment; returns the next free LSN.

        Every SHARD record gets a row up front (columns filled at once, vectorised); keys of the
        common histories are applied at once (``_apply_simple``), the rest by the ordered loop,
        which only moves row numbers between the two maps; the rows no map holds are freed at
        the end."""
        seqs = np.concatenate([np.full(len(t), seq, np.uint32) for seq, t in tables])
        entries = np.concatenate([t for _, t in tables])
        order = np.lexsort((seqs, entries["record"]["lsn"]))
        seqs, entries = seqs[order], entries[order]
        records = entries["record"]
        shard = records["kind"] == SHARD
        count = int(shard.sum())
        self._grow_to(count)
        for name, values in (
            ("seg", seqs[shard]),
            ("offset", entries["offset"][shard]),
            ("body_len", records["body_len"][shard]),
            ("index", records["index"][shard]),
            ("class_id", records["class_id"][shard]),
            ("created", records["created"][shard]),
            ("stamp", records["stamp"][shard]),
            ("lsn", records["lsn"][shard]),
            ("payload_len", entries["payload_len"][shard]),
            ("payload_hash", entries["payload_hash"][shard].view("<u8")),
        ):
            self._columns[name][:count] = values
        row_of = np.full(len(entries), -1, np.int64)
        row_of[shard] = np.arange(count)
        tangled = self._apply_simple(records, row_of)
        self._apply_in_order(records[tangled], row_of[tangled], records["lsn"][shard].tolist())
        used = np.zeros(len(self._columns["seg"]), bool)
        used[list(self._committed.values())] = True
        used[list(self._pending.values())] = True
        self._free = np.flatnonzero(~used)[::-1].tolist()
        live_rows = np.flatnonzero(used)
        sizes = self._columns["body_len"][live_rows].astype(np.int64) + RECORD_BYTES
        segs = self._columns["seg"][live_rows]
        for seq in np.unique(segs).tolist():
            self._live[seq] = int(sizes[segs == seq].sum())
        return int(records["lsn"].max()) + 1

    def _apply_simple(self, records: np.ndarray, row_of: np.ndarray) -> np.ndarray:
        """Apply at once the keys whose whole history is one of the two common shapes: a lone
        SHARD (pending, or committed when flagged so: a compaction copy, or a put committed as
        it was written), or a SHARD then the COMMIT of that very record. Returns, in LSN order,
        the records of every other key (and of keys sharing an 8-byte prefix with another),
        which the ordered loop applies: keys never act on one another, so splitting them this
        way changes nothing but the time (~1 s of loop for a restart of 200,000 committed
        shards)."""
        keys = np.ascontiguousarray(records["key"]).view(np.uint64).reshape(-1, 4)
        order = np.argsort(keys[:, 0], kind="stable")  # stable: LSN order within a group
        prefix = keys[order, 0]
        starts = np.flatnonzero(np.r_[True, prefix[1:] != prefix[:-1]])
        counts = np.diff(np.r_[starts, len(order)])
        kind, flags, token = records["kind"], records["flags"], records["token"]
        lone = order[starts[counts == 1]]
        lone = lone[kind[lone] == SHARD]
        is_copy = (flags[lone] & FLAG_COMMITTED) != 0
        self._committed.update(_pairs(records["key"][lone[is_copy]], row_of[lone[is_copy]]))
        pending = lone[~is_copy]
        self._pending.update(
            zip(
                zip(_keys(records["key"][pending]), token[pending].tolist(), strict=True),
                row_of[pending].tolist(),
                strict=True,
            )
        )
        first, then = order[starts[counts == 2]], order[starts[counts == 2] + 1]
        paired = (
            (kind[first] == SHARD)
            & (kind[then] == COMMIT)
            & (token[first] == token[then])
            & (records["target_lsn"][then] == records["lsn"][first])
            & (keys[first] == keys[then]).all(axis=1)
        )
        first, then = first[paired], then[paired]
        self._committed.update(_pairs(records["key"][first], row_of[first]))
        handled = np.zeros(len(records), bool)
        handled[lone] = True
        handled[order[starts[counts == 1]]] = True  # a lone COMMIT or DELETE acts on nothing
        handled[first] = handled[then] = True
        return np.flatnonzero(~handled)

    def _apply_in_order(self, records: np.ndarray, rows: np.ndarray, lsn_of_row: list[int]) -> None:
        """Apply ``records`` one by one in their (LSN) order: the rule for any history."""
        committed, pending = self._committed, self._pending
        for key, kind, flags, token, target, row in zip(
            _keys(records["key"]),
            records["kind"].tolist(),
            records["flags"].tolist(),
            records["token"].tolist(),
            records["target_lsn"].tolist(),
            rows.tolist(),
            strict=True,
        ):
            if kind == SHARD:
                if flags & FLAG_COMMITTED:
                    waiting = pending.get((key, token))
                    if waiting is not None and lsn_of_row[waiting] == lsn_of_row[row]:
                        del pending[(key, token)]
                    committed[key] = row
                else:
                    pending[(key, token)] = row
            elif kind == COMMIT:
                waiting = pending.get((key, token))
                if waiting is not None and lsn_of_row[waiting] == target:
                    committed[key] = pending.pop((key, token))
            elif kind == DELETE:
                held = committed.get(key)
                if held is not None and lsn_of_row[held] == target:
                    del committed[key]

    def _grow_to(self, rows: int) -> None:
        """At least ``rows`` rows; the new ones are free."""
        size = len(self._columns["seg"])
        if rows <= size:
            return
        for name, column in self._columns.items():
            grown = np.zeros(rows, column.dtype)
            grown[:size] = column
            self._columns[name] = grown
        self._free[:0] = range(rows - 1, size - 1, -1)  # used after the rows free already


def _keys(column: np.ndarray) -> list[bytes]:
    return [bytes(key) for key in column.tolist()]


def _pairs(keys: np.ndarray, rows: np.ndarray) -> zip[tuple[bytes, int]]:
    return zip(_keys(keys), rows.tolist(), strict=True)
