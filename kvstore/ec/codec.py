"""``Codec``: systematic Reed-Solomon k+m over GF(2^8) with self-describing, checksummed shards.

Shaped like klauspost/reedsolomon: ``encode`` splits a block into k+m shards, ``decode`` takes
k+m entries with ``None`` for a missing shard, ``reconstruct`` rebuilds chosen shards for repair,
``verify`` checks a full stripe. Differences that follow from shards living on other machines:
each shard carries a header (``shard.py``), a shard that fails any check is treated as missing,
and a block comes back bit-exact or not at all (``TooFewShards``), never as wrong bytes.

Speed (every Block KVCache byte passes here on write, degraded read and repair): a stripe is one
(k+m) x (64 + F) numpy array, the payload is copied into it once, ISA-L writes parity straight
into it, headers are written for all rows by broadcasting, and each shard is hashed with one
xxh3 call over one contiguous range. The usual decode (whole fragments, the first k shards
present are good) compares each header with one slice compare, joins the data fragments into
the result with one ``join``, lets ISA-L write lost fragments straight into it, and checks the
block against its payload hash with one xxh3 call; any surprise falls back to a general path
that checks every shard's own checksum and explains each refusal. No Python loop touches
individual bytes.

Measured (benchmarks/ec.py, one core, 10+2, 2 data shards lost, quiet machine): encode /
decode ~5.9-6.1 / ~6.8-7.3 GB/s at a 111 KiB block (5.3x / 6x zfec), ~11.4 / ~14-16 GB/s at
1.35 MiB (10x / 12-14x), ~5.3 / ~6.5-7 GB/s at 16 MiB (5.4x / 6.6-7.4x; memory-bound: one
payload hash, one copy, parity, k+m checksums). At 111 KiB about half the time is Python-level
per-call work (~35 operations, a view, a slice, a hash call per shard), which is why the hot
paths here are written the way they are. Under heavy machine load this code loses more than
zfec's C loops do (cache pollution), so the 111 KiB and 16 MiB encode margins shrink to ~5x.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

# shard.checksum (xxh3-64, canonical bytes) is called as xxh3_64_digest directly in hot loops.
from xxhash import xxh3_64_digest

from kvstore.ec.backends import IsalBackend, PyeclibBackend, load_backend, pointer_table
from kvstore.ec.buffers import (
    WRITABLE_BYTES,
    address,
    bytes_address,
    fresh_bytes,
    payload_array,
)
from kvstore.ec.select import ShardLike, ShardSelector, Stripe
from kvstore.ec.shard import (
    HEADER_BYTES,
    INDEX_OFFSET,
    MAGIC_AND_INDEX,
    MAX_FRAGMENT_BYTES,
    MAX_SHARDS,
    PAYLOAD_HASH,
    STRIPE_FIELDS,
    SUM,
    fragment_length,
    header_bytes,
    row_sums,
)
from kvstore.errors import ConfigError, ECError, InvalidArgument, TooFewShards
from kvstore.keys import KEY_BYTES, check_key, key_hex

#: Where the payload hash sits within the shared header fields (``Stripe.shared``).
_SHARED_PAYLOAD_HASH = slice(
    PAYLOAD_HASH.start - STRIPE_FIELDS.start, PAYLOAD_HASH.stop - STRIPE_FIELDS.start
)
#: Decode tables are cached per loss pattern; C(12, 10) = 66 patterns for 10+2, so this bound
#: only matters for wide codes.
_MAX_CACHED_TABLES = 512
#: From this fragment size up, ISA-L reads surviving fragments where they lie (an address lookup
#: per shard, ~1 us) instead of from one gathered copy (a memcpy of the block); below it the
#: copy is cheaper.
_DIRECT_SOURCES_BYTES = 32 * 1024
_POINTER_BYTES = ctypes.sizeof(ctypes.c_void_p)
_ALIGN = 64


class Codec:
    """Erasure codec k+m (default 10+2): any m shards may be lost, the block still comes back.

    Thread-safe: calls share no mutable state but a bounded cache of decode tables.
    """

    def __init__(self, k: int = 10, m: int = 2, backend: str = "auto") -> None:
        for name, value in (("k", k), ("m", m)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if k + m > MAX_SHARDS:
            raise ConfigError("m", f"k + m must be at most {MAX_SHARDS}, got {k} + {m}")
        self.k = k
        self.m = m
        self._requested_backend = backend
        self._backend = load_backend(k, m, backend)
        self._isal = self._backend if isinstance(self._backend, IsalBackend) else None
        self._indices = np.arange(k + m, dtype=np.uint8)
        self._tables: dict[tuple[tuple[int, ...], tuple[int, ...]], ctypes.Array[Any]] = {}
        # Decode fast path: sources -> (lost data rows, their tables). At most C(k+m, k)
        # entries (66 for 10+2), all bounded by the table cache's own bound.
        self._plans: dict[tuple[int, ...], tuple[tuple[int, ...], ctypes.Array[Any]]] = {}
        self._data_first = tuple(range(k + m))
        self._selector = ShardSelector(k, m)
        self._pointer_tables: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    @property
    def backend(self) -> str:
        """``isal`` (ISA-L called directly) or ``pyeclib`` (the fallback)."""
        return self._backend.name

    @property
    def total(self) -> int:
        """k + m, the number of shards of a stripe."""
        return self.k + self.m

    def __repr__(self) -> str:
        return f"Codec(k={self.k}, m={self.m}, backend={self.backend!r})"

    def __reduce__(self) -> tuple[type[Codec], tuple[int, int, str]]:
        # The ctypes handles do not pickle; a Codec shipped to a Ray actor is rebuilt there.
        return (Codec, (self.k, self.m, self._requested_backend))

    def shard_length(self, payload_len: int) -> int:
        """Bytes of each shard (header + fragment) for a block of ``payload_len`` bytes."""
        return HEADER_BYTES + fragment_length(payload_len, self.k)

    # --- encode ------------------------------------------------------------------------------

    def encode(self, payload: object, key: bytes) -> list[np.ndarray]:
        """Split ``payload`` into k data + m parity shards, each ``header + fragment``.

        Returns k+m uint8 arrays (rows of one stripe array, so Ray ships each zero-copy; copy
        one if you keep it alone for long, or it pins the whole stripe).
        """
        block = key if type(key) is bytes and len(key) == KEY_BYTES else check_key(key, "key")
        whole: bytes | memoryview
        if type(payload) is bytes:
            data, whole = np.frombuffer(payload, dtype=np.uint8), payload
        else:
            data = payload_array(payload)
            whole = data.data
        k, total = self.k, self.k + self.m
        size = data.size
        fragment_len = fragment_length(size, k)
        if fragment_len > MAX_FRAGMENT_BYTES:
            raise InvalidArgument(
                "payload", f"{size} bytes is too large for k={k} (fragments over 2 GiB)"
            )
        row_len = HEADER_BYTES + fragment_len
        # 64-byte aligned rows: ISA-L's AVX-512 loops run 20-30% slower on the 16-byte
        # alignment malloc gives (measured), for the price of one address lookup we need anyway.
        raw = np.empty(total * row_len + _ALIGN - 1, dtype=np.uint8)
        address = ctypes.addressof(ctypes.c_char.from_buffer(raw.data))
        shift = -address % _ALIGN
        stripe = raw[shift : shift + total * row_len].reshape(total, row_len)
        # Hash the payload before copying it: the copy then reads it back from cache.
        header = header_bytes(block, 0, k, self.m, size, xxh3_64_digest(whole))
        if size == k * fragment_len:  # the usual case: KV blocks are multiples of 64 * k
            stripe[:k, HEADER_BYTES:] = data.reshape(k, fragment_len)
        else:
            self._fill_data(stripe, data, fragment_len)
        if self._isal is not None:
            sources, targets = self._encode_pointers(address + shift + HEADER_BYTES, row_len)
            self._isal.run(self._isal.encode_tables, self.m, fragment_len, sources, targets)
        else:
            self._backend.encode(stripe, HEADER_BYTES, fragment_len)
        self._write_headers(stripe, header, self._indices)
        return list(stripe)

    def encode_many(
        self, payloads: Sequence[object], keys: Sequence[bytes]
    ) -> list[list[np.ndarray]]:
        """``[self.encode(p, key) for p, key in zip(payloads, keys)]``, the same bytes: where
        the blocks share a size, rows of one ``encode_rows`` array (a shard kept alone for long
        pins the batch)."""
        rows = self.encode_rows(payloads, keys)
        if rows is None:
            return [self.encode(p, key) for p, key in zip(payloads, keys, strict=True)]
        return [list(stripe) for stripe in rows.reshape(len(keys), self.total, -1)]

    def encode_rows(
        self, payloads: Sequence[object], keys: Sequence[bytes], rank: np.ndarray | None = None
    ) -> np.ndarray | None:
        """Every shard of a batch of blocks of one size as the rows of one 64-byte aligned
        (n * (k+m), shard) array: shard i of block b in row ``rank[b, i]`` (by default
        ``b * (k+m) + i``, each stripe's rows end to end). The same bytes as ``encode``, with
        the per-block steps done once a batch: headers written at once, one pointer table, one
        checksum pass; only the data copy and ISA-L's parity run a block at a time. A writer
        ranks the rows by the node each goes to, so each node's shards are one slice of the
        array, sent as it is. None where the batch cannot be one array (blocks of several
        sizes, or no ISA-L): ``encode`` them one by one."""
        if len(payloads) != len(keys):
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {len(keys)} keys")
        datas = [
            np.frombuffer(p, dtype=np.uint8) if type(p) is bytes else payload_array(p)
            for p in payloads
        ]
        size = datas[0].size if datas else 0
        if self._isal is None or len(datas) < 2 or any(d.size != size for d in datas):
            return None
        blocks = [
            key if type(key) is bytes and len(key) == KEY_BYTES else check_key(key, "key")
            for key in keys
        ]
        n, k, total = len(datas), self.k, self.k + self.m
        if rank is None:
            rank = np.arange(n * total).reshape(n, total)
        elif rank.shape != (n, total) or not np.array_equal(
            np.sort(rank, axis=None), np.arange(n * total)
        ):
            raise InvalidArgument("rank", f"must place each of the {n * total} shards in a row")
        fragment_len = fragment_length(size, k)
        if fragment_len > MAX_FRAGMENT_BYTES:
            raise InvalidArgument(
                "payload", f"{size} bytes is too large for k={k} (fragments over 2 GiB)"
            )
        row_len = HEADER_BYTES + fragment_len
        raw = np.empty(n * total * row_len + _ALIGN - 1, dtype=np.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(raw.data))
        shift = -base % _ALIGN
        rows = raw[shift : shift + n * total * row_len].reshape(n * total, row_len)
        # Every shard's fragment, in (block, index) order: block b's k sources then m targets.
        first = np.uintp(base + shift + HEADER_BYTES)
        table = (first + rank.reshape(-1).astype(np.uintp) * np.uintp(row_len)).tobytes()
        step, data_bytes = total * _POINTER_BYTES, k * _POINTER_BYTES
        # Each payload is copied once, straight into its rows: its ``full`` whole fragments,
        # then the ``rest`` of its bytes into the next one, whose tail (and any data fragment
        # after it) is the zero padding, written for the whole batch at once.
        full, rest = divmod(size, fragment_len)
        cut = full * fragment_len
        if full < k:
            rows[rank[:, full], HEADER_BYTES + rest :] = 0
            rows[rank[:, full + 1 : k].reshape(-1), HEADER_BYTES:] = 0
        headers = []
        for b, data in enumerate(datas):
            # Hash the payload before copying it: the copy then reads it back from cache.
            payload = payloads[b]
            whole: bytes | memoryview = payload if type(payload) is bytes else data.data
            headers.append(header_bytes(blocks[b], 0, k, self.m, size, xxh3_64_digest(whole)))
            rows[rank[b, :full], HEADER_BYTES:] = data[:cut].reshape(full, fragment_len)
            if rest:
                rows[rank[b, full], HEADER_BYTES : HEADER_BYTES + rest] = data[cut:]
            sources = table[b * step : (b + 1) * step]
            self._isal.run(
                self._isal.encode_tables, self.m, fragment_len, sources, sources[data_bytes:]
            )
        rows[rank, :HEADER_BYTES] = np.frombuffer(b"".join(headers), np.uint8).reshape(
            n, 1, HEADER_BYTES
        )
        rows[rank, INDEX_OFFSET] = self._indices
        rows[:, SUM] = np.frombuffer(row_sums(rows), np.uint8).reshape(n * total, 8)
        return rows

    def _encode_pointers(self, first: int, row_len: int) -> tuple[bytes, bytes]:
        """ISA-L pointer tables of a stripe whose first fragment is at ``first``: the k data
        fragments, and the m parity ones. Memoised (bounded): malloc tends to hand back the
        same address for the same size, and building them costs ~0.5 us a call."""
        tables = self._pointer_tables.get((first, row_len))
        if tables is None:
            table = pointer_table(first, self.k + self.m, row_len)
            tables = (table, table[self.k * _POINTER_BYTES :])
            if len(self._pointer_tables) >= 16:
                self._pointer_tables.clear()
            self._pointer_tables[(first, row_len)] = tables
        return tables

    def _fill_data(self, stripe: np.ndarray, data: np.ndarray, fragment_len: int) -> None:
        """Data rows of ``stripe`` for a payload that does not fill all k fragments."""
        k, size = self.k, data.size
        full = size // fragment_len
        if full:
            stripe[:full, HEADER_BYTES:] = data[: full * fragment_len].reshape(full, fragment_len)
        if full < k:
            rest = size - full * fragment_len
            stripe[full, HEADER_BYTES : HEADER_BYTES + rest] = data[full * fragment_len :]
            stripe[full, HEADER_BYTES + rest :] = 0
            stripe[full + 1 : k, HEADER_BYTES:] = 0

    @staticmethod
    def _write_headers(stripe: np.ndarray, header: bytes, indices: np.ndarray) -> None:
        """Write ``header`` to every row with its own index, then each row's checksum."""
        stripe[:, :HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
        stripe[:, INDEX_OFFSET] = indices
        stripe[:, SUM] = np.frombuffer(row_sums(stripe), dtype=np.uint8).reshape(len(stripe), 8)

    # --- decode ------------------------------------------------------------------------------

    def decode(
        self, shards: Sequence[ShardLike], size: int | None = None, key: bytes | None = None
    ) -> bytes:
        """The block, bit-exact, from any k valid shards of ``shards`` (None = missing).

        A shard that fails its header, length or checksum check, or does not match ``key``,
        its position or this codec's k/m, is treated as missing. ``size`` (optional) is the
        expected payload length. Raises ``TooFewShards`` naming the block and every unusable
        shard when fewer than k remain.
        """
        if self._isal is not None and WRITABLE_BYTES:
            fast = self._decode_whole_rows(shards, size, key)
            if fast is not None:
                return fast
        stripe = self._selector.select(shards, key, size, self._data_first, self.k)
        block = self._assemble(stripe)
        if _matches_payload_hash(stripe, block):
            return block
        return self._decode_any_subset(shards, key, size)

    def _assemble(self, stripe: Stripe) -> bytes:
        """The block from the k shards of ``stripe`` (not yet checked end to end)."""
        missing = _missing_data_rows(stripe)
        if not missing or self._isal is None:
            return b"".join(self._payload_pieces(stripe, missing))
        out, window = fresh_bytes(stripe.payload_len)
        self._decode_in_place(stripe, missing, window)
        return out if isinstance(out, bytes) else bytes(out)

    def _decode_any_subset(
        self, shards: Sequence[ShardLike], key: bytes | None, size: int | None
    ) -> bytes:
        """Last resort when k shards that each pass their checksum do not decode to the payload
        hash they carry (a writer that checksummed wrong bytes): try every other k of the valid
        shards, and if none decodes to that hash, it is a miss. Never wrong bytes."""
        group = self._selector.select_slow(
            shards, key, size, self._data_first, self.k, keep_all=True
        )
        for chosen in itertools.combinations(sorted(group.views), self.k):
            candidate = replace(group, views={i: group.views[i] for i in chosen})
            block = self._assemble(candidate)
            if _matches_payload_hash(candidate, block):
                return block
        raise TooFewShards(
            f"block {key_hex(group.key)}: no {self.k} of the {len(group.views)} shards that pass "
            "their checksums decode to the payload hash they carry (a writer checksummed wrong "
            "bytes)"
        )

    def _decode_whole_rows(
        self, shards: Sequence[ShardLike], size: int | None, key: bytes | None
    ) -> bytes | None:
        """``decode`` in one pass for the usual case, or None to take the general path.

        The usual case: the payload fills all k data fragments (KV blocks are multiples of
        64 * k bytes) and the first k shards present are good. One ``join`` copies the data
        fragments into the result (a placeholder row where one is lost), ISA-L writes lost
        fragments over the placeholders, into the new ``bytes`` before anyone else holds it,
        and the result must hash to the payload hash of the first shard's header, itself checked
        against this codec, ``key`` and ``size``. That one check stands for all the per-shard
        ones: a damaged, misplaced or foreign shard changes the result, and a wrong first
        header names a hash the result does not have. Shards are only checked for length here
        (what memory safety needs). Anything unusual returns None and the general path, which
        checks and explains every shard, decides.
        """
        rows = self._whole_rows(shards, size, key)
        if rows is None:
            return None
        data, parity, sources, fragment_len, payload_hash = rows
        if not parity:
            out = b"".join(data)  # type: ignore[arg-type]
            return out if xxh3_64_digest(out) == payload_hash else None
        filler = parity[0]  # any k-th row will do: ISA-L overwrites it
        out = b"".join([row if row is not None else filler for row in data])
        self._rebuild_rows(bytes_address(out), data, parity, sources, fragment_len)
        return out if xxh3_64_digest(out) == payload_hash else None

    def _decode_whole_rows_into(
        self, shards: Sequence[ShardLike], size: int | None, key: bytes | None, window: memoryview
    ) -> int | None:
        """``_decode_whole_rows`` writing into ``window`` (writable, flat): the data fragments
        are copied into their place, ISA-L rebuilds lost ones there. Returns the payload length,
        or None (``window`` then holds unverified bytes) to take the general path."""
        rows = self._whole_rows(shards, size, key)
        if rows is None:
            return None
        data, parity, sources, fragment_len, payload_hash = rows
        length = self.k * fragment_len
        if len(window) < length:
            return None
        for row, fragment in enumerate(data):
            if fragment is not None:
                window[row * fragment_len : (row + 1) * fragment_len] = fragment
        if parity:
            base = ctypes.addressof(ctypes.c_char.from_buffer(window))
            self._rebuild_rows(base, data, parity, sources, fragment_len)
        return length if xxh3_64_digest(window[:length]) == payload_hash else None

    def _whole_rows(
        self, shards: Sequence[ShardLike], size: int | None, key: bytes | None
    ) -> tuple[list[memoryview | None], list[memoryview], list[int], int, bytes] | None:
        """The first k shards present, for the whole-rows fast path: (data fragments with None
        where lost, parity fragments, their stripe indices, fragment length, payload hash of
        the first shard's checked header), or None when the case is not the usual one."""
        k = self.k
        if (
            self._isal is None
            or k < 2  # join of one piece may return that very object: never write into it
            or len(shards) != k + self.m
            or (key is not None and type(key) is not bytes)
            or (size is not None and type(size) is not int)
        ):
            return None
        payload_hash = b""
        shard_len = fragment_len = 0
        data: list[memoryview | None] = [None] * k
        parity: list[memoryview] = []
        sources: list[int] = []
        for index, shard in enumerate(shards):
            if shard is None:
                continue
            try:
                view = memoryview(shard)
            except TypeError:
                return None
            if view.ndim != 1 or view.format != "B":
                return None
            if not sources:
                header = self._selector.first_header(view, index, key, size, hashed=False)
                if header is None or header[1] != k * header[2]:
                    return None
                fragment_len, shard_len = header[2], len(view)
                payload_hash = view[PAYLOAD_HASH].tobytes()
            elif len(view) != shard_len:  # the one check memory safety needs
                return None
            sources.append(index)
            if index < k:
                data[index] = view[HEADER_BYTES:]
            else:
                parity.append(view[HEADER_BYTES:])
            if len(sources) == k:
                return data, parity, sources, fragment_len, payload_hash
        return None  # fewer than k shards: the general path names what is missing

    def _rebuild_rows(
        self,
        base: int,
        data: list[memoryview | None],
        parity: list[memoryview],
        sources: list[int],
        fragment_len: int,
    ) -> None:
        """ISA-L: the lost data rows of the k data rows at ``base`` (present ones already in
        place), from those and ``parity``."""
        assert self._isal is not None
        k = self.k
        plan = self._plans.get(tuple(sources))
        if plan is None:
            missing = tuple([row for row in range(k) if data[row] is None])
            plan = (missing, self._decode_tables(tuple(sources), missing))
            self._plans[tuple(sources)] = plan
        missing, tables = plan
        parity_pointers, _keep = _row_pointers(parity, fragment_len)
        table = struct.pack(
            f"{k + len(missing)}P",
            *[base + row * fragment_len for row in sources[: k - len(parity)]],
            *parity_pointers,
            *[base + row * fragment_len for row in missing],
        )
        self._isal.run(tables, len(missing), fragment_len, table, table[k * _POINTER_BYTES :])

    def decode_into(
        self,
        shards: Sequence[ShardLike],
        out: object,
        size: int | None = None,
        key: bytes | None = None,
    ) -> int:
        """Like ``decode`` but writes the block into the writable buffer ``out``; returns its
        length. Saves the final copy when the bytes go to a staging buffer anyway."""
        try:
            target = memoryview(out)  # type: ignore[arg-type]
            if target.format != "B" or target.ndim != 1:
                target = target.cast("B")
        except TypeError as error:
            raise InvalidArgument("out", f"must be a contiguous buffer ({error})") from None
        if target.readonly:
            raise InvalidArgument("out", "must be a writable buffer")
        fast = self._decode_whole_rows_into(shards, size, key, target)
        if fast is not None:
            return fast
        stripe = self._selector.select(shards, key, size, self._data_first, self.k)
        if len(target) < stripe.payload_len:
            raise InvalidArgument(
                "out", f"holds {len(target)} bytes, block has {stripe.payload_len}"
            )
        missing = _missing_data_rows(stripe)
        window = target[: stripe.payload_len]
        if missing and self._isal is not None:
            self._decode_in_place(stripe, missing, window)
        else:
            position = 0
            for piece in self._payload_pieces(stripe, missing):
                window[position : position + len(piece)] = piece
                position += len(piece)
        if not _matches_payload_hash(stripe, window):
            window[:] = self._decode_any_subset(shards, key, size)
        return stripe.payload_len

    def _payload_pieces(self, stripe: Stripe, missing: tuple[int, ...]) -> list[memoryview]:
        """Views that concatenate to the payload: data fragments as stored, rebuilt ones."""
        size, fragment_len, views = stripe.payload_len, stripe.fragment_len, stripe.views
        data_rows = -(-size // fragment_len)  # rows past this hold only padding
        if not missing:
            last = size - (data_rows - 1) * fragment_len
            pieces = [views[row][HEADER_BYTES:] for row in range(data_rows - 1)]
            if data_rows:
                pieces.append(views[data_rows - 1][HEADER_BYTES : HEADER_BYTES + last])
            return pieces
        rebuilt = self._rebuild(stripe, missing)
        pieces = []
        for row in range(data_rows):
            length = min(fragment_len, size - row * fragment_len)
            view = views.get(row)
            if view is not None:
                pieces.append(view[HEADER_BYTES : HEADER_BYTES + length])
            else:
                start = missing.index(row) * fragment_len
                pieces.append(rebuilt[start : start + length])
        return pieces

    def _decode_in_place(
        self, stripe: Stripe, missing: tuple[int, ...], window: memoryview
    ) -> None:
        """Write the payload into ``window`` (writable, payload_len bytes), ISA-L rebuilding the
        ``missing`` data fragments straight into their place.

        Data fragments that are present are copied in first and ISA-L reads them back from
        there, so each payload byte is copied once. The other sources (parity, a partial or
        padding data row) are gathered into a scratch buffer when small (a read-only shard has
        no cheap address: one copy beats k lookups) or read in place when large; a lost partial
        last row is rebuilt whole into a spare row and its head copied.
        """
        assert self._isal is not None
        size, fragment_len, views = stripe.payload_len, stripe.fragment_len, stripe.views
        full = size // fragment_len  # data rows wholly inside the payload
        sources = sorted(views)  # exactly k: data rows first, then parity
        direct = 0  # sources[:direct] are whole data rows, read back from the window
        for index in sources:
            if index >= full:
                break
            start = index * fragment_len
            window[start : start + fragment_len] = views[index][HEADER_BYTES:]
            direct += 1
        rest = size - full * fragment_len  # bytes of a partial last data row
        if rest and full in views:
            window[full * fragment_len :] = views[full][HEADER_BYTES : HEADER_BYTES + rest]
        others, _keep = _row_pointers(
            [views[index][HEADER_BYTES:] for index in sources[direct:]], fragment_len
        )
        # A lost partial last row is rebuilt whole into a spare row, then its head copied.
        partial_missing = rest > 0 and missing[-1] == full
        spare = np.empty(fragment_len if partial_missing else 1, dtype=np.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(window))
        table = struct.pack(
            f"{len(sources) + len(missing)}P",
            *[base + index * fragment_len for index in sources[:direct]],
            *others,
            *[base + row * fragment_len for row in missing[: len(missing) - partial_missing]],
            *([ctypes.addressof(ctypes.c_char.from_buffer(spare.data))] if partial_missing else []),
        )
        self._isal.run(
            self._decode_tables(tuple(sources), missing),
            len(missing),
            fragment_len,
            table,
            table[self.k * _POINTER_BYTES :],
        )
        if partial_missing:
            window[full * fragment_len :] = spare.data[:rest]

    def _rebuild(self, stripe: Stripe, wanted: tuple[int, ...]) -> memoryview:
        """Fragments ``wanted`` rebuilt from k selected shards, back to back in that order."""
        k = self.k
        sources = tuple(sorted(stripe.views))[:k]
        fragment_len = stripe.fragment_len
        views = stripe.views
        if self._isal is None:
            assert isinstance(self._backend, PyeclibBackend)
            work = bytearray().join(
                [views[i][HEADER_BYTES:] for i in sources] + [bytes(len(wanted) * fragment_len)]
            )
            self._backend.rebuild(sources, wanted, work, fragment_len)
            return memoryview(work)[k * fragment_len :]
        tables = self._decode_tables(sources, wanted)
        if fragment_len >= _DIRECT_SOURCES_BYTES:
            out = np.empty(len(wanted) * fragment_len, dtype=np.uint8)
            targets = pointer_table(address(out), len(wanted), fragment_len)
            source_pointers = np.array(
                [address(views[i]) + HEADER_BYTES for i in sources], dtype=np.uintp
            ).tobytes()
            self._isal.run(tables, len(wanted), fragment_len, source_pointers, targets)
            return out.data
        # Small fragments: one join gathers the sources (from any buffer type) into rows ISA-L
        # addresses by arithmetic, and leaves the rows it writes, for the price of one address
        # lookup instead of k.
        work = bytearray().join(
            [views[i][HEADER_BYTES:] for i in sources] + [bytes(len(wanted) * fragment_len)]
        )
        pointers = pointer_table(
            ctypes.addressof(ctypes.c_char.from_buffer(work)), k + len(wanted), fragment_len
        )
        self._isal.run(
            tables,
            len(wanted),
            fragment_len,
            pointers,
            pointers[k * ctypes.sizeof(ctypes.c_void_p) :],
        )
        return memoryview(work)[k * fragment_len :]

    def _decode_tables(
        self, sources: tuple[int, ...], wanted: tuple[int, ...]
    ) -> ctypes.Array[Any]:
        """ISA-L tables rebuilding ``wanted`` from ``sources`` (both ascending), cached."""
        assert self._isal is not None
        pattern = (sources, wanted)
        tables = self._tables.get(pattern)
        if tables is None:
            tables = self._isal.decode_tables(sources, wanted)
            if len(self._tables) >= _MAX_CACHED_TABLES:
                self._tables.clear()
                self._plans.clear()
            self._tables[pattern] = tables
        return tables

    def rebuild_in_place(
        self, block: np.ndarray, present: Iterable[int], parity: dict[int, np.ndarray]
    ) -> bool:
        """ISA-L: rebuild the data rows ``block`` (a writable payload, fragment_length apart,
        the last one maybe partial) lacks, straight into their place, from the rows
        ``present`` there and the ``parity`` fragments (index -> fragment_length bytes).
        False, with nothing written, when the sources are fewer than k or ISA-L is not here.
        The caller checks the payload hash: nothing here proves the sources are one write."""
        k, size = self.k, len(block)
        if self._isal is None or not size:
            return False
        fragment_len = fragment_length(size, k)
        full, rest = divmod(size, fragment_len)  # whole rows, bytes of a partial last one
        rows = full + (rest > 0)  # rows past these hold only padding: zeros, never read
        have = set(present)
        missing = tuple([row for row in range(rows) if row not in have])
        if not missing:
            return True
        sources = tuple([*sorted(have | set(range(rows, k))), *sorted(parity)][:k])
        if len(sources) < k:
            return False
        if any(len(parity[row]) != fragment_len for row in sources if row >= k):
            raise InvalidArgument("parity", f"fragments must be {fragment_len} bytes")
        # Padding rows, a present partial row (padded) and a lost partial row (rebuilt whole,
        # then its head copied) are rows of ``spare``: 0 zeros, 1 the partial source, 2 out.
        spare = np.zeros((3, fragment_len), np.uint8)
        if rest and full in have:
            spare[1, :rest] = block[full * fragment_len :]
        base, rows_at = address(block), address(spare)

        def at(row: int) -> int:
            if row >= k:
                return address(parity[row])
            if row < full:
                return base + row * fragment_len
            return rows_at + (fragment_len if row == full and rest else 0)

        out = rows_at + 2 * fragment_len
        table = struct.pack(
            f"{k + len(missing)}P",
            *map(at, sources),
            *[base + row * fragment_len if row < full else out for row in missing],
        )
        self._isal.run(
            self._decode_tables(sources, missing),
            len(missing),
            fragment_len,
            table,
            table[k * _POINTER_BYTES :],
        )
        if rest and full in missing:
            block[full * fragment_len :] = spare[2, :rest]
        return True

    # --- repair and scrub --------------------------------------------------------------------

    def reconstruct(
        self, shards: Sequence[ShardLike], wanted_indices: Iterable[int], key: bytes | None = None
    ) -> dict[int, np.ndarray]:
        """Rebuild the whole shards (header + fragment) at ``wanted_indices`` for repair.

        Sources are any k valid shards, preferring ones not asked for. Raises ``TooFewShards``
        when fewer than k are valid, ``InvalidArgument`` for an index outside 0..k+m-1.
        """
        wanted = self._wanted(wanted_indices)
        if not wanted:
            return {}
        preferred = [i for i in range(self.total) if i not in wanted]
        stripe = self._selector.select(shards, key, None, tuple(preferred) + wanted, self.k)
        fragment_len = stripe.fragment_len
        out = np.empty((len(wanted), HEADER_BYTES + fragment_len), dtype=np.uint8)
        to_build = tuple(i for i in wanted if i not in stripe.views)
        rebuilt = self._rebuild(stripe, to_build) if to_build else None
        for row, index in enumerate(wanted):
            view = stripe.views.get(index)
            if view is None:
                assert rebuilt is not None
                source, offset = rebuilt, to_build.index(index) * fragment_len
            else:  # a valid shard that was asked for: same bytes, freshly headed
                source, offset = view, HEADER_BYTES
            out[row, HEADER_BYTES:] = np.frombuffer(
                source, dtype=np.uint8, count=fragment_len, offset=offset
            )
        header = bytes(8) + MAGIC_AND_INDEX[0] + stripe.shared
        self._write_headers(out, header, np.asarray(wanted, dtype=np.uint8))
        return {index: out[row] for row, index in enumerate(wanted)}

    def _wanted(self, wanted_indices: Iterable[int]) -> tuple[int, ...]:
        try:
            indices = list(wanted_indices)
        except TypeError:
            raise InvalidArgument(
                "wanted_indices",
                f"must be an iterable of ints, got {type(wanted_indices).__name__}",
            ) from None
        for index in indices:
            if not isinstance(index, int | np.integer) or isinstance(index, bool):
                raise InvalidArgument("wanted_indices", f"must be ints, got {index!r}")
            if not 0 <= index < self.total:
                raise InvalidArgument(
                    "wanted_indices", f"index {index} outside 0..{self.total - 1}"
                )
        return tuple(sorted({int(i) for i in indices}))

    def verify(self, shards: Sequence[ShardLike], key: bytes | None = None) -> bool:
        """True when all k+m shards are present and valid, of one stripe, and parity matches
        the data (so the stripe can lose any m shards). A scrub's question, so never raises
        for bad shards, only for bad arguments."""
        if len(shards) != self.total:
            raise InvalidArgument(
                "shards", f"expected {self.total} entries (k+m), got {len(shards)}"
            )
        if any(shard is None for shard in shards):
            return False
        try:
            stripe = self._selector.select(shards, key, None, self._data_first, self.total)
        except TooFewShards:
            return False
        fragment_len, size, k = stripe.fragment_len, stripe.payload_len, self.k
        fragments = np.empty((self.total, fragment_len), dtype=np.uint8)
        for index, view in stripe.views.items():
            fragments[index] = np.frombuffer(
                view, dtype=np.uint8, count=fragment_len, offset=HEADER_BYTES
            )
        stored_parity = fragments[k:].copy()
        # Padding after the payload is zero when written by encode, and the payload hashes to
        # what every header says; anything else is a foreign or broken writer even if each
        # shard's own checksum passes.
        payload = fragments[:k].reshape(-1)
        if payload[size:].any():
            return False
        if xxh3_64_digest(payload[:size].data) != stripe.views[0][PAYLOAD_HASH]:
            return False
        self._backend.encode(fragments, 0, fragment_len)
        return bool(np.array_equal(fragments[k:], stored_parity))


def _row_pointers(rows: list[memoryview], fragment_len: int) -> tuple[list[int], object]:
    """Addresses of fragment ``rows`` for ISA-L, and the object that keeps them valid.

    Small fragments are gathered into one scratch buffer (one copy costs less than an address
    lookup per row); large ones are read where they lie.
    """
    if not rows:
        return [], None
    if fragment_len >= _DIRECT_SOURCES_BYTES:
        return [address(row) for row in rows], rows
    scratch = bytearray().join(rows)
    base = ctypes.addressof(ctypes.c_char.from_buffer(scratch))
    return list(range(base, base + len(scratch), fragment_len)), scratch


def _matches_payload_hash(stripe: Stripe, block: bytes | memoryview) -> bool:
    """Whether the decoded block hashes to the payload hash its shards carry."""
    return xxh3_64_digest(block) == stripe.shared[_SHARED_PAYLOAD_HASH]


def _missing_data_rows(stripe: Stripe) -> tuple[int, ...]:
    """Data rows that hold payload bytes but have no valid shard (padding rows never matter)."""
    data_rows = -(-stripe.payload_len // stripe.fragment_len)
    return tuple([row for row in range(data_rows) if row not in stripe.views])


__all__ = ["Codec", "ECError"]
