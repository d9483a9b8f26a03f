"""``DirectReader``: blocks straight from real storage nodes' engine read sockets into the
caller's buffer; parity only when a data shard is missing or bad; a miss, never wrong bytes."""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from certs import self_signed
from readnodes import ReadNodes, block_key

from kvstore.blockstore import direct, noderests, readlinks
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.readblocks import ReadBlocks, Spread
from kvstore.blockstore.readlinks import Scatter
from kvstore.blockstore.readserver import EngineReadServer
from kvstore.blockstore.records import BlockLocation
from kvstore.blockstore.segments import RECORD_BYTES
from kvstore.ec.shard import HEADER_BYTES, fragment_length
from kvstore.fastcall.tls import ClientTLS, ServerTLS

SIZE = 100_000  # not a multiple of 10 x 64: the last fragment carries padding


@pytest.fixture
def tier(tmp_path) -> Iterator[ReadNodes]:  # type: ignore[no-untyped-def]
    os.chmod(tmp_path, 0o700)
    nodes = ReadNodes(tmp_path / "nodes")
    nodes.put([block_key("t", i) for i in range(24)], SIZE)
    yield nodes
    nodes.close()


def _c_or_python(
    request: pytest.FixtureRequest, patch: pytest.MonkeyPatch, where: object, name: str
) -> str:
    """Param "c": the C extension ``where.name`` (the CI machine builds it); "python": None
    there, so its Python reference serves."""
    if request.param == "python":
        patch.setattr(where, name, None)
    else:
        assert getattr(where, name) is not None
    return str(request.param)


