"""The engine's fetcher process reading a load straight from the storage nodes: a real gateway
and deployment on the session Ray cluster, a real fetcher process with a gRPC reader, a real
staging area. A load carrying its lease's read grant stages exactly the stored bytes without a
GetBlocks; a block the nodes cannot serve is read through the gateway; a fetcher that reaches
no node reads everything through the gateway, and says so once."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.api.client import ClientFactory, KVStoreClient
from kvstore.api.server import ServerOptions
from kvstore.engine.directfetch import DirectBlocks
from kvstore.engine.fetcher import Fetcher, FetchJob, run_job
from kvstore.engine.kvlayout import KVLayout
from kvstore.engine.sharedkv import SharedKV
from kvstore.engine.staging import OK, StageLayout, StagingArea
from kvstore.keys import BLOCK_TOKENS, block_keys
from kvstore.runtime.service import RunningService, embedded_service
from kvstore.tier.records import DirectGrant, HitAnswer, HitRequest, Layout

TOKEN = "direct-fetch-token-0123456789"
LAYERS = (16 * 1024, 16 * 1024, 8 * 1024, 24 * 1024)
LAYOUT = Layout(b"direct-fetch-model", sum(LAYERS))
#: Blocks of a load big enough that each node's reply spans several of the reader's turns.
MANY = 400


@pytest.fixture(scope="module")
def running(ray_cluster, tmp_path_factory) -> Iterator[RunningService]:  # type: ignore[no-untyped-def]
    with embedded_service(
        tmp_path_factory.mktemp("direct-fetch"),
        cluster=ray_cluster,
        deployment="direct-fetch-test",
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN, max_message_bytes=8 * 1024 * 1024),
    ) as service:
        yield service


@pytest.fixture()
def factory(running: RunningService) -> ClientFactory:
    return ClientFactory(running.address, token=TOKEN, layout=LAYOUT)


@pytest.fixture()
def area() -> Iterator[StagingArea]:
    with StagingArea(64 << 20) as staging:
        yield staging


def _hit(factory: ClientFactory, seed: int, blocks: int) -> tuple[HitAnswer, list[bytes]]:
    """``blocks`` stored blocks and a lease on them asked for directly: (answer, payloads)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 100_000, blocks * BLOCK_TOKENS + 50)
    keys = block_keys(LAYOUT.fingerprint, tokens)
    payloads = [rng.bytes(LAYOUT.block_bytes) for _ in keys]
    with factory() as client:
        for at in range(0, len(keys), 64):  # within the gateway's message bound
            chunk = slice(at, at + 64)
            assert client.put_blocks(keys[chunk], payloads[chunk]).committed == len(keys[chunk])
        answer = client.query_hit(
            HitRequest(block_keys=keys, prompt_len=len(tokens), mode="full-attention", direct=True)
        )
    assert answer.direct is not None and len(answer.direct) == blocks
    return answer, payloads


def _staged(fetcher: Fetcher, answer: HitAnswer, grant: DirectGrant | None) -> list[bytes | None]:
    """Each block as staged (rebuilt from the layer-major region), None where it failed."""
    staged = fetcher.submit(list(answer.hit_block_keys), lease_id=answer.lease_id, direct=grant)
    assert staged.wait_finished(60) and staged.failure is None
    region, ok = staged.region(), staged.block_ok()
    out: list[bytes | None] = []
    for b in range(len(answer.hit_block_keys)):
        if not ok[b]:
            out.append(None)
            continue
        parts = [staged.layout.blocks_view(region, layer)[b].tobytes() for layer in range(4)]
        out.append(b"".join(parts))
    staged.release()
    return out


def _engine_reads(running: RunningService) -> int:
    import ray

    nodes = running.service.blocks.nodes.values()
    stats = ray.get([node.stats.remote() for node in nodes], timeout=30)
    return sum(int(s["engine_reads"].get("served", 0)) for s in stats)


def _lease_open(running: RunningService, lease_id: str) -> bool:
    return running.tier.lease_tag(lease_id) is not None


