"""``DirectReader``: an engine reads its lease's blocks straight from the storage nodes, into
its own buffer.

The gateway path relays every byte (node → gateway → gRPC → engine, ~7 copies). Here the
engine's fetcher asks each node's engine read socket (``readserver``) for the shards the lease's
read capability names there (``capability``), and the shard bytes land where the block goes:
the reply of a node is received with ``recvmsg`` straight into the caller's buffer, each data
shard's fragment at its place in its block (or cut at the layer boundaries it crosses, for a
layer-major staging region: ``Spread``), its 64-byte header (after the reply's prefix, skipped)
into a small table beside; the pieces are named by arrays (``readlinks.Scatter``), with no
``bytes`` or memoryview per block or shard. Importable without Ray or any server module.

**Order.** Every request goes out at once and the replies of all nodes are taken as their
bytes arrive, a turn of each ready node at a time (``readlinks.NodeLinks.exchange``). Where
every byte of each usual reply goes (each shard asked served whole) is worked out before the
requests leave (``_Plan``), so those replies are taken in one C call for all nodes; a reply
that is not the usual one goes on in Python from its status table. A reader
that hands bytes on as they arrive (``on_prefix``) asks each node for its data shards stripe
position by position: position 0 of every block first, then 1, ...; so every block's first
bytes (a layer-major load's first layers) are in place and checked while the rest is still on
the wire.

**Checks.** The common case needs no decode: with every data shard of a block served at the
length its size implies, the block is the fragments end to end. A shard counts once its header
names this block, its stripe position, this geometry, this size and the write of the block's
shard 0 (one payload hash), and its checksum (xxh3-64 over header and fragment, ``ec.shard``)
holds: the header and checksum of a usual reply's shard in C as soon as it is whole (in
``take_replies``, its bytes still in the cache), the others' in one C call for every shard
landed since the last check (``_shardsums``), the one write over the block's shards here. Each
byte is hashed once, as it would be by one hash of the block, and a block's first shards are
known good before its last ones arrive. Anything else (a node down or refusing, a shard missing,
short, damaged or of another write) sends the block to the careful path, which asks the nodes
for the shards it lacks (the parity of a data shard known not to come was asked in the first
pass already, after the data). It rebuilds the lost rows where they lie, from the rows that
landed and the parity (``inplace``), and hashes the block against the write its rows name;
failing that, every shard of it is taken as an array of its own, each checked whole
(``check_shard``: checksum, key, position, geometry, size), the shards grouped by write, and
the block decoded through the codec (ISA-L) into its place, then hashed. A block
that cannot be assembled that way is a miss (False): its bytes in the buffer are undefined,
never handed out as a block. Once the caller has handed bytes on, a block that fails is a miss
at once: decoding it into place would rewrite bytes that may be in use.

Failures never escape: a node that cannot be reached, times out or answers what is not a reply
loses its connection, counts as holding only the shards it sent whole before that, and is not
asked again in this read (the careful path has a deadline of its own, so a stalled node costs
one timeout and its blocks are decoded around it). A node still out when the others are all in
costs less: as many as the blocks' parity can stand in for get a grace and are then given up
on the same way (``noderests.Stragglers``). Not thread-safe: one reader per thread (each keeps
one connection per node).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

from kvstore.blockstore import readproto as proto
from kvstore.blockstore.capability import ReadCapability
from kvstore.blockstore.inplace import Landed
from kvstore.blockstore.readblocks import ReadBlocks, Spread, put_back
from kvstore.blockstore.readlinks import (
    Items,
    NodeLinks,
    ReadEndpoint,
    Request,
    Scatter,
    ShardCheck,
    Usual,
)
from kvstore.blockstore.records import BlockLocation
from kvstore.ec.codec import Codec
from kvstore.ec.shard import (
    CHECKED_FROM,
    FRAGMENT_ALIGN,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    check_shard,
    payload_hash,
    writes_by_payload,
)
from kvstore.errors import ECError
from kvstore.fastcall.tls import ClientTLS

_sums: ModuleType | None
try:  # the checksums in one C call; without a compiler at install, ``_sums_hold``'s loop serves
    from kvstore.blockstore import _shardsums as _sums
except ImportError:  # pragma: no cover - the CI machine builds it
    _sums = None


@dataclass
class _Read:
    """One ``read_into``: its blocks as arrays, where each goes, and what it sends each node."""

    capability: ReadCapability
    view: memoryview
    sizes: np.ndarray  # (n,) int64
    starts: np.ndarray  # (n,) int64: where each block goes in ``view``
    placements: np.ndarray  # (n, width) int64: node per stripe index, -1: none to ask
    keys: np.ndarray  # (n, 32) uint8
    deadline: float
    spread: Spread | None = None  # else block i is end to end at ``starts[i]``

    def pieces(self, block: int, begin: int, nbytes: int) -> list[memoryview]:
        """Where bytes ``begin`` .. ``begin + nbytes`` of ``block`` go in ``view``."""
        if self.spread is None:
            at = int(self.starts[block]) + begin
            return [self.view[at : at + nbytes]]
        return self.spread.pieces(self.view, self.spread.rows[block], begin, nbytes)

    def piece_table(
        self, blocks: np.ndarray, begin: np.ndarray, nbytes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``pieces`` for many at once, as offsets in ``view`` and lengths, one row each and a
        column per segment of the spread (one end to end); a piece of length 0 is none."""
        if self.spread is None:
            return (self.starts[blocks] + begin)[:, None], np.array(nbytes, np.int64)[:, None]
        end = begin + nbytes
        rows = np.asarray(self.spread.rows, np.int64)[blocks]
        at = np.zeros((len(blocks), len(self.spread.segments)), np.int64)
        lengths = np.zeros_like(at)
        for column, (offset, length, base) in enumerate(self.spread.segments):
            lo, hi = np.maximum(begin, offset), np.minimum(end, offset + length)
            lengths[:, column] = np.maximum(hi - lo, 0)
            at[:, column] = np.where(hi > lo, base + rows * length + lo - offset, 0)
        return at, lengths