@pytest.fixture(params=["c", "python"])
def checksums(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The shard checksums by the C extension (``_shardsums``), or by its Python reference."""
    return _c_or_python(request, monkeypatch, direct, "_sums")


@pytest.fixture(params=["c", "python"])
def receive_in(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The scatter receive by the C extension (``_recvpieces``), or by memoryviews."""
    return _c_or_python(request, monkeypatch, readlinks, "_pieces")


def _lease(tier: ReadNodes) -> list[BlockLocation]:
    return [tier.locations[block_key("t", i)] for i in range(24)]


def _check(tier: ReadNodes, blocks: list[BlockLocation], out: np.ndarray, ok: list[bool]) -> None:
    for b, (block, good) in enumerate(zip(blocks, ok, strict=True)):
        if good:
            assert np.array_equal(out[b * SIZE : (b + 1) * SIZE], tier.payloads[block.key]), b


def _counted(server: EngineReadServer, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``server.stats()`` once ``done`` holds of it (bounded): a server counts its sends when
    the call that made them returns, which on a busy machine can be after the reader already
    holds every byte of the reply."""
    deadline = time.monotonic() + 30
    stats = server.stats()
    while not done(stats) and time.monotonic() < deadline:
        time.sleep(0.01)
        stats = server.stats()
    return stats


def _reads_whole_decoding_one(tier: ReadNodes, blocks: list[BlockLocation]) -> DirectReader:
    """Every block of ``blocks`` reads whole and right, one of them decoded from parity."""
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert reader.counters["decoded_blocks"] == 1
    return reader


def _damage(tier: ReadNodes, node: int, key: bytes, at: int = 10) -> None:
    """Flip a byte of the fragment of ``node``'s shard of ``key``, in its segment file."""
    found = tier.nodes[node].locate([key])[0]
    assert found is not None
    path, offset, _ = found
    where = offset + RECORD_BYTES + HEADER_BYTES + at
    with open(path, "r+b") as file:
        file.seek(where)
        byte = file.read(1)
        file.seek(where)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_every_block_lands_in_place_without_a_decode(tier: ReadNodes, receive_in: str) -> None:
    blocks = _lease(tier)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert reader.counters["fast_blocks"] == len(blocks)
    assert reader.counters["decoded_blocks"] == 0


def test_blocks_given_as_a_leases_arrays_read_as_their_locations_do(tier: ReadNodes) -> None:
    """An engine hands the reader its grant's arrays (``ReadBlocks``: keys as uint64 words,
    int32 placements), with no Python object a block: the same blocks land, and a block
    whose parity columns are left off still reads (its data shards suffice), and decodes
    around a damaged data shard only where its parity is named."""
    blocks = _lease(tier)
    words = np.frombuffer(b"".join(block.key for block in blocks), np.uint64).reshape(-1, 4)
    placements = np.array([block.placement for block in blocks], np.int32)
    sizes = np.array([block.size for block in blocks], np.int64)
    reader = DirectReader(tier.endpoints, 10, 2)
    capability = tier.capability(blocks)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    assert reader.read_into(capability, ReadBlocks(words, placements, sizes), out) == [True] * 24
    _check(tier, blocks, out, [True] * 24)
    _damage(tier, blocks[3].placement[2], blocks[3].key)
    narrow = ReadBlocks(words, placements[:, :10], sizes)  # no parity named
    out[:] = 0
    ok = reader.read_into(capability, narrow, out)
    assert ok == [b != 3 for b in range(24)]
    _check(tier, blocks, out, ok)
    out[:] = 0
    ok = reader.read_into(capability, ReadBlocks(words, placements, sizes), out)
    assert ok == [True] * 24  # decoded from the parity the lease names
    _check(tier, blocks, out, ok)
    assert reader.counters["decoded_blocks"] == 1


_KEYS, _NODES, _SIZES = np.zeros((2, 32), np.uint8), np.zeros((2, 12), np.int32), np.ones(2, int)


@pytest.mark.parametrize(
    ("keys", "placements", "sizes", "named"),
    [
        (np.zeros((2, 31), np.uint8), _NODES, _SIZES, "keys"),
        (np.zeros((2, 4), np.uint32), _NODES, _SIZES, "keys"),
        (_KEYS, np.zeros(24, np.int32), _SIZES, "placements"),
        (_KEYS, np.zeros((3, 12), np.int32), _SIZES, "placements"),
        (_KEYS, np.zeros((2, 12)), _SIZES, "placements"),  # floats
        (np.zeros((2, 4), np.uint64), _NODES, np.ones((2, 1), int), "sizes"),
        (_KEYS, _NODES, np.ones(2), "sizes"),  # floats
    ],
)
def test_read_blocks_of_the_wrong_shapes_or_types_are_refused_naming_what(
    keys: np.ndarray, placements: np.ndarray, sizes: np.ndarray, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        ReadBlocks(keys, placements, sizes)


def test_a_nodes_shards_that_lie_end_to_end_go_in_one_send(tier: ReadNodes) -> None:
    """A put batch's shards lie end to end in a node's segment file: the node sends them as
    one run of whole records (the reader skips each record header, the reply's prefix)."""
    blocks = _lease(tier)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    assert reader.read_into(tier.capability(blocks), blocks, out) == [True] * len(blocks)
    _check(tier, blocks, out, [True] * len(blocks))
    for server in tier.servers:
        stats = _counted(server, lambda stats: stats.get("sends", 0) > 0)
        assert stats["served"] > 1 and stats["sends"] == 1, stats


def test_shards_asked_out_of_their_order_on_disk_arrive_whole(
    tier: ReadNodes, receive_in: str
) -> None:
    """Shards asked in another order than they lie, or with one missing between them, go as
    separate runs; every byte still lands where it belongs."""
    blocks = _lease(tier)[::-1]
    for node in tier.nodes:  # one shard gone from every node: the run breaks around it
        key = blocks[5].key
        if node.locate([key])[0] is not None:
            node.delete([key])
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [b != 5 for b in range(len(blocks))]
    _check(tier, blocks, out, ok)
    for server in tier.servers:  # each shard its own run: as many sends as shards served
        stats = _counted(server, lambda stats: stats.get("sends", 0) >= stats.get("served", 0))
        assert stats.get("sends", 0) == stats.get("served", 0), stats


def test_blocks_go_where_the_offsets_say(tier: ReadNodes) -> None:
    blocks = _lease(tier)[:3]
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(4 * SIZE, np.uint8)
    offsets = [3 * SIZE, 0, 2 * SIZE]
    assert reader.read_into(tier.capability(blocks), blocks, out, offsets) == [True] * 3
    for block, at in zip(blocks, offsets, strict=True):
        assert np.array_equal(out[at : at + SIZE], tier.payloads[block.key])
    assert not out[SIZE : 2 * SIZE].any()  # nothing written outside the blocks
    with pytest.raises(ValueError, match="overlap"):
        reader.read_into(tier.capability(blocks), blocks, out, [0, SIZE // 2, 2 * SIZE])
    with pytest.raises(ValueError, match="do not hold"):
        reader.read_into(tier.capability(blocks), blocks, out[: 2 * SIZE])


#: Three "layers" of a block, cut where no fragment boundary is (fragments are 10,048 bytes):
#: every data shard's fragment crosses into a second layer somewhere.
LAYERS = ((0, 30_000), (30_000, 45_000), (75_000, 25_000))


def _layer_major(rows: list[int], top: int) -> tuple[Spread, np.ndarray]:
    """A staging-like spread of ``top`` rows per layer, sections 64 bytes apart, and its out."""
    segments, base = [], 64
    for offset, length in LAYERS:
        segments.append((offset, length, base))
        base += top * length + 64
    return Spread(tuple(segments), tuple(rows)), np.zeros(base, np.uint8)


def _check_layer_major(
    tier: ReadNodes, blocks: list[BlockLocation], spread: Spread, out: np.ndarray, ok: list[bool]
) -> None:
    for block, row, good in zip(blocks, spread.rows, ok, strict=True):
        if not good:
            continue
        payload = tier.payloads[block.key]
        for offset, length, base in spread.segments:
            at = base + row * length
            assert np.array_equal(out[at : at + length], payload[offset : offset + length])


def test_blocks_land_layer_major_where_the_spread_says(tier: ReadNodes, receive_in: str) -> None:
    """A load's staging is layer-major: each fragment is cut at the layer boundaries it
    crosses and lands in each layer's section at its block's row; nothing else is written."""
    blocks = _lease(tier)[:6]
    rows = [4, 0, 6, 2, 5, 1]  # row 3 is left out: a block of another size, never read
    spread, out = _layer_major(rows, 7)
    reader = DirectReader(tier.endpoints, 10, 2)
    ok = reader.read_into(tier.capability(blocks), blocks, out, spread=spread)
    assert ok == [True] * 6
    _check_layer_major(tier, blocks, spread, out, ok)
    assert reader.counters["fast_blocks"] == 6 and reader.counters["decoded_blocks"] == 0
    for _, length, base in spread.segments:  # row 3 of every layer, and the gaps: untouched
        assert not out[base + 3 * length : base + 4 * length].any()
        assert not out[base - 64 : base].any()
    cap = tier.capability(blocks)
    with pytest.raises(ValueError, match="distinct"):
        reader.read_into(cap, blocks, out, spread=Spread(spread.segments, (0, 0, 1, 2, 3, 4)))
    with pytest.raises(ValueError, match="tile"):
        reader.read_into(cap, blocks, out, spread=Spread(spread.segments[1:], spread.rows))
    with pytest.raises(ValueError, match="overlap"):
        squeezed = tuple((o, n, 64) for o, n, _ in spread.segments)
        reader.read_into(cap, blocks, out, spread=Spread(squeezed, spread.rows))
    with pytest.raises(ValueError, match="do not hold"):
        reader.read_into(cap, blocks, out[:-100], spread=spread)
    with pytest.raises(ValueError, match="one of them"):
        reader.read_into(cap, blocks, out, [0] * 6, spread=spread)


def test_layer_major_blocks_are_decoded_into_place_or_missed(tier: ReadNodes) -> None:
    """With a node down every block is decoded from parity, then cut up into its layers; a
    block with more losses than parity is a miss."""
    blocks = _lease(tier)
    victim = blocks[7]
    tier.servers[victim.placement[0]].close()
    for index in (3, 9):  # with the node down, three shards of one block lost, m = 2
        _damage(tier, victim.placement[index], victim.key)
    spread, out = _layer_major(list(range(len(blocks))), len(blocks))
    reader = DirectReader(tier.endpoints, 10, 2, timeout_s=5.0)
    ok = reader.read_into(tier.capability(blocks), blocks, out, spread=spread)
    assert ok == [b != 7 for b in range(len(blocks))]
    _check_layer_major(tier, blocks, spread, out, ok)
    assert reader.counters["decoded_blocks"] > 0
    # Each rebuilt whole from the rows it got, then cut up again (``inplace.Landed``).
    assert reader.counters["rebuilt_in_place"] == reader.counters["decoded_blocks"]


def test_progress_hands_on_each_blocks_first_bytes_in_order(tier: ReadNodes) -> None:
    """With ``on_prefix`` the data shards come stripe position by position: each report
    names a longer prefix, and every byte of it is in place and checked when it is made."""
    blocks = _lease(tier)
    spread, out = _layer_major(list(range(len(blocks))), len(blocks))
    seen: list[int] = []

    def on_prefix(nbytes: int, whole: np.ndarray) -> bool:
        assert whole.all()
        for block, row in zip(blocks, spread.rows, strict=True):
            payload = tier.payloads[block.key]
            for offset, length, base in spread.segments:
                upto = min(length, nbytes - offset)
                if upto > 0:
                    at = base + row * length
                    assert np.array_equal(out[at : at + upto], payload[offset : offset + upto])
        seen.append(nbytes)
        return True

    reader = DirectReader(tier.endpoints, 10, 2)
    ok = reader.read_into(tier.capability(blocks), blocks, out, spread=spread, on_prefix=on_prefix)
    assert ok == [True] * len(blocks)
    assert seen == sorted(seen) and len(seen) == 10 and seen[-1] == SIZE and seen[0] < SIZE / 5
    with pytest.raises(ValueError, match="spread"):
        reader.read_into(tier.capability(blocks), blocks, out, on_prefix=on_prefix)


@pytest.mark.parametrize("handed_on", [True, False])
def test_a_block_damaged_after_its_bytes_were_handed_on_is_a_miss(
    tier: ReadNodes, handed_on: bool, checksums: str
) -> None:
    """Bytes handed on may be in use: a block found bad later is a miss, never decoded into
    place under its reader; while nothing was handed on, it is decoded from parity."""
    blocks = _lease(tier)
    victim = blocks[7]
    _damage(tier, victim.placement[6], victim.key)
    spread, out = _layer_major(list(range(len(blocks))), len(blocks))
    wholes: list[bool] = []

    def on_prefix(nbytes: int, whole: np.ndarray) -> bool:
        wholes.append(bool(whole[7]))
        return handed_on

    reader = DirectReader(tier.endpoints, 10, 2)
    ok = reader.read_into(tier.capability(blocks), blocks, out, spread=spread, on_prefix=on_prefix)
    assert wholes == [True] * 6 + [False] * 4  # whole up to the damaged shard 6
    assert ok == [b != 7 or not handed_on for b in range(len(blocks))]
    _check_layer_major(tier, blocks, spread, out, ok)
    assert reader.counters["decoded_blocks"] == (0 if handed_on else 1)


def test_blocks_smaller_than_a_fragment_per_shard_land_whole(
    tier: ReadNodes, checksums: str, receive_in: str
) -> None:
    """A 200-byte block has data in its first 4 fragments only (64 bytes each): the other data
    shards carry padding alone, and the last block's end is the buffer's."""
    keys = [block_key("small", i) for i in range(5)]
    blocks = tier.put(keys, 200, seed=3)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(5 * 200, np.uint8)
    assert reader.read_into(tier.capability(blocks), blocks, out) == [True] * 5
    for b, key in enumerate(keys):
        assert np.array_equal(out[b * 200 : (b + 1) * 200], tier.payloads[key])
    assert reader.counters["fast_blocks"] == 5


def _read_with_node_4_down(tier: ReadNodes) -> tuple[DirectReader, int]:
    """The lease read whole and right with node 4's socket closed: the reader, and how many
    blocks it decoded (every block with a data shard on node 4)."""
    blocks = _lease(tier)
    tier.servers[4].close()
    reader = DirectReader(tier.endpoints, 10, 2, timeout_s=5.0)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    decoded = sum(4 in b.placement[:10] for b in blocks)
    assert reader.counters["decoded_blocks"] == decoded > 0
    return reader, decoded


def test_a_node_down_is_decoded_around_from_parity(tier: ReadNodes, receive_in: str) -> None:
    blocks = _lease(tier)
    reader, decoded = _read_with_node_4_down(tier)
    # The careful pass keeps the 9 data shards each of those blocks got and asks only for
    # its 2 parity shards: the nodes served every data shard not on node 4, then those.
    assert reader.counters["shards_kept"] == 9 * decoded
    served = sum(10 - (4 in b.placement[:10]) for b in blocks) + 2 * decoded
    assert reader.counters["shards_served"] == served
    # Each rebuilt where its 9 rows lie, from those and a parity fragment (``inplace``).
    assert reader.counters["rebuilt_in_place"] == decoded
    assert reader.counters["second_rounds"] == 1


@pytest.mark.parametrize("by_layer", [False, True])
def test_a_node_known_down_has_its_blocks_parity_asked_ahead(
    tier: ReadNodes, receive_in: str, by_layer: bool
) -> None:
    """Once node 4 rests (it failed the last read), the next read asks each block with a data
    shard there for its first parity shard in the same round as the data: no second round,
    one parity shard a block, every block rebuilt where it lies. Layer-major and paced by
    stripe position too, the parity after the data."""
    blocks = _lease(tier)
    reader, decoded = _read_with_node_4_down(tier)
    before = dict(reader.counters)
    spread, out = _layer_major(list(range(len(blocks))), len(blocks))
    if not by_layer:
        out = np.zeros(len(blocks) * SIZE, np.uint8)
    told: list[int] = []

    def on_prefix(nbytes: int, whole: np.ndarray) -> bool:
        told.append(nbytes)
        return False  # nothing handed on: the blocks not whole may still be decoded

    ok = reader.read_into(
        tier.capability(blocks),
        blocks,
        out,
        spread=spread if by_layer else None,
        on_prefix=on_prefix if by_layer else None,
    )
    assert ok == [True] * len(blocks)
    if by_layer:
        _check_layer_major(tier, blocks, spread, out, ok)
        assert told
    else:
        _check(tier, blocks, out, ok)
    counted = {name: reader.counters[name] - before.get(name, 0) for name in reader.counters}
    assert counted["second_rounds"] == 0
    assert counted["rebuilt_in_place"] == counted["decoded_blocks"] == decoded
    served = sum(10 - (4 in b.placement[:10]) for b in blocks) + decoded
    assert counted["shards_served"] == served


def test_a_parity_shard_that_lies_about_its_write_never_lands_in_a_block(
    tier: ReadNodes, receive_in: str
) -> None:
    """With a node down, one block's first parity shard names the block's write and its
    checksum holds, but its fragment is another payload's. Rebuilt in place from it, the block
    fails its payload hash; it is decoded from the other parity shard instead."""
    victim = next(b for b in _lease(tier) if 4 in b.placement[:10])
    path, offset, length = tier.nodes[victim.placement[10]].locate([victim.key])[0] or ("", 0, 0)
    other = np.random.default_rng(98).integers(0, 256, SIZE, dtype=np.uint8)
    liar = np.asarray(tier.codec.encode(other, victim.key)[10]).copy()
    with open(path, "r+b") as file:
        file.seek(offset + RECORD_BYTES)
        liar[:HEADER_BYTES] = np.frombuffer(file.read(HEADER_BYTES), np.uint8)
        liar[:8] = np.frombuffer(xxhash.xxh3_64_digest(liar[8:].tobytes()), np.uint8)
        assert len(liar) == length - RECORD_BYTES
        file.seek(offset + RECORD_BYTES)
        file.write(liar.tobytes())
    reader, decoded = _read_with_node_4_down(tier)
    assert reader.counters["rebuilt_in_place"] == decoded - 1


def test_a_damaged_data_shard_is_found_and_decoded_around(
    tier: ReadNodes, checksums: str, receive_in: str
) -> None:
    """Found by its checksum: as it lands (``take_replies``), or after (``_shardsums``, or
    their Python reference)."""
    blocks = _lease(tier)
    victim = blocks[5]
    _damage(tier, victim.placement[2], victim.key)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert reader.counters["corrupt_shards"] == 1 and reader.counters["decoded_blocks"] == 1


def _read_around(
    tier: ReadNodes, index: int, endpoint: tuple[str, int], timeout_s: float
) -> tuple[DirectReader, float]:
    """Read the lease with ``endpoint`` standing in for the node holding the first block's
    shard ``index``: every block must still come back right. The reader, and the seconds the
    read took."""
    blocks = _lease(tier)
    liar = blocks[0].placement[index]
    reader = DirectReader({**tier.endpoints, liar: endpoint}, 10, 2, timeout_s=timeout_s)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    started = time.monotonic()
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    took = time.monotonic() - started
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    return reader, took


def test_a_whole_shard_of_another_stripe_position_is_not_taken(
    tier: ReadNodes, checksums: str, receive_in: str
) -> None:
    """A node serving a good shard (its checksum holds) of the block, but of another stripe
    position than the one it was asked: its header says so, and the block is decoded around
    it instead of taking its fragment for the one asked."""
    blocks = _lease(tier)
    victim = blocks[6]
    found = [tier.nodes[victim.placement[index]].locate([victim.key])[0] for index in (2, 3)]
    assert found[0] is not None and found[1] is not None
    (into, at_into, _), (source, at, length) = found
    with open(source, "rb") as file:
        file.seek(at + RECORD_BYTES)
        shard = file.read(length - RECORD_BYTES)
    with open(into, "r+b") as file:
        file.seek(at_into + RECORD_BYTES)
        file.write(shard)
    _reads_whole_decoding_one(tier, blocks)


def test_a_whole_shard_of_another_write_of_the_block_is_not_taken(
    tier: ReadNodes, checksums: str, receive_in: str
) -> None:
    """A node serving a good shard of the right block and stripe position, but of another
    write of its key (another payload: its header and checksum hold): the block's shards
    must be of one write, so it is decoded from those of shard 0's write instead of taking
    the stranger's fragment."""
    blocks = _lease(tier)
    victim = blocks[4]
    other = np.random.default_rng(99).integers(0, 256, SIZE, dtype=np.uint8)
    stranger = tier.codec.encode(other, victim.key)[2]
    found = tier.nodes[victim.placement[2]].locate([victim.key])[0]
    assert found is not None
    path, offset, length = found
    assert len(stranger) == length - RECORD_BYTES
    with open(path, "r+b") as file:
        file.seek(offset + RECORD_BYTES)
        file.write(np.asarray(stranger).tobytes())
    # Its rows are of two writes: not rebuilt in place, decoded by write (``_decode``).
    assert _reads_whole_decoding_one(tier, blocks).counters["rebuilt_in_place"] == 0


def _answering(head: bytes) -> tuple[tuple[str, int], threading.Event]:
    """A node's stand-in that answers every request with ``head`` and then holds the
    connection open, sending nothing more (until the event is set)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve(peer: socket.socket) -> None:
        with peer:
            size = int.from_bytes(peer.recv(4, socket.MSG_WAITALL), "big")
            peer.recv(size, socket.MSG_WAITALL)
            peer.sendall(head)
            done.wait(10)

    def accept() -> None:
        with listener:
            listener.settimeout(10)
            while not done.is_set():
                try:
                    peer, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(peer,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[:2], done


@pytest.mark.parametrize("why", ["not a reply", "fewer keys"])
def test_a_node_answering_what_is_not_a_reply_is_dropped_at_once(
    tier: ReadNodes, why: str, receive_in: str
) -> None:
    """Its head fails as soon as it is in: the reader does not wait out the read's deadline for
    a status table the head does not promise, and decodes around the node from parity."""
    from kvstore.blockstore import readproto as proto

    body = proto.REPLY.pack(
        proto.REPLY_MAGIC if why == "fewer keys" else b"HTTP", 0, 0, 1, 0
    ) + bytes(proto.table_bytes(1))
    endpoint, done = _answering(len(body).to_bytes(4, "big") + body)
    reader, took = _read_around(tier, 3, endpoint, timeout_s=20.0)
    done.set()
    assert reader.counters["decoded_blocks"] > 0 and reader.counters["node_failures"] >= 1
    assert took < 10, f"waited {took:.1f} s for a reply that was never coming"


def test_usual_replies_are_taken_at_once_the_others_where_they_stop(
    tier: ReadNodes, receive_in: str
) -> None:
    """With the C extension every node's reply that serves each shard asked whole is taken in
    one call (``take_replies``); a node missing one shard answers otherwise, and its reply is
    taken on in Python from its table."""
    blocks = _lease(tier)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    assert reader.read_into(tier.capability(blocks), blocks, out) == [True] * len(blocks)
    _check(tier, blocks, out, [True] * len(blocks))
    assert reader.counters["replies_taken_at_once"] == (12 if receive_in == "c" else 0)
    victim = blocks[3]
    tier.nodes[victim.placement[1]].delete([victim.key])
    out[:] = 0
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert reader.counters["replies_taken_at_once"] == (12 + 11 if receive_in == "c" else 0)
    assert reader.counters["shards_missing"] >= 1 and reader.counters["decoded_blocks"] == 1


def _trickling(endpoint: tuple[str, int], seed: int) -> tuple[str, int]:
    """A relay to the node at ``endpoint`` that passes its replies on in pieces of 1 byte to
    20 KB, a pause now and then: every cut a stream can make, the head's included."""
    listener = socket.create_server(("127.0.0.1", 0))
    rng = random.Random(seed)

    def relay(peer: socket.socket) -> None:
        with peer, socket.create_connection(endpoint) as node:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each cut goes now
            while True:
                size = peer.recv(4, socket.MSG_WAITALL)
                if len(size) < 4:
                    return
                node.sendall(size + peer.recv(int.from_bytes(size, "big"), socket.MSG_WAITALL))
                length = int.from_bytes(node.recv(4, socket.MSG_WAITALL), "big")
                reply = length.to_bytes(4, "big") + node.recv(length, socket.MSG_WAITALL)
                at = 0
                while at < len(reply):
                    cut = rng.choice([1, 3, 20, 24, 700, 20_000])
                    peer.sendall(reply[at : at + cut])
                    at += cut
                    if rng.random() < 0.05:
                        time.sleep(0.001)

    def accept() -> None:
        with listener:
            listener.settimeout(30)
            try:
                while True:
                    peer, _ = listener.accept()
                    threading.Thread(target=relay, args=(peer,), daemon=True).start()
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[:2]


def test_replies_cut_anywhere_by_the_stream_land_whole(tier: ReadNodes, receive_in: str) -> None:
    blocks = _lease(tier)
    endpoints = {node: _trickling(tier.endpoints[node], node) for node in range(12)}
    reader = DirectReader(endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks), reader.counters
    _check(tier, blocks, out, ok)
    assert reader.counters["decoded_blocks"] == 0 and reader.counters["node_failures"] == 0
    assert reader.counters["replies_taken_at_once"] == (12 if receive_in == "c" else 0)


def test_replies_past_a_wake_up_land_whole_and_leave_each_socket_waking_at_one_byte(
    tier: ReadNodes, receive_in: str
) -> None:
    """``take_replies`` has a socket wake the poll only once a good part of its reply is in
    (SO_RCVLOWAT, never more than the reply has left: replies of ~245 KB and ~730 KB a node
    here), and puts the mark back to 1 before it returns: a later reply the Python path
    takes, a short refusal, would otherwise wait out the deadline for bytes that never come."""
    big = tier.put([block_key("big", i) for i in range(64)], 113_664, seed=1)
    reader = DirectReader(tier.endpoints, 10, 2)
    for blocks, size in ((_lease(tier), SIZE), (big, 113_664)):
        out = np.zeros(len(blocks) * size, np.uint8)
        started = time.monotonic()
        assert reader.read_into(tier.capability(blocks), blocks, out) == [True] * len(blocks)
        assert time.monotonic() - started < 2.5  # well inside the reader's 5 s deadline
        for b, block in enumerate(blocks):
            assert np.array_equal(out[b * size : (b + 1) * size], tier.payloads[block.key]), b
        marks = [
            conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
            for conn in reader._links._conns.values()
        ]
        assert len(marks) == 12 and set(marks) == {1}
    assert reader.counters["decoded_blocks"] == 0 and reader.counters["node_failures"] == 0
    assert reader.counters["replies_taken_at_once"] == (24 if receive_in == "c" else 0)


@contextlib.contextmanager
def _late(endpoint: tuple[str, int], delay_s: float) -> Iterator[tuple[str, int]]:
    """A stand-in for the node at ``endpoint`` that passes everything on, but holds each of
    its connections' first reply back ``delay_s``: a node that answers whole, late."""
    listener = socket.create_server(("127.0.0.1", 0))
    links: list[socket.socket] = [listener]

    def pump(source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            while data := source.recv(1 << 20):
                time.sleep(delay)
                delay = 0.0
                sink.sendall(data)
        except OSError:
            pass  # either side closed: the test is over

    def serve() -> None:
        while True:
            try:
                peer, _ = listener.accept()
            except OSError:
                return
            node = socket.create_connection(endpoint)
            links.extend((peer, node))
            threading.Thread(target=pump, args=(peer, node, 0.0), daemon=True).start()
            threading.Thread(target=pump, args=(node, peer, delay_s), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[:2]
    finally:
        for link in links:
            link.close()


@pytest.mark.parametrize("paced", [False, True])
def test_a_node_far_behind_the_others_is_given_up_on_and_its_blocks_decoded_around_it(
    tier: ReadNodes, receive_in: str, paced: bool
) -> None:
    """A node that answers whole but 3 s late: once every other node's reply is in, it gets
    its grace (``noderests.Stragglers``: 4x the read so far, 0.5 s at the least) and its
    blocks are decoded from parity, instead of the read waiting for it (or for its 5 s
    deadline). Paced (bytes handed on as they land, the engine's layer-wise load), the other
    nodes wait for the slow one to keep pace until it is given up on; nothing was handed on
    here, so its blocks are decoded too."""
    blocks = _lease(tier)
    slow = blocks[0].placement[2]
    spread, out = _layer_major(list(range(len(blocks))), len(blocks))
    with _late(tier.endpoints[slow], 3.0) as endpoint:
        reader = DirectReader({**tier.endpoints, slow: endpoint}, 10, 2, timeout_s=5.0)
        started = time.monotonic()
        ok = reader.read_into(
            tier.capability(blocks),
            blocks,
            out,
            spread=spread,
            on_prefix=(lambda nbytes, whole: False) if paced else None,
        )
        took = time.monotonic() - started
    assert took < 2.0, took
    assert ok == [True] * len(blocks)
    _check_layer_major(tier, blocks, spread, out, ok)
    assert reader.counters["nodes_hedged"] == 1
    assert reader.counters["decoded_blocks"] == sum(slow in b.placement[:10] for b in blocks)


@pytest.mark.parametrize("grace", ["default", "past the deadline"])
def test_a_node_that_stalls_mid_reply_is_given_up_on_and_its_bytes_are_not_trusted(
    tier: ReadNodes, receive_in: str, grace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in answers with the head and table of the usual reply, then sends garbage for
    half its shards and stalls. Once every other node's reply is in, it gets its grace
    (``noderests.Stragglers``) and is given up on, well before the read's deadline; with a
    grace past the deadline, the read ends at the deadline. Either way the shards that came
    whole fail their checksums, and every block is decoded around the node."""
    from kvstore.blockstore import readproto as proto

    if grace != "default":
        monkeypatch.setattr(noderests, "HEDGE_MIN_S", 60.0)
    whole = HEADER_BYTES + fragment_length(SIZE, 10)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        with listener:
            peer, _ = listener.accept()
        with peer:
            size = int.from_bytes(peer.recv(4, socket.MSG_WAITALL), "big")
            body = peer.recv(size, socket.MSG_WAITALL)
            count = int.from_bytes(body[12:16], "little")
            data = count * whole
            table = bytes(proto.padded(count)) + np.full(count, whole, "<u4").tobytes()
            head = proto.REPLY.pack(proto.REPLY_MAGIC, 0, 0, count, data) + table
            peer.sendall((len(head) + data).to_bytes(4, "big") + head)
            peer.sendall(os.urandom(data // 2))
            done.wait(10)

    threading.Thread(target=serve, daemon=True).start()
    reader, took = _read_around(tier, 2, listener.getsockname()[:2], timeout_s=3.0)
    done.set()
    if grace == "default":
        assert took < 2.0 and reader.counters["nodes_hedged"] == 1, took
    else:
        assert 3.0 <= took < 8.0 and reader.counters["nodes_hedged"] == 0, took
    assert reader.counters["node_failures"] >= 1
    liar = _lease(tier)[0].placement[2]
    assert reader.counters["decoded_blocks"] == sum(liar in b.placement[:10] for b in _lease(tier))


def test_more_losses_than_parity_is_a_miss_never_wrong_bytes(tier: ReadNodes) -> None:
    blocks = _lease(tier)
    victim = blocks[7]
    for index in (0, 3, 9):  # three shards of one block bad, m = 2
        _damage(tier, victim.placement[index], victim.key)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [b != 7 for b in range(len(blocks))]
    _check(tier, blocks, out, ok)


def test_a_reader_outlives_a_node_restart_of_its_socket(tier: ReadNodes, receive_in: str) -> None:
    """A connection the node dropped is dialed again on the next read."""
    blocks = _lease(tier)[:4]
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    capability = tier.capability(blocks)
    assert reader.read_into(capability, blocks, out) == [True] * 4
    for conn in list(reader._links._conns.values()):
        conn.close()  # as if each node had hung up
    ok = reader.read_into(capability, blocks, out)
    assert ok == [True] * 4
    _check(tier, blocks, out, ok)
    assert reader.counters["decoded_blocks"] == 0  # redialed at once, no block went careful


def test_a_connection_the_node_let_go_idle_is_redialed(tier: ReadNodes, receive_in: str) -> None:
    for i, server in enumerate(tier.servers):  # nodes that let an idle peer go at once
        server.close()
        tier.servers[i] = EngineReadServer(
            i,
            tier.key,
            tier.nodes[i],
            tier.locks[i],
            tier.revocations[i],
            clock=tier.clock,
            idle_s=0.1,
        )
    blocks = _lease(tier)[:4]
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    capability = tier.capability(blocks)
    assert reader.read_into(capability, blocks, out) == [True] * 4
    time.sleep(0.5)  # every pooled connection is closed on the nodes' side now
    ok = reader.read_into(capability, blocks, out)
    assert ok == [True] * 4
    _check(tier, blocks, out, ok)
    assert reader.counters["node_failures"] > 0  # the stale ones, each redialed at once
    assert reader.counters["decoded_blocks"] == 0


def test_over_tls_the_same_bytes_arrive(tier: ReadNodes, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With the data plane's TLS setting the nodes send from one buffer (TLS cannot
    sendfile) and the reader receives piece by piece (TLS has no recvmsg_into)."""
    cert, key = self_signed(tmp_path)
    for i, server in enumerate(tier.servers):
        server.close()
        tier.servers[i] = EngineReadServer(
            i,
            tier.key,
            tier.nodes[i],
            tier.locks[i],
            tier.revocations[i],
            tls=ServerTLS(cert, key),
            clock=tier.clock,
        )
    blocks = _lease(tier)
    reader = DirectReader(tier.endpoints, 10, 2, tls=ClientTLS(cert))
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert tier.servers[0].stats()["tls"] is True
    plain = DirectReader(tier.endpoints, 10, 2)  # a reader without TLS gets nothing
    assert plain.read_into(tier.capability(blocks), blocks, out) == [False] * len(blocks)


def test_a_segment_cut_short_behind_the_nodes_back_is_read_around(tier: ReadNodes) -> None:
    """The node sends from its segment file what its index says is there; a file cut short
    since (a disk fault) ends its reply early: the reader drops that node and decodes the
    blocks from the others, never handing out what did not arrive."""
    blocks = _lease(tier)
    found = tier.nodes[2].locate([blocks[0].key])[0]
    assert found is not None
    path, offset, _ = found
    os.truncate(path, offset)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    assert ok == [True] * len(blocks)
    _check(tier, blocks, out, ok)
    assert reader.counters["node_failures"] > 0 and reader.counters["decoded_blocks"] > 0


def test_a_reply_cut_anywhere_by_the_stream_fills_every_piece_in_order(receive_in: str) -> None:
    """The scatter receive resumes where each receive stopped, mid-piece or not, over pieces
    of several buffers in any order, and takes no more than it is allowed at a time."""
    rng = random.Random(5)
    for _ in range(20):
        sender, receiver = socket.socketpair()
        sizes = [rng.choice([1, 7, 64, 1000, 13_000, 70_000]) for _ in range(rng.randint(1, 1500))]
        data = rng.randbytes(sum(sizes))

        def feed(data: bytes = data, sender: socket.socket = sender) -> None:
            at = 0
            while at < len(data):
                cut = rng.randint(1, 300_000)
                sender.sendall(data[at : at + cut])
                at += cut

        # Each piece somewhere in one of three buffers, the pieces shuffled within them.
        which = np.array([rng.randrange(3) for _ in sizes], np.int64)
        offsets = np.zeros(len(sizes), np.int64)
        buffers = []
        for b in range(3):
            mine = np.flatnonzero(which == b).tolist()
            rng.shuffle(mine)
            at = 0
            for p in mine:
                offsets[p] = at
                at += sizes[p]
            buffers.append(bytearray(at))
        scatter = Scatter(buffers, which, offsets, np.array(sizes, np.int64))
        feeder = threading.Thread(target=feed)
        feeder.start()
        receiver.setblocking(False)
        poll = select.poll()  # not select.select: this process may hold descriptors past 1024
        poll.register(receiver, select.POLLIN)
        while scatter.done < scatter.total:
            poll.poll(30_000)
            most = rng.choice([None, 1, 5000, 100_000])
            got = scatter.receive(receiver, most)  # 0: nothing there yet
            assert most is None or got <= most
            assert got or scatter.drained
        feeder.join()
        landed = b"".join(
            bytes(buffers[b][o : o + n]) for b, o, n in zip(which, offsets, sizes, strict=True)
        )
        assert landed == data
        sender.close()
        receiver.close()


def test_a_piece_outside_its_buffer_is_refused_before_any_byte_lands(receive_in: str) -> None:
    buffers = [bytearray(100), bytearray(10)]
    for which, offset, length in ((1, 5, 6), (2, 0, 1), (0, -1, 2)):
        sender, receiver = socket.socketpair()
        sender.sendall(bytes(range(1, 120)))
        receiver.setblocking(False)
        time.sleep(0.05)
        scatter = Scatter(
            buffers, np.array([0, which]), np.array([0, offset]), np.array([100, length])
        )
        scatter.receive(receiver, 100)  # the first piece, whole
        with pytest.raises(ValueError, match="outside its buffer"):
            scatter.receive(receiver)
        assert buffers[1] == bytearray(10)
        assert receiver.recv(100) == bytes(range(101, 120))  # nothing taken by the refusal
        sender.close()
        receiver.close()
    with pytest.raises(ValueError, match="at the most"):
        Scatter([bytearray(1)] * 9, np.arange(9), np.zeros(9), np.ones(9))


def test_reachable_names_the_nodes_this_process_can_dial(tier: ReadNodes) -> None:
    tier.servers[5].close()
    endpoints = {**tier.endpoints, 12: ("192.0.2.1", 9)}  # TEST-NET-1: never answers
    started = time.monotonic()
    found = DirectReader(endpoints, 10, 2).reachable(timeout_s=0.5)
    assert found == set(range(12)) - {5}
    assert time.monotonic() - started < 2.0


def test_a_request_larger_than_the_socket_takes_goes_whole_and_in_order() -> None:
    """A request is sent without a timeout while it fits the socket's buffer; the rest of one
    that does not waits for the node to take it, bounded by the read's deadline."""
    mine, node = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    data = os.urandom(1 << 20)
    got = bytearray()

    def slow_node() -> None:
        while len(got) < len(data):
            time.sleep(0.001)
            got.extend(node.recv(65536))

    taker = threading.Thread(target=slow_node, daemon=True)
    taker.start()
    readlinks.Connection(mine).send(data, time.monotonic() + 30)
    taker.join(30)
    assert bytes(got) == data
    with pytest.raises(TimeoutError):  # nobody takes the rest: the deadline ends the send
        readlinks.Connection(mine).send(data, time.monotonic() + 0.2)
    mine.close()
    node.close()
