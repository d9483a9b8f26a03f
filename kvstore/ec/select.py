"""Which shards of a stripe to trust: the checks behind ``Codec.decode``, ``reconstruct`` and
``verify``, and the explanation of every refusal when a block cannot be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_digest

from kvstore.ec.shard import (
    CHECKED_FROM,
    HEADER_BYTES,
    LAYOUT,
    MAGIC,
    MAGIC_AND_INDEX,
    STRIPE_FIELDS,
    SUM,
    VERSION,
    ShardHeader,
    byte_view,
    check_shard,
    fragment_length,
)
from kvstore.errors import ECError, InvalidArgument, TooFewShards
from kvstore.keys import KEY_BYTES, BlockKey, check_key, key_hex

ShardLike = Any  # bytes | bytearray | memoryview | np.ndarray | None


@dataclass(slots=True)
class Stripe:
    """The shards of one stripe that passed every check, plus what they agree on."""

    key: BlockKey
    payload_len: int
    fragment_len: int
    shared: bytes  # header bytes STRIPE_FIELDS, the same in every shard of the stripe
    views: dict[int, memoryview]


class ShardSelector:
    """Picks shards of one stripe for a codec of geometry k+m."""

    def __init__(self, k: int, m: int) -> None:
        self.k = k
        self.m = m
        self.total = k + m

    def select(
        self,
        shards: Sequence[ShardLike],
        key: bytes | None,
        size: int | None,
        order: tuple[int, ...],
        need: int,
    ) -> Stripe:
        """``need`` shards that pass every check and agree on one stripe, taken in ``order``.

        Fast path: the first valid shard sets the stripe, every other shard must match its
        header byte for byte (except index and checksum) and hash to its checksum. If that
        does not yield enough, the slow path explains every shard and picks the largest group
        of mutually consistent ones (e.g. when the first shard was a stray from another block).
        """
        if len(shards) != self.total:
            raise InvalidArgument(
                "shards",
                f"expected {self.total} entries (k+m), got {len(shards)}; use None for missing",
            )
        if key is None:
            expected_key = None
        else:
            expected_key = key if type(key) is bytes and len(key) == KEY_BYTES else check_key(key)
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise InvalidArgument("size", f"must be an integer >= 0, got {size!r}")
        views: dict[int, memoryview] = {}
        header: tuple[BlockKey, int, int] | None = None
        shared = b""
        shard_len = 0
        for index in order:
            shard = shards[index]
            if shard is None:
                continue
            try:
                view = memoryview(shard)
            except TypeError:
                view = byte_view(shard, f"shards[{index}]")  # raises InvalidArgument
            if view.ndim != 1 or view.format != "B":
                view = byte_view(view)
            if header is None:
                header = self.first_header(view, index, expected_key, size)
                if header is None:
                    continue
                shared = view[STRIPE_FIELDS].tobytes()
                shard_len = len(view)
            else:
                # Hot loop: one copy of the header, two compares and one hash per shard.
                head = view[:HEADER_BYTES].tobytes()
                if (
                    len(view) != shard_len
                    or head[CHECKED_FROM:] != MAGIC_AND_INDEX[index] + shared
                    or head[SUM] != xxh3_64_digest(view[CHECKED_FROM:])
                ):
                    continue
            views[index] = view
            if len(views) == need:
                return Stripe(header[0], header[1], header[2], shared, views)
        return self.select_slow(shards, expected_key, size, order, need)

    def first_header(
        self,
        view: memoryview,
        index: int,
        key: bytes | None,
        size: int | None,
        hashed: bool = True,
    ) -> tuple[BlockKey, int, int] | None:
        """(key, payload_len, fragment_len) of the first shard looked at if it passes every
        check, else None.

        The same checks as ``check_shard`` without building error messages: a bad shard here is
        routine (it is skipped), and the slow path explains it if the block cannot be read.
        ``hashed=False`` skips the checksum, for callers that check the block end to end.
        """
        if len(view) < HEADER_BYTES:
            return None
        stored, magic, idx, version, k, m, payload_len, _, owner = LAYOUT.unpack_from(view)
        fragment_len = len(view) - HEADER_BYTES
        if (
            magic != MAGIC
            or idx != index
            or version != VERSION
            or k != self.k
            or m != self.m
            or fragment_len != fragment_length(payload_len, k)
            or (key is not None and owner != key)
            or (size is not None and payload_len != size)
            or (hashed and stored != xxh3_64_digest(view[CHECKED_FROM:]))
        ):
            return None
        return BlockKey(owner), payload_len, fragment_len

    def check(
        self, view: memoryview, index: int, key: bytes | None, size: int | None
    ) -> ShardHeader:
        return check_shard(view, key=key, index=index, k=self.k, m=self.m, payload_len=size)

    def select_slow(
        self,
        shards: Sequence[ShardLike],
        key: bytes | None,
        size: int | None,
        order: tuple[int, ...],
        need: int,
        keep_all: bool = False,
    ) -> Stripe:
        """Check every shard, explain each refusal, and take the largest group of shards that
        agree on one stripe: ``need`` of them (all of them with ``keep_all``), in ``order``."""
        reasons: dict[int, str] = {}
        groups: dict[bytes, list[tuple[int, memoryview, ShardHeader]]] = {}
        for index in range(self.total):
            shard = shards[index]
            if shard is None:
                reasons[index] = "missing"
                continue
            view = byte_view(shard, f"shards[{index}]")
            try:
                header = self.check(view, index, key, size)
            except ECError as error:
                reasons[index] = str(error)
                continue
            groups.setdefault(bytes(view[STRIPE_FIELDS]), []).append((index, view, header))
        best: list[tuple[int, memoryview, ShardHeader]] = []
        for members in groups.values():
            if len(members) > len(best):
                best = members
        for members in groups.values():
            if members is not best:
                for index, _, header in members:
                    reasons[index] = (
                        f"shard {index} belongs to another stripe (block {key_hex(header.key)}, "
                        f"{header.payload_len} bytes)"
                    )
        block = key if key is not None else (best[0][2].key if best else None)
        if len(best) < need:
            explained = "; ".join(f"[{i}] {reasons[i]}" for i in sorted(reasons))
            raise TooFewShards(
                f"block {key_hex(block) if block is not None else '(unknown)'}: "
                f"{len(best)} usable shards of {self.total}, need {need} ({explained})"
            )
        members_by_index = {index: (view, header) for index, view, header in best}
        views = {i: members_by_index[i][0] for i in order if i in members_by_index}
        if not keep_all:
            views = dict(list(views.items())[:need])
        first = best[0][2]
        return Stripe(
            first.key,
            first.payload_len,
            first.fragment_len,
            bytes(best[0][1][STRIPE_FIELDS]),
            views,
        )
