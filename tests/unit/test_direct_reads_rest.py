"""A node that failed an engine read rests (``noderests``): the reads that
follow decode its blocks from parity without asking it, it comes back once a background dial
to it succeeds, and a node that keeps failing rests longer each time."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
from readnodes import ReadNodes, block_key

from kvstore.blockstore import noderests
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.records import BlockLocation

SIZE = 100_000
TIMEOUT_S = 2.0


@pytest.fixture
def tier(tmp_path) -> Iterator[ReadNodes]:  # type: ignore[no-untyped-def]
    os.chmod(tmp_path, 0o700)
    nodes = ReadNodes(tmp_path / "nodes")
    nodes.put([block_key("t", i) for i in range(12)], SIZE)
    yield nodes
    nodes.close()


def _read(tier: ReadNodes, reader: DirectReader) -> tuple[list[bool], float]:
    """Every block of the lease, checked against what was put; and the seconds it took."""
    blocks: list[BlockLocation] = [tier.locations[block_key("t", i)] for i in range(12)]
    out = np.zeros(len(blocks) * SIZE, np.uint8)
    started = time.monotonic()
    ok = reader.read_into(tier.capability(blocks), blocks, out)
    took = time.monotonic() - started
    for b, block in enumerate(blocks):
        if ok[b]:
            assert np.array_equal(out[b * SIZE : (b + 1) * SIZE], tier.payloads[block.key])
    return ok, took


def _until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def test_a_node_that_failed_a_read_is_not_waited_on_again_until_it_answers_a_dial(
    tier: ReadNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(noderests, "REST_S", 0.2)
    victim = tier.locations[block_key("t", 0)].placement[0]  # a data shard of every read
    frozen = socket.create_server(("127.0.0.1", 0))  # the kernel accepts, nobody answers
    endpoints = {**tier.endpoints, victim: frozen.getsockname()[:2]}
    reader = DirectReader(endpoints, 10, 2, timeout_s=TIMEOUT_S)
    links = reader._links
    try:
        # The first read gives up on it once the others are in (``Stragglers``), not at its
        # deadline, and its blocks come from parity.
        ok, took = _read(tier, reader)
        assert ok == [True] * 12 and took < TIMEOUT_S
        assert reader.counters["nodes_hedged"] == 1
        assert reader.counters["node_failures"] == 1 and victim in links.resting()

        ok, took = _read(tier, reader)  # resting: not asked, its blocks from parity at once
        assert ok == [True] * 12 and took < TIMEOUT_S
        assert reader.counters["node_failures"] == 1  # nothing asked of it, nothing failed

        # Its host cut off: nothing answers its dial. Its rest ends, its background dial
        # fails, and it rests again (the reads meanwhile never ask it).
        frozen.close()
        links.endpoints[victim] = ("127.0.0.1", _closed_port())
        _until(lambda: victim in links.resting() and links.rests._strikes.get(victim, 0) >= 2)
        ok, took = _read(tier, reader)
        assert ok == [True] * 12 and took < TIMEOUT_S
        assert reader.counters["nodes_back"] == 0

        # Back: its real socket answers the next background dial, and reads ask it again:
        # every block from its data shards, none decoded.
        links.endpoints[victim] = tier.endpoints[victim]
        _until(lambda: victim not in links.resting())
        decoded = reader.counters["decoded_blocks"]
        ok, _ = _read(tier, reader)
        assert ok == [True] * 12 and reader.counters["decoded_blocks"] == decoded
        assert reader.counters["nodes_back"] == 1 and victim not in links.rests._strikes
    finally:
        frozen.close()
        reader.close()


def test_a_node_that_keeps_failing_rests_longer_each_time(
    tier: ReadNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen, it still takes a dial (the kernel accepts): back after each rest, it fails the
    next read again, and each rest is twice the last, up to ``REST_MAX_S``."""
    monkeypatch.setattr(noderests, "REST_S", 0.1)
    monkeypatch.setattr(noderests, "REST_MAX_S", 0.4)
    victim = tier.locations[block_key("t", 0)].placement[0]
    frozen = socket.create_server(("127.0.0.1", 0))
    reader = DirectReader(
        {**tier.endpoints, victim: frozen.getsockname()[:2]}, 10, 2, timeout_s=0.3
    )
    links = reader._links
    rests: list[float] = []
    try:
        for _ in range(4):
            _until(lambda: victim not in links.resting())
            ok, _ = _read(tier, reader)
            assert ok == [True] * 12
            assert victim in links.rests._resting
            rests.append(links.rests._resting[victim].until - time.monotonic())
        assert [round(r, 1) for r in rests] == [0.1, 0.2, 0.4, 0.4], rests
    finally:
        frozen.close()
        reader.close()


def test_with_more_nodes_resting_than_parity_every_node_is_asked(tier: ReadNodes) -> None:
    """Three nodes rest (m = 2): a stall of the reader's own is likelier than three nodes
    gone, so the read asks them all rather than miss every block."""
    reader = DirectReader(tier.endpoints, 10, 2, timeout_s=TIMEOUT_S)
    try:
        for node in list(tier.endpoints)[:3]:
            reader._links._failed(node)
        assert len(reader._links.resting()) == 3
        ok, _ = _read(tier, reader)
        assert ok == [True] * 12
    finally:
        reader.close()


def _closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (a dial to it is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