def test_a_load_with_a_grant_stages_the_stored_bytes_from_the_nodes(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    answer, payloads = _hit(factory, 1, 6)
    assert answer.lease_id
    served = _engine_reads(running)
    with Fetcher(factory, area, KVLayout.blocks_only(list(LAYERS))) as fetcher:
        assert _staged(fetcher, answer, answer.direct) == payloads
        assert fetcher.read_path is not None and fetcher.read_path.startswith("direct")
    assert _engine_reads(running) >= served + 6 * 10  # every data shard came from a node
    deadline = time.monotonic() + 10
    while _lease_open(running, answer.lease_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _lease_open(running, answer.lease_id)  # given back once staged


def test_a_load_given_rows_lands_each_block_in_the_shared_kv_rows_from_the_nodes(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    """A CPU engine's load with its cache in shared memory: the read grant's shards go from
    the nodes' sockets straight into the request's rows, each block in the row it names (not
    in order), and no other row changes."""
    torch = pytest.importorskip("torch")
    answer, payloads = _hit(factory, 11, 6)
    rng = np.random.default_rng(11)
    cache = [torch.from_numpy(rng.integers(0, 256, (16, n), dtype=np.uint8)) for n in LAYERS]
    before = [t.clone() for t in cache]
    shared = SharedKV.move(cache)
    rows = [9, 2, 14, 5, 0, 7]
    served = _engine_reads(running)
    try:
        with Fetcher(factory, area, KVLayout.blocks_only(list(LAYERS)), shared=shared) as fetcher:
            staged = fetcher.submit(
                list(answer.hit_block_keys),
                lease_id=answer.lease_id,
                direct=answer.direct,
                rows=rows,
            )
            assert staged.wait_finished(60) and staged.failure is None
            assert bool(staged.block_ok().all())
            assert fetcher.read_path is not None and fetcher.read_path.startswith("direct")
            staged.release()
    finally:
        shared.close()
    assert _engine_reads(running) >= served + 6 * 10  # every data shard came from a node
    at = 0
    for layer, nbytes in enumerate(LAYERS):
        expected = before[layer].clone()
        for block, row in enumerate(rows):
            expected[row] = torch.frombuffer(
                bytearray(payloads[block][at : at + nbytes]), dtype=torch.uint8
            )
        assert torch.equal(cache[layer], expected), f"layer {layer}"
        at += nbytes


def _run_in_process(
    factory: ClientFactory, area: StagingArea, answer: HitAnswer, grant: DirectGrant
) -> tuple[list[bytes | None], list[tuple[str, int, int]]]:
    """The fetcher's job run in this process (so its reader's counters can be watched):
    each block as staged (None: failed) and, per announcement, (what, layer, bytes the
    reader had received by then)."""
    kv = KVLayout.blocks_only(list(LAYERS))
    keys = tuple(answer.hit_block_keys)
    layout = StageLayout.plan(kv, len(keys), False)
    region = area.allocate(layout.total_bytes)
    view = area.view(region)
    layout.header(view).initialise(1)
    direct = DirectBlocks(tls=None)
    told: list[tuple[str, int, int]] = []

    def announce(what: str, job: int, *layer: int) -> None:
        told.append((what, layer[0] if layer else -1, direct.counters.get("bytes_received", 0)))

    job = FetchJob(
        1, region.offset, region.nbytes, kv, keys, answer.lease_id, direct=grant, by_layer=True
    )
    try:
        with factory() as reader:
            run_job(job, view, reader, None, announce, direct)
        ok = layout.header(view).block_status() == OK
        staged = [
            b"".join(layout.blocks_view(view, layer)[b].tobytes() for layer in range(4))
            if ok[b]
            else None
            for b in range(len(keys))
        ]
    finally:
        direct.close()
        area.free(region)
    return staged, told


def test_layers_are_handed_on_while_the_later_ones_are_still_on_the_wire(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    # Each node's reply must outlast a turn or two of the reader (it takes each ready node
    # in turn, ~512 KiB a time), or every reply could be taken whole before any layer is.
    answer, payloads = _hit(factory, 6, MANY)
    assert answer.direct is not None
    staged, told = _run_in_process(factory, area, answer, answer.direct)
    assert staged == payloads
    layers = [(layer, received) for what, layer, received in told if what == "layer"]
    assert [layer for layer, _ in layers] == [0, 1, 2, 3]
    total = told[-1][2]
    # Layer 0 is the first quarter of each block: published once shards 0-2 of 10 are in,
    # before the reader has taken the later ones.
    assert layers[0][1] < 0.7 * total, (layers, total)


def test_a_block_that_stops_arriving_after_its_first_layers_is_a_miss(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    """Block 3's shard 8 has no node to ask: its first layers were handed on with the
    others', so it is failed (the engine recomputes it), not read again through the gateway
    under a reader that may be copying it."""
    answer, payloads = _hit(factory, 7, MANY)
    grant = answer.direct
    assert grant is not None
    placements = grant.placements.copy()
    placements[3, 8] = -1
    staged, told = _run_in_process(
        factory, area, answer, dataclasses.replace(grant, placements=placements)
    )
    assert staged == [p if b != 3 else None for b, p in enumerate(payloads)]
    layers = [received for what, _, received in told if what == "layer"]
    assert layers[0] < told[-1][2]  # layer 0 went out before the read ended


def test_a_block_the_nodes_cannot_serve_comes_through_the_gateway(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    answer, payloads = _hit(factory, 2, 5)
    grant = answer.direct
    assert grant is not None
    placements = grant.placements.copy()
    placements[2] = -1  # no node to ask for block 2: a miss on the direct path
    broken = dataclasses.replace(grant, placements=placements)
    with Fetcher(factory, area, KVLayout.blocks_only(list(LAYERS))) as fetcher:
        assert _staged(fetcher, answer, broken) == payloads


def test_a_fetcher_that_reaches_no_node_reads_through_the_gateway(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    answer, payloads = _hit(factory, 3, 4)
    grant = answer.direct
    assert grant is not None
    closed = {node: ("127.0.0.1", 1) for node in grant.endpoints}  # nothing listens there
    nowhere = dataclasses.replace(grant, endpoints=closed)
    served = _engine_reads(running)
    with Fetcher(factory, area, KVLayout.blocks_only(list(LAYERS))) as fetcher:
        assert _staged(fetcher, answer, nowhere) == payloads
        assert fetcher.read_path is not None and "through the gateway" in fetcher.read_path
        again, more = _hit(factory, 4, 3)
        assert _staged(fetcher, again, again.direct) == more  # the choice holds
    assert _engine_reads(running) == served


def test_a_load_without_a_grant_reads_through_the_gateway(
    running: RunningService, factory: ClientFactory, area: StagingArea
) -> None:
    answer, payloads = _hit(factory, 5, 3)
    with Fetcher(factory, area, KVLayout.blocks_only(list(LAYERS))) as fetcher:
        assert _staged(fetcher, answer, None) == payloads
        assert fetcher.read_path is None


def test_the_client_reads_its_own_grant(running: RunningService) -> None:
    with KVStoreClient(running.address, token=TOKEN) as client:
        keys = block_keys(running.tier.model_fingerprint, np.arange(BLOCK_TOKENS * 2 + 10))
        answer = client.query_hit(HitRequest(block_keys=keys, prompt_len=2 * BLOCK_TOKENS + 10))
        assert answer.direct is None  # not asked for


def test_a_probe_reads_one_block_of_a_grant_whole_or_says_the_nodes_are_out_of_reach(
    factory: ClientFactory,
) -> None:
    """``DirectBlocks.read_whole``, what a fresh engine's load probe times: one block of the
    grant read from the nodes; None where this process reaches no node."""
    answer, _ = _hit(factory, 8, 3)
    grant = answer.direct
    assert grant is not None
    reader = DirectBlocks(tls=None)
    try:
        assert reader.read_whole(grant.part(0, 1), LAYOUT.block_bytes) is True
        assert reader.read_whole(grant.part(0, 1), LAYOUT.block_bytes + 1) is False
    finally:
        reader.close()
    nowhere = DirectBlocks(tls=None)
    closed = {node: ("127.0.0.1", 1) for node in grant.endpoints}
    assert nowhere.read_whole(dataclasses.replace(grant, endpoints=closed), 64) is None