#: A shard's header and room before it for a reply's prefix (``readproto``), in ``_fast``.
_SLOT = proto.MAX_PREFIX + HEADER_BYTES
#: The buffers ``_fast`` receives into: the read's, the header slots, scratch.
_VIEW, _SLOTS, _SCRATCH = 0, 1, 2


def _head_at(bs: np.ndarray, indices: np.ndarray, k: int) -> np.ndarray:
    """Where the header of shard ``indices`` of block ``bs`` lies in ``_fast``'s slots: at the
    end of its slot, the reply's prefix before it."""
    return (bs * k + indices) * _SLOT + proto.MAX_PREFIX


class _Plan:
    """The pieces of every request of a ``_fast`` read for the usual reply (each shard asked
    is served whole), worked out for all nodes at once: ``usual``, for the exchange to take
    those replies in one C call, and ``pieces`` for a reply taken in Python (``place``'s
    general case serves the others). Column 0 (the reply's prefix and the shard's header into
    its slot) waits for the reply's prefix; the fragment's pieces and the padding follow."""

    def __init__(
        self,
        read: _Read,
        requests: Mapping[int, list[Request]],
        span: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, ...]],
        k: int,
        m: int,
        buffers: tuple[Any, ...],
        sums: np.ndarray,
    ) -> None:
        chunks = [items for asked in requests.values() for items, _ in asked]
        bs = np.concatenate([b for b, _ in chunks]) if chunks else np.zeros(0, np.int64)
        indices = np.concatenate([i for _, i in chunks]) if chunks else np.zeros(0, np.int64)
        fragment, begin, take = span(bs, indices)
        piece_at, piece_len = read.piece_table(bs, begin, take)
        columns = piece_at.shape[1] + 2  # header, the fragment's pieces, padding
        # which, at, length of every piece in one allocation.
        table = np.zeros((3, len(bs), columns), np.int64)
        self._which, self._at, self._length = table
        self._which[:, 0] = _SLOTS
        self._which[:, -1] = _SCRATCH  # the pieces between: _VIEW (0)
        self._at[:, 1:-1] = piece_at
        self._length[:, 1:-1] = piece_len
        self._length[:, -1] = fragment - take
        self._head_at = _head_at(bs, indices, k)
        self._whole = whole = HEADER_BYTES + fragment  # a shard served whole: header, fragment
        # Per request (by its blocks array): its rows, and its usual reply's table and bytes.
        lengths = whole.astype("<u4")
        his = list(itertools.accumulate(len(b) for b, _ in chunks))
        los = [0, *his[:-1]] if his else []
        data = np.add.reduceat(whole, los).tolist() if chunks else []
        expected: dict[int, tuple[np.ndarray, int, int, bytes, int]] = {}
        for (b, _), lo, hi, nbytes in zip(chunks, los, his, data, strict=True):
            table_bytes = bytes(proto.padded(hi - lo)) + lengths[lo:hi].tobytes()  # all OK
            expected[id(b)] = (b, lo, hi, table_bytes, nbytes)
        self.usual = Usual(
            buffers,
            self._which.reshape(-1),
            self._at.reshape(-1),
            self._length.reshape(-1),
            columns,
            self._head_at,
            HEADER_BYTES,
            expected,
            ShardCheck(
                bs * k + indices, sums.reshape(-1), read.sizes, read.keys, k, m, MAGIC, VERSION
            ),
        )

    def pieces(
        self, bs: np.ndarray, lengths: np.ndarray, prefix: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A ``Scatter``'s which, offsets and lengths for the reply of the request asking
        ``bs`` when it served every shard whole (``lengths``), else None."""
        found = self.usual.requests.get(id(bs))
        if found is None or found[0] is not bs:
            return None
        _, lo, hi, _, _ = found
        if len(lengths) != hi - lo or not (lengths == self._whole[lo:hi]).all():
            return None
        self._at[lo:hi, 0] = self._head_at[lo:hi] - prefix
        self._length[lo:hi, 0] = HEADER_BYTES + prefix
        return self._which[lo:hi].ravel(), self._at[lo:hi].ravel(), self._length[lo:hi].ravel()


#: ``on_prefix(nbytes, whole) -> handed on``: see ``DirectReader.read_into``.
OnPrefix = Callable[[int, np.ndarray], bool]


class DirectReader:
    """Reads leased blocks from the nodes at ``endpoints`` (node id → engine read socket)
    with their read capability; ``k`` + ``m``: the tier's stripe geometry. ``timeout_s``
    bounds each of a ``read_into``'s two passes (the data shards; then, for the blocks that
    did not land whole, every shard): a node that fails or is slower than that in the first
    counts as down for the rest of the read and is not asked again, so one stalled node costs
    the read one ``timeout_s`` at most, and its blocks are decoded around it; once the others
    are all in, a straggler is given up on after a grace (``noderests.Stragglers``)."""

    def __init__(
        self,
        endpoints: Mapping[int, ReadEndpoint],
        k: int,
        m: int,
        tls: ClientTLS | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.endpoints = dict(endpoints)
        self.k, self.m = k, m
        self._timeout = timeout_s
        self._codec = Codec(k, m)
        self.counters: Counter[str] = Counter()
        self._links = NodeLinks(endpoints, tls, self.counters)
        # Per node id, whether it has a socket here; the last entry (what -1 and ids beyond
        # the largest look up) is False.
        top = max([node for node in self.endpoints if node >= 0], default=-1)
        self._listed = np.zeros(top + 2, bool)
        self._listed[[node for node in self.endpoints if node >= 0]] = True

    def close(self) -> None:
        self._links.close()

    def reachable(self, timeout_s: float = 1.0) -> set[int]:
        """The nodes whose engine read socket this process can open (TLS included) within
        ``timeout_s``, all dialed at once: what a fetcher asks once to choose between reading
        directly and through the gateway (a client outside the cluster's network reaches
        none, and would otherwise wait out every read's timeout)."""
        return self._links.reachable(timeout_s)

    def read_into(
        self,
        capability: ReadCapability,
        blocks: Sequence[BlockLocation] | ReadBlocks,
        out: Any,
        offsets: Sequence[int] | None = None,
        spread: Spread | None = None,
        on_prefix: OnPrefix | None = None,
    ) -> list[bool]:
        """Read ``blocks`` (their keys, shard placements and sizes, as the lease has them:
        ``BlockLocation`` objects, or the arrays of ``ReadBlocks``) into the writable buffer
        ``out``, block i at ``offsets[i]`` (default: end to end) or cut up as ``spread`` says;
        True per block whose bytes there are the block's, False for a miss.

        ``on_prefix(nbytes, whole)``, with ``spread`` only: told as the read goes which
        blocks have their first ``nbytes`` bytes in place and checked (``whole``: a mask over
        ``blocks``), so a caller can hand those bytes on before the rest arrives. Once it
        answers True (it did hand some on), a block that is not whole by the end is a miss:
        its bytes may be in use, so it is never decoded into place from parity."""
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("out: must be a writable buffer")
        arrays = blocks if isinstance(blocks, ReadBlocks) else ReadBlocks.of(blocks)
        n = len(arrays)
        sizes = arrays.sizes
        if on_prefix is not None and spread is None:
            raise ValueError("on_prefix: needs a spread (blocks of one size)")
        if spread is not None:
            if offsets is not None:
                raise ValueError("offsets and spread: give one of them")
            spread.check(sizes, len(view))
            starts = np.zeros(n, np.int64)
        elif offsets is None:  # end to end: they fit, or the last one does not
            starts = np.zeros(n, np.int64)
            np.cumsum(sizes[:-1], out=starts[1:])
            if n and ((sizes < 0).any() or int(starts[-1] + sizes[-1]) > len(view)):
                raise ValueError(f"out: {len(view)} bytes do not hold the blocks at their offsets")
        else:
            starts = np.asarray(offsets, np.int64)
            if starts.shape != (n,):
                raise ValueError(f"offsets: {len(offsets)} for {n} blocks")
            if n and ((starts < 0).any() or int((starts + sizes).max()) > len(view)):
                raise ValueError(f"out: {len(view)} bytes do not hold the blocks at their offsets")
            order = np.argsort(starts, kind="stable")
            if n > 1 and (starts[order][1:] < (starts + sizes)[order][:-1]).any():
                raise ValueError("offsets: two blocks overlap (one would overwrite the other)")
        width = self.k + self.m
        given = arrays.placements[:, :width]
        if given.shape[1] == width:
            placements = given.astype(np.int64)  # a copy: nodes not to ask are set to -1
        else:
            placements = np.full((n, width), -1, np.int64)
            placements[:, : given.shape[1]] = given
        listed = self._listed  # no socket: none to ask (-1 and ids past the largest: False)
        placements[~listed[np.minimum(placements, len(listed) - 1)]] = -1
        resting = self._links.resting()
        # Failed a read lately (``readlinks``): their blocks come from parity. More than the
        # parity could stand in for says more about this reader than about the nodes (a stall
        # of its own): then every node is asked, as before.
        if resting and len(resting) <= self.m:
            placements[np.isin(placements, list(resting))] = -1
        read = _Read(
            capability,
            view,
            sizes,
            starts,
            placements,
            arrays.keys,
            time.monotonic() + self._timeout,
            spread,
        )
        self._links.down.clear()
        ok, in_use, landed = self._fast(read, on_prefix)
        careful = np.flatnonzero(~ok)
        if careful.size and not in_use:
            read.deadline = time.monotonic() + self._timeout
            ok[careful] = self._careful(read, careful.tolist(), landed)
        self.counters["blocks"] += n
        self.counters["misses"] += int(n - ok.sum())
        return ok.tolist()

    # --- the common case: data shards into place ------------------------------------------------

    def _fast(self, read: _Read, on_prefix: OnPrefix | None) -> tuple[np.ndarray, bool, Landed]:
        """Each block whose k data shards land in place and check out (see the module doc),
        whether ``on_prefix`` put blocks' bytes to use before the read ended, and what of the
        other blocks came and checked out (``inplace.Landed``: the careful path asks the nodes
        only for the rest)."""
        k = self.k
        n = len(read.sizes)
        sizes = read.sizes
        per_shard = -(-sizes // k)  # as ``fragment_length``, for every block at once
        fragments = np.maximum(FRAGMENT_ALIGN, -(per_shard // -FRAGMENT_ALIGN) * FRAGMENT_ALIGN)
        # Each shard's header lands at the end of its slot, the reply's prefix before it.
        slots = np.zeros((n, k, _SLOT), np.uint8)
        slot_view = memoryview(slots).cast("B")  # type: ignore[arg-type]
        heads = slots[:, :, proto.MAX_PREFIX :]
        # Each shard's write (its payload hash's first bytes), live as the headers land.
        writes = heads[:, :, 24:32].view("<u8")[:, :, 0]
        scratch = [memoryview(bytearray(int(fragments.max(initial=0))))]
        landed = np.zeros((n, k), bool)
        checked = np.zeros((n, k), bool)
        # Checked in C as they land (``take_replies``), else in ``check``: 1 header and
        # checksum hold, 2 not.
        sums = np.zeros((n, k), np.uint8)
        fresh = False  # shards landed since the last ``check``
        told = 0  # stripe positions told to ``on_prefix`` so far
        in_use = False

        def span(bs: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, ...]:
            """Each shard's fragment length, where its fragment begins in its block and how
            many of its bytes are the block's (the rest is padding)."""
            fragment = fragments[bs]
            begin = indices * fragment
            return fragment, begin, np.minimum(np.maximum(sizes[bs] - begin, 0), fragment)

        requests = self._requests(
            read, _asks(read.placements[:, :k]), by_position=on_prefix is not None
        )
        plan = _Plan(read, requests, span, k, self.m, (read.view, slot_view, scratch[0]), sums)
        # For the data shards that will not come (their node resting, or none to ask), as many
        # parity shards are asked in the same exchange, after each node's data shards, each
        # into an array of its own: the careful pass then has them at hand.
        ahead: dict[tuple[int, int], np.ndarray] = {}
        if (read.placements[:, :k] < 0).any():  # a healthy read has none to ask ahead
            for node, asked in self._requests(read, _asks(_ahead(read.placements, k))).items():
                requests.setdefault(node, []).extend(asked)
        land_ahead = _into_arrays(ahead)

        def place(
            bs: np.ndarray, indices: np.ndarray, lengths: np.ndarray, prefix: int
        ) -> tuple[Scatter, np.ndarray]:
            """Per served shard, in order: its prefix and header into its slot, its fragment's
            pieces where the read puts them, its padding into scratch; a shard that is not
            this block's (another length) into scratch whole. Parity asked ahead: whole."""
            if indices.size and indices[0] >= k:
                return land_ahead(bs, indices, lengths, prefix)
            usual = plan.pieces(bs, lengths, prefix)
            if usual is not None:  # every shard asked served whole: the rows worked out
                return Scatter((read.view, slot_view, scratch[0]), *usual), np.ones(len(bs), bool)
            fragment, begin, take = span(bs, indices)
            fits = lengths == HEADER_BYTES + fragment
            most = prefix + int(lengths.max(initial=0))
            if most > len(scratch[0]):
                scratch[0] = memoryview(bytearray(most))
            piece_at, piece_len = read.piece_table(bs, begin, take)
            columns = piece_at.shape[1] + 2  # header, the fragment's pieces, padding
            which = np.full((len(bs), columns), _VIEW, np.int64)
            at = np.zeros_like(which)
            length = np.zeros_like(which)
            which[:, 0] = np.where(fits, _SLOTS, _SCRATCH)
            at[:, 0] = np.where(fits, _head_at(bs, indices, k) - prefix, 0)
            length[:, 0] = np.where(fits, HEADER_BYTES, lengths) + prefix
            at[:, 1:-1] = piece_at
            length[:, 1:-1] = np.where(fits[:, None], piece_len, 0)
            which[:, -1] = _SCRATCH
            length[:, -1] = np.where(fits, fragment - take, 0)
            buffers = (read.view, slot_view, scratch[0])
            return Scatter(buffers, which.ravel(), at.ravel(), length.ravel()), fits

        def check() -> None:
            """The shards landed and not yet counted: their headers against the block and the
            stripe and their checksums (where not checked as they landed), the write against
            the block's shard 0. A whole pass over the read's (block, position) table: a few
            array operations, however the shards came."""
            nonlocal fresh
            if not fresh:
                return
            fresh = False
            open_ = landed & ~checked
            bs, indices = np.nonzero(open_ & (sums == 0))  # not checked as they landed
            if bs.size:
                sums[bs, indices] = np.where(holds(bs, indices), 1, 2)
            checked[open_ & (sums == 1) & (writes == writes[:, :1])] = True  # one write

        def holds(bs: np.ndarray, indices: np.ndarray) -> np.ndarray:
            """Whether each shard's header names its block, stripe index and geometry, and its
            checksum holds."""
            head = heads[bs, indices]
            good = (head[:, 8:12] == np.frombuffer(MAGIC, np.uint8)).all(axis=1)
            good &= (head[:, 12] == indices) & (head[:, 13] == VERSION)
            good &= (head[:, 14] == k) & (head[:, 15] == self.m)
            claimed = np.ascontiguousarray(head[:, 16:24]).view("<u8")[:, 0]
            good &= claimed == sizes[bs].astype(np.uint64)
            good &= (head[:, 32:64] == read.keys[bs]).all(axis=1)
            fragment, begin, take = span(bs, indices)
            rows = np.flatnonzero(good)
            good[rows] = _sums_hold(
                read, slots, bs[rows], indices[rows], begin[rows], take[rows], fragment[rows]
            )
            return good

        def tell(upto: int) -> None:
            """Tell ``on_prefix`` of stripe positions ``told`` .. ``upto`` - 1."""
            nonlocal told, in_use
            assert on_prefix is not None
            largest = int(sizes.max(initial=0))
            for index in range(told, upto):
                whole = np.asarray(checked[:, : index + 1].all(axis=1))
                prefix = min(largest, (index + 1) * int(fragments.max(initial=0)))
                in_use = bool(on_prefix(prefix, whole)) or in_use
            told = max(told, upto)

        def on_shards(got: list[Items]) -> None:
            nonlocal fresh
            for bs, indices in got:
                if indices.size and indices[0] < k:  # parity asked ahead: not in place
                    landed[bs, indices] = True
            fresh = fresh or bool(got)
            if on_prefix is None:
                return
            # Check (one batch) once a further stripe position has landed for every block.
            reach = int(np.argmin(np.append(landed.all(axis=0), False)))
            if reach > told:
                check()
                tell(int(np.argmin(np.append(checked.all(axis=0), False))))

        # With ``on_prefix`` each node is asked for its data shards stripe position by position
        # (0 of every block first), so every block's first bytes arrive before its last ones.
        # A node far behind the others is given up on and its blocks decoded around it
        # (``noderests.Stragglers``), as many as the blocks' parity left can stand in for.
        lost = int((read.placements < 0).sum(axis=1).max(initial=0))
        got = self._links.exchange(
            requests,
            place,
            read.deadline,
            on_shards,
            pace=None if on_prefix is None else 1,
            usual=plan.usual,
            spare=max(0, self.m - lost),
        )
        check()
        if on_prefix is not None:
            tell(k)
        good = np.asarray(checked.all(axis=1))
        self.counters["fast_blocks"] += int(good.sum())

        came = {  # a request asks data shards or parity shards, never both
            (b, index): ahead[b, index]
            for bs, indices in got
            if ahead and indices.size and indices[0] >= k
            for b, index in zip(bs.tolist(), indices.tolist(), strict=True)
        }
        return good, in_use, Landed(heads, landed & (sums == 1), sizes, read.pieces, came)

    def _requests(
        self, read: _Read, asks: dict[int, Items], by_position: bool = False
    ) -> dict[int, list[Request]]:
        """Per node, the requests for its shards of ``asks`` (at most
        ``MAX_SHARDS_PER_REQUEST`` each), block by block or stripe position by position."""
        size = proto.MAX_SHARDS_PER_REQUEST
        requests: dict[int, list[Request]] = {}
        for node, (bs, ix) in asks.items():
            if by_position:
                order = np.lexsort((bs, ix))
                bs, ix = bs[order], ix[order]
            part = read.capability.node_part(node)
            requests[node] = [
                (
                    (bs[i : i + size], ix[i : i + size]),
                    _request(part, read.keys[bs[i : i + size]].tobytes(), len(bs[i : i + size])),
                )
                for i in range(0, len(bs), size)
            ]
        return requests

    # --- the careful path: every shard, checked, decoded ----------------------------------------

    def _careful(self, read: _Read, chosen: list[int], landed: Landed) -> list[bool]:
        """Decode each of the ``chosen`` blocks from every shard it has: those ``landed`` in the
        fast pass (checked there) and the rest, asked of their nodes now. Rebuilt in place
        where it can (``Landed.rebuild``), else each shard checked and decoded (``_decode``)."""
        width = self.k + self.m
        stripes: dict[int, list[np.ndarray | None]] = {b: [None] * width for b in chosen}
        for (b, index), shard in landed.ahead.items():
            if b in stripes:
                stripes[b][index] = shard
        self.counters["shards_kept"] += int(landed.usable[chosen].sum())
        # A block its parity asked ahead finishes needs no second round.
        done = {
            b
            for b in chosen
            if any(shard is not None for shard in stripes[b][self.k :])
            and landed.rebuild(self._codec, b, read.keys[b].tobytes(), stripes[b], self.counters)
        }
        todo = [b for b in chosen if b not in done]
        rows = np.array(todo, np.int64)
        placements = read.placements[rows]
        placements[np.isin(placements, list(self._links.down))] = -1  # down for this read
        placements[:, : self.k][landed.usable[rows]] = -1  # at hand: not asked again
        ahead = np.array([[shard is not None for shard in stripes[b]] for b in todo], bool)
        placements[ahead.reshape(len(todo), width)] = -1  # came whole, asked ahead
        landing: dict[tuple[int, int], np.ndarray] = {}
        requests = self._requests(read, _asks(placements, rows))
        self.counters["second_rounds"] += bool(requests)
        for bs, indices in self._links.exchange(requests, _into_arrays(landing), read.deadline):
            for b, index in zip(bs.tolist(), indices.tolist(), strict=True):
                stripes[b][index] = landing[b, index]
        out = {b: True for b in done}
        for b in todo:
            key = read.keys[b].tobytes()
            if landed.rebuild(self._codec, b, key, stripes[b], self.counters):
                out[b] = True
                continue
            size = int(read.sizes[b])
            places = read.pieces(b, 0, size)
            held = landed.shards(b)
            for index, shard in held.items():
                stripes[b][index] = shard
            trusted = held.keys()
            if len(places) == 1:
                out[b] = self._decode(key, size, stripes[b], places[0], trusted)
                continue
            whole = np.empty(size, np.uint8)  # decoded whole, then cut up as the read says
            decoded = self._decode(key, size, stripes[b], memoryview(whole), trusted)  # type: ignore[arg-type]
            if decoded:
                put_back(whole, places)
            out[b] = decoded
        self.counters["decoded_blocks"] += sum(out.values())
        return [out[b] for b in chosen]

    def _decode(
        self,
        key: bytes,
        size: int,
        stripe: list[np.ndarray | None],
        target: memoryview,
        trusted: Collection[int] = (),
    ) -> bool:
        """Decode the block of ``key`` (``size`` bytes) into ``target`` from the shards of
        ``stripe`` that pass their own checks (those at ``trusted`` indices passed them
        already), one write at a time; True once a decode hashes to its write's hash."""
        checked: list[np.ndarray | None] = []
        for index, shard in enumerate(stripe):
            if shard is None or index in trusted:
                checked.append(shard)
                continue
            try:
                check_shard(shard, key=key, index=index, k=self.k, m=self.m, payload_len=size)
            except ECError:
                self.counters["corrupt_shards"] += 1
                checked.append(None)
                continue
            checked.append(shard)
        groups, _ = writes_by_payload(checked)
        for digest, members in groups:
            if len(members) < self.k:
                break
            shards = [shard if i in members else None for i, shard in enumerate(checked)]
            try:
                self._codec.decode_into(shards, target, size=size, key=key)
            except ECError:
                continue
            if payload_hash(target) == digest:
                return True
        return False


def _sums_hold(
    read: _Read,
    slots: np.ndarray,
    bs: np.ndarray,
    indices: np.ndarray,
    begin: np.ndarray,
    take: np.ndarray,
    fragment: np.ndarray,
) -> np.ndarray:
    """Whether the checksum of each landed shard (block ``bs``, stripe index ``indices``) holds:
    xxh3-64 over its header from ``CHECKED_FROM`` on (at the end of its slot in ``slots``, see
    ``_fast``), its ``take`` bytes of the block from ``begin`` on (where the read put them) and
    its zero padding up to ``fragment``.
    One C call for them all (``_shardsums``); this loop is its reference and fallback."""
    k = slots.shape[1]
    pads = fragment - take
    if _sums is not None:
        piece_at, piece_len = read.piece_table(bs, begin, take)
        holds = np.zeros(len(bs), np.uint8)
        head_at = _head_at(bs, indices, k)
        _sums.check_sums(slots, head_at, read.view, piece_at, piece_len, pads, holds)
        return holds.view(bool)
    zeros = bytes(int(pads.max(initial=0)))  # padding is zeros (``ec.shard``)
    out = np.zeros(len(bs), bool)
    for row, (b, index, at, taken, pad) in enumerate(
        zip(
            bs.tolist(), indices.tolist(), begin.tolist(), take.tolist(), pads.tolist(), strict=True
        )
    ):
        head = slots[b, index, proto.MAX_PREFIX :]
        digest = xxhash.xxh3_64(head[CHECKED_FROM:].tobytes())
        for piece in read.pieces(b, at, taken):
            digest.update(piece)
        digest.update(zeros[:pad])
        out[row] = digest.digest() == head[:CHECKED_FROM].tobytes()
    return out


def _ahead(placements: np.ndarray, k: int) -> np.ndarray:
    """``placements`` with only the parity shards to ask ahead: per block, as many of its
    first parity shards with a node as it has data shards with none (-1 elsewhere)."""
    lacking = (placements[:, :k] < 0).sum(axis=1)
    parity = placements[:, k:]
    held = parity >= 0
    out = np.full_like(placements, -1)
    out[:, k:] = np.where(held & (np.cumsum(held, axis=1) <= lacking[:, None]), parity, -1)
    return out


def _into_arrays(
    landing: dict[tuple[int, int], np.ndarray],
) -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], tuple[Scatter, np.ndarray]]:
    """A ``place`` that lands each served shard whole, in an array of its own (views of one a
    reply), in ``landing`` by (block, stripe index); the reply's prefix into scratch."""

    def place(
        bs: np.ndarray, indices: np.ndarray, lengths: np.ndarray, prefix: int
    ) -> tuple[Scatter, np.ndarray]:
        whole = np.empty(int(lengths.sum()), np.uint8)
        starts = np.cumsum(lengths) - lengths
        for b, index, start, length in zip(
            bs.tolist(), indices.tolist(), starts.tolist(), lengths.tolist(), strict=True
        ):
            landing[b, index] = whole[start : start + length]
        which = np.tile(np.array([0, 1], np.int64), len(bs))
        at = np.column_stack([np.zeros_like(starts), starts]).ravel()
        length = np.column_stack([np.full_like(lengths, prefix), lengths]).ravel()
        return Scatter((bytearray(prefix), whole), which, at, length), np.ones(len(bs), bool)

    return place


def _asks(placements: np.ndarray, rows: np.ndarray | None = None) -> dict[int, Items]:
    """Node -> the (block, stripe index) it holds of ``placements`` (its rows are the blocks
    ``rows``, default 0..), block by block."""
    width = placements.shape[1]
    flat = placements.ravel()
    # By node, block by block within each: a stable sort, on 16 bits (a radix sort, a third
    # of the 64-bit sort's time) where the node ids fit.
    small = bool(flat.size) and int(flat.max()) < 2**15
    order = np.argsort(flat.astype(np.int16) if small else flat, kind="stable")
    nodes = flat[order]
    held = int(np.searchsorted(nodes, 0))  # no node (-1) sorts first
    order, nodes = order[held:], nodes[held:]
    blocks, indices = np.divmod(order, width)
    if rows is not None:
        blocks = rows[blocks]
    if not len(nodes):  # none held: none
        return {}
    cuts = (np.flatnonzero(nodes[1:] != nodes[:-1]) + 1).tolist()
    return {
        int(nodes[a]): (blocks[a:b], indices[a:b])
        for a, b in zip([0, *cuts], [*cuts, len(nodes)], strict=True)
    }


def _request(part: bytes, keys: bytes, count: int) -> bytes:
    """One read request frame: this node's part of the capability and the ``count`` keys
    asked (32 bytes each, end to end)."""
    head = proto.REQUEST.pack(
        proto.REQUEST_MAGIC, proto.OP_READ, proto.VERSION, 0, len(part), count
    )
    body = b"".join([head, part, keys])
    return len(body).to_bytes(4, "big") + body
