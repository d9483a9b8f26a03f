"""QueryHit's direct read grant, end to end: a real gateway in front of a real deployment on
the session Ray cluster. A lease asked for ``direct``ly comes with its read capability, the
stored keys, placements and sizes of the hit blocks and the nodes' read sockets; with them an
engine reads exactly the leased blocks straight from the nodes, and nothing once the lease is
released (ReleaseLease, or the read through the gateway that ends it)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.api.client import KVStoreClient
from kvstore.api.server import ServerOptions
from kvstore.blockstore.capability import ReadCapability
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.records import BlockLocation
from kvstore.engine.directfetch import DirectBlocks
from kvstore.engine.probe import LoadProbe
from kvstore.keys import block_keys
from kvstore.runtime.service import RunningService, embedded_service
from kvstore.tier.records import DirectGrant, HitRequest

TOKEN = "direct-token-0123456789"


@pytest.fixture(scope="module")
def running(ray_cluster, tmp_path_factory) -> Iterator[RunningService]:  # type: ignore[no-untyped-def]
    with embedded_service(
        tmp_path_factory.mktemp("direct-grants"),
        cluster=ray_cluster,
        deployment="direct-grants-test",
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN, max_message_bytes=8 * 1024 * 1024),
    ) as service:
        yield service


@pytest.fixture()
def client(running: RunningService) -> Iterator[KVStoreClient]:
    with KVStoreClient(running.address, token=TOKEN) as value:
        yield value


def _stored(running: RunningService, client: KVStoreClient, seed: int, blocks: int):  # type: ignore[no-untyped-def]
    """A prompt of ``blocks`` full blocks and a tail, its blocks stored: tokens, keys, payloads."""
    tokens = np.random.default_rng(seed).integers(0, 128_000, 128 * blocks + 50, dtype=np.uint32)
    keys = block_keys(running.tier.model_fingerprint, tokens)
    rng = np.random.default_rng(seed + 1)
    payloads = [rng.bytes(running.tier.block_bytes) for _ in keys]
    assert client.put_blocks(keys, payloads).committed == len(keys)
    return tokens, keys, payloads


def _read(
    grant: DirectGrant, blocks: list[BlockLocation] | None = None
) -> tuple[list[bool], bytes]:
    reader = DirectReader(grant.endpoints, grant.k, grant.m, timeout_s=10.0)
    try:
        chosen = blocks or [BlockLocation(*block) for block in grant.blocks()]
        out = bytearray(sum(block.size for block in chosen))
        found = reader.read_into(ReadCapability.decode(grant.capability), chosen, out)
        return found, bytes(out)
    finally:
        reader.close()


def _refused_soon(grant: DirectGrant) -> bool:
    """Whether the nodes refuse ``grant`` within a few seconds (revocations go out in the
    background, batched: a release returns before the nodes know)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        found, _ = _read(grant)
        if not any(found):
            return True
        time.sleep(0.05)
    return False


def test_a_direct_grant_reads_exactly_the_leased_blocks(
    running: RunningService, client: KVStoreClient
) -> None:
    tokens, keys, payloads = _stored(running, client, 21, 10)
    answer = client.query_hit(HitRequest(token_ids=tokens.tolist(), direct=True))
    hits = len(answer.hit_block_keys)
    # The lease holds the 9 blocks within the cap; the 9th is recomputed (no SWA state).
    assert answer.lease_id and hits == 8
    grant = answer.direct
    assert grant is not None and len(grant) == hits
    assert sorted(grant.endpoints) == list(range(12)) and (grant.k, grant.m) == (10, 2)
    capability = ReadCapability.decode(grant.capability)
    assert capability.lease_id == answer.lease_id
    # The cluster key never leaves the cluster: the grant's bytes do not contain it.
    assert running.service.blocks.read_key() not in grant.capability

    found, out = _read(grant)
    assert found == [True] * hits
    assert out == b"".join(payloads[:hits])

    # A block the lease does not hold (stored, under a key of the same namespace) is refused.
    other_tokens, _, _ = _stored(running, client, 23, 3)
    other = client.query_hit(HitRequest(token_ids=other_tokens.tolist(), direct=True))
    assert other.direct is not None and len(other.direct)
    stranger = BlockLocation(*other.direct.blocks()[0])
    mixed = [BlockLocation(*grant.blocks()[0]), stranger]
    found, _ = _read(grant, mixed)
    assert found == [True, False]

    assert client.release_lease(answer.lease_id)
    assert _refused_soon(grant)
    # The other lease is not touched by this one's release.
    assert _read(other.direct)[0] == [True] * len(other.direct)
    assert client.release_lease(other.lease_id or "")
    assert _refused_soon(other.direct)


def test_a_read_through_the_gateway_ends_the_grant(
    running: RunningService, client: KVStoreClient
) -> None:
    tokens, keys, payloads = _stored(running, client, 31, 4)
    answer = client.query_hit(HitRequest(token_ids=tokens.tolist(), direct=True))
    assert answer.direct is not None and answer.lease_id
    reads = client.get_blocks(list(answer.hit_block_keys), lease_id=answer.lease_id)
    assert [read.payload for read in reads] == payloads[: len(reads)]
    assert _refused_soon(answer.direct)


def test_no_grant_unless_asked(running: RunningService, client: KVStoreClient) -> None:
    tokens, _, _ = _stored(running, client, 41, 3)
    answer = client.query_hit(HitRequest(token_ids=tokens.tolist()))
    assert answer.lease_id and answer.direct is None
    assert client.release_lease(answer.lease_id)
    unleased = client.query_hit(
        HitRequest(token_ids=tokens.tolist(), take_lease=False, direct=True)
    )
    assert unleased.lease_id is None and unleased.direct is None


def test_a_load_probe_reads_one_leased_block_from_the_nodes_and_leaves_the_lease_to_the_load(
    running: RunningService, client: KVStoreClient
) -> None:
    """A fresh engine's probe (``kvstore.engine.probe``) with the fetcher's own direct reader:
    one block, from the nodes (the gateway is not asked), and the lease still serves the load
    that follows, every block of it."""
    tokens, keys, payloads = _stored(running, client, 51, 6)
    answer = client.query_hit(HitRequest(token_ids=tokens.tolist(), direct=True))
    assert answer.direct is not None and answer.lease_id
    gateway_reads: list[int] = []

    class Gateway:
        def get_blocks(self, keys, lease_id=None, *, keep_lease=False):  # type: ignore[no-untyped-def]
            gateway_reads.append(len(keys))
            return client.get_blocks(keys, lease_id)

    direct = DirectBlocks()
    probe = LoadProbe(Gateway(), running.tier.block_bytes, direct=direct)  # type: ignore[arg-type]
    try:
        nbytes, seconds = probe(answer, 30.0) or (0, 0.0)
    finally:
        probe.close()
    assert nbytes == running.tier.block_bytes and 0 < seconds < 30.0
    assert direct.enabled and gateway_reads == []
    found, out = _read(answer.direct)
    assert found == [True] * len(answer.direct) and out == b"".join(payloads[: len(found)])
    assert client.release_lease(answer.lease_id)
