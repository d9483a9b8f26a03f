"""Engines read a lease's shards straight from the storage nodes with a read capability (issue
32): what that socket must refuse, against real storage nodes (segment files on disk) and their
real engine read sockets on 127.0.0.1 (``tests/readnodes.py``); only the clock is a fake, moved
to pass a lease's end.

An engine holds a tenant's token and, per lease, a capability; never a node's key or the read
key. Each test is the attack it guards against, with the check that stops it named; run with
the check removed, each fails (the report of issue 32 lists the mutations and their failures).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
from readnodes import NOW, ReadNodes, block_key

from kvstore import wire
from kvstore.blockstore import readproto as proto
from kvstore.blockstore import readserver
from kvstore.blockstore.capability import ReadCapability, mint
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.readserver import EngineReadServer
from kvstore.blockstore.records import BlockLocation
from kvstore.errors import ConfigError
from kvstore.fastcall.client import FastChannel
from kvstore.fastcall.frames import FastConnection, wait_ready
from kvstore.fastcall.handshake import MAGIC, proof
from kvstore.fastcall.server import UNAUTHENTICATED_S, FastCallServer
from kvstore.runtime.blockstore_actors import NODE_FAST_NAMES

SIZE = 64 * 1024


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadNodes]:
    root = tmp_path_factory.mktemp("readcap")
    os.chmod(root, 0o700)
    nodes = ReadNodes(root / "nodes")
    nodes.put([block_key("alice", i) for i in range(12)], SIZE, seed=0)
    nodes.put([block_key("bob", i) for i in range(12)], SIZE, seed=5)
    yield nodes
    nodes.close()


def _blocks(tier: ReadNodes, tenant: str) -> list[BlockLocation]:
    return [tier.locations[block_key(tenant, i)] for i in range(12)]


def _request(capability: bytes, keys: list[bytes], op: int = proto.OP_READ) -> bytes:
    body = proto.REQUEST.pack(proto.REQUEST_MAGIC, op, proto.VERSION, 0, len(capability), len(keys))
    body += capability + b"".join(keys)
    return struct.pack(">I", len(body)) + body


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise EOFError("the node hung up")
        data += more
    return data


class Reply:
    def __init__(self, sock: socket.socket) -> None:
        (frame,) = struct.unpack(">I", _read_exact(sock, 4))
        body = _read_exact(sock, frame)
        magic, self.refusal, self.prefix, count, self.data_bytes = proto.REPLY.unpack_from(body)
        assert magic == proto.REPLY_MAGIC
        at = proto.REPLY.size
        self.statuses = [proto.NAMES[s] for s in body[at : at + count]]
        at += proto.padded(count)
        self.lengths = np.frombuffer(body, "<u4", count, at).tolist()
        self.data = body[at + 4 * count :]
        assert len(self.data) == self.data_bytes


def _ask(
    tier: ReadNodes, node: int, capability: bytes, keys: list[bytes], op: int = proto.OP_READ
) -> Reply:
    with socket.create_connection(tier.servers[node].endpoint, timeout=5) as sock:
        sock.sendall(_request(capability, keys, op))
        return Reply(sock)


def _keys_on(blocks: list[BlockLocation], node: int) -> list[bytes]:
    return [block.key for block in blocks if node in block.placement]


def _hung_up(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_a_capability_reads_exactly_its_leases_shards_and_the_bytes_are_right(
    tier: ReadNodes,
) -> None:
    lease = _blocks(tier, "alice")[:6]
    capability = tier.capability(lease)
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(lease) * SIZE, np.uint8)
    assert reader.read_into(capability, lease, out) == [True] * len(lease)
    for b, block in enumerate(lease):
        assert np.array_equal(out[b * SIZE : (b + 1) * SIZE], tier.payloads[block.key])
    # The same capability, asked for blocks outside its lease on the same node: refused,
    # nothing served (check: each asked key must be in the node's part).
    outside = _keys_on(_blocks(tier, "alice")[6:], 0)
    inside = _keys_on(lease, 0)
    reply = _ask(tier, 0, capability.for_node(0).encode(), [*inside, *outside])
    assert reply.statuses == ["ok"] * len(inside) + ["other_shard"] * len(outside)
    assert reply.lengths[len(inside) :] == [0] * len(outside)
    shard_len = reply.lengths[0]
    assert reply.data_bytes == (reply.prefix + shard_len) * len(inside)


def test_a_forged_capability_is_refused_and_nothing_served(tier: ReadNodes) -> None:
    lease = _blocks(tier, "alice")
    keys = _keys_on(lease, 0)
    # Minted under a key the engine made up (check: the part's MAC under the read key).
    forged = tier.capability(lease, key=os.urandom(32)).for_node(0).encode()
    before = tier.servers[0].stats().get("refused_forged", 0)
    reply = _ask(tier, 0, forged, keys)
    assert reply.statuses == ["forged"] * len(keys) and reply.data_bytes == 0
    assert tier.servers[0].stats()["refused_forged"] == before + len(keys)
    # A real capability with one more key written into the node's part.
    real = tier.capability(lease[:1]).for_node(lease[0].placement[0])
    grant = real.grants[lease[0].placement[0]]
    widened = ReadCapability(
        real.lease_id,
        real.tenant,
        real.expires,
        {lease[0].placement[0]: type(grant)(tuple(sorted({*grant.keys, lease[1].key})), grant.mac)},
    )
    node = lease[0].placement[0]
    reply = _ask(tier, node, widened.encode(), [lease[1].key])
    assert reply.statuses == ["forged"] and reply.data_bytes == 0
    reader = DirectReader(tier.endpoints, 10, 2)
    out = np.zeros(len(lease) * SIZE, np.uint8)
    assert reader.read_into(tier.capability(lease, key=os.urandom(32)), lease, out) == [
        False
    ] * len(lease)
    assert not out.any()


def test_an_expired_capability_is_refused(tier: ReadNodes) -> None:
    lease = _blocks(tier, "alice")
    capability = tier.capability(lease, seconds=5)
    keys = _keys_on(lease, 2)
    assert _ask(tier, 2, capability.for_node(2).encode(), keys).statuses == ["ok"] * len(keys)
    tier.clock.advance(5.5)  # past the lease's end on the nodes' clock
    reply = _ask(tier, 2, capability.for_node(2).encode(), keys)
    assert reply.statuses == ["expired"] * len(keys) and reply.data_bytes == 0


def test_a_capability_for_another_node_is_refused(tier: ReadNodes) -> None:
    lease = _blocks(tier, "alice")
    part = tier.capability(lease).for_node(3).encode()
    keys = _keys_on(lease, 4)  # node 4's shards, with node 3's part
    reply = _ask(tier, 4, part, keys)
    assert reply.statuses == ["other_node"] * len(keys) and reply.data_bytes == 0


def test_another_tenants_capability_reads_none_of_this_tenants_shards(tier: ReadNodes) -> None:
    bob = tier.capability(_blocks(tier, "bob"), lease_id="bob-lease", tenant="bob")
    for node in range(tier.count):
        alice_keys = _keys_on(_blocks(tier, "alice"), node)
        reply = _ask(tier, node, bob.for_node(node).encode(), alice_keys)
        assert reply.statuses == ["other_shard"] * len(alice_keys) and reply.data_bytes == 0
    reader = DirectReader(tier.endpoints, 10, 2)
    alice = _blocks(tier, "alice")
    out = np.zeros(len(alice) * SIZE, np.uint8)
    assert reader.read_into(bob, alice, out) == [False] * len(alice)
    assert not out.any()


def test_a_capability_replayed_after_its_lease_was_released_is_refused(tier: ReadNodes) -> None:
    lease = _blocks(tier, "alice")
    capability = tier.capability(lease, lease_id="released-lease")
    keys = _keys_on(lease, 5)
    assert _ask(tier, 5, capability.for_node(5).encode(), keys).statuses == ["ok"] * len(keys)
    for revocations in tier.revocations:  # what the tier's release does, through the actors
        revocations.revoke(["released-lease"], capability.expires, tier.clock.now())
    reply = _ask(tier, 5, capability.for_node(5).encode(), keys)
    assert reply.statuses == ["revoked"] * len(keys) and reply.data_bytes == 0


def test_a_part_proven_on_a_connection_is_still_checked_for_its_end_and_release_there(
    tier: ReadNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node proves a connection's capability part once (decode, MAC) and then compares the
    bytes presented with it (``readserver._Proven``); what it must not skip on that
    connection: the lease's end and its release (check: ``check_current`` every request), and
    the MAC of any other part presented there (check: the whole part's bytes are compared)."""
    proofs = []
    real_check = readserver.check_grant
    monkeypatch.setattr(
        readserver, "check_grant", lambda *args: proofs.append(1) or real_check(*args)
    )
    lease = _blocks(tier, "alice")
    node = 11
    keys = _keys_on(lease, node)
    ending = tier.capability(lease, lease_id="ending-lease", seconds=5).for_node(node)
    released = tier.capability(lease, lease_id="released-on-conn").for_node(node)
    grant = released.grants[node]
    widened = ReadCapability(
        released.lease_id,
        released.tenant,
        released.expires,
        {node: type(grant)(tuple(sorted({*grant.keys, _blocks(tier, "bob")[0].key})), grant.mac)},
    )
    with socket.create_connection(tier.servers[node].endpoint, timeout=5) as sock:

        def ask(part: ReadCapability, asked: list[bytes]) -> Reply:
            sock.sendall(_request(part.encode(), asked))
            return Reply(sock)

        assert ask(ending, keys).statuses == ["ok"] * len(keys)
        assert ask(ending, keys).statuses == ["ok"] * len(keys)
        assert len(proofs) == 1  # proven once on this connection, not per request
        assert ask(released, keys).statuses == ["ok"] * len(keys)
        assert len(proofs) == 2  # another part: proven on its own
        reply = ask(widened, [_blocks(tier, "bob")[0].key])
        assert reply.statuses == ["forged"] and reply.data_bytes == 0
        for revocations in tier.revocations:
            revocations.revoke(["released-on-conn"], released.expires, tier.clock.now())
        reply = ask(released, keys)
        assert reply.statuses == ["revoked"] * len(keys) and reply.data_bytes == 0
        assert ask(ending, keys).statuses == ["ok"] * len(keys)
        tier.clock.advance(5.5)  # past the end of "ending-lease"
        reply = ask(ending, keys)
        assert reply.statuses == ["expired"] * len(keys) and reply.data_bytes == 0


def test_a_request_without_a_capability_is_refused_and_the_peer_dropped(tier: ReadNodes) -> None:
    keys = _keys_on(_blocks(tier, "alice"), 6)
    with socket.create_connection(tier.servers[6].endpoint, timeout=5) as sock:
        sock.sendall(_request(b"", keys))
        reply = Reply(sock)
        assert reply.statuses == ["malformed"] * len(keys) and reply.data_bytes == 0
        assert _hung_up(sock, 2.0)


def test_a_socket_that_presents_nothing_is_served_nothing_and_let_go(tier: ReadNodes) -> None:
    with socket.create_connection(tier.servers[7].endpoint, timeout=5) as sock:
        assert _hung_up(sock, UNAUTHENTICATED_S + 2.0)


@pytest.mark.parametrize("op", [0, 2, 3, 255])
def test_the_socket_has_no_other_operation(tier: ReadNodes, op: int) -> None:
    """No put, delete or any other method exists on it: a frame naming another operation,
    even with a valid capability, drops the peer unanswered."""
    lease = _blocks(tier, "alice")
    part = tier.capability(lease).for_node(8).encode()
    keys = _keys_on(lease, 8)
    before = [tier.nodes[8].holds(keys)]
    with socket.create_connection(tier.servers[8].endpoint, timeout=5) as sock:
        sock.sendall(_request(part, keys, op=op))
        with pytest.raises(EOFError):
            Reply(sock)
    assert [tier.nodes[8].holds(keys)] == before


def test_a_fastcall_frame_is_not_a_call_here(tier: ReadNodes) -> None:
    """What a node's fastcall socket takes (``("delete", (keys,))``), sent to the engine
    socket: dropped, nothing deleted."""
    keys = _keys_on(_blocks(tier, "alice"), 9)
    frame = b"".join(bytes(memoryview(p).cast("B")) for p in wire.encode(("delete", (keys,))))
    with socket.create_connection(tier.servers[9].endpoint, timeout=5) as sock:
        sock.sendall(struct.pack(">I", len(frame)) + frame)
        assert _hung_up(sock, 2.0)
    assert all(tier.nodes[9].holds(keys))


def test_the_nodes_fastcall_socket_still_needs_the_node_key(tier: ReadNodes) -> None:
    """An engine holding a valid capability (and no node key) gets nothing from the actor's
    own socket, where put and delete are: its answer to the key challenge, made with what it
    has, is refused and its delete never runs."""
    node = tier.nodes[10]
    server = FastCallServer(node, NODE_FAST_NAMES, tier.locks[10])
    try:
        host, port, _ = server.endpoint
        keys = _keys_on(_blocks(tier, "alice"), 10)
        capability = tier.capability(_blocks(tier, "alice")).for_node(10).encode()
        for guess in (capability[-32:], os.urandom(32)):
            with socket.create_connection((host, port), timeout=5) as sock:
                conn = FastConnection(sock)
                hello = conn.recv_frame(64)
                nonces = (bytes(hello[len(MAGIC) :]), os.urandom(32))
                conn.send_frame([nonces[1] + proof(guess, b"client", nonces, host, port)])
                conn.send_frame(wire.encode(("delete", (keys,))))
                with pytest.raises((EOFError, ConnectionError)):
                    conn.recv_frame(1 << 20, time.monotonic() + 5)
        assert all(node.holds(keys))
        # The node key does work there: the socket is what it was.
        channel = FastChannel(server.endpoint)
        try:
            call = channel.start("holds", (keys,))
            assert wait_ready([call], 10.0) == [call]
            assert channel.finish(call) == [True] * len(keys)
        finally:
            channel.close()
    finally:
        server.close()


def test_no_plaintext_beyond_loopback(tier: ReadNodes) -> None:
    """The data plane's rule holds here too (``tls.check_plaintext``): refused before
    anything listens, naming the address."""
    with pytest.raises(ConfigError, match="198.18.0.1"):
        EngineReadServer(
            0, tier.key, tier.nodes[0], tier.locks[0], tier.revocations[0], host="198.18.0.1"
        )


def test_the_read_key_reaches_no_engine_message() -> None:
    """A capability carries MACs made with the key, never the key."""
    key = os.urandom(32)
    data = mint(key, "l", "t", NOW + 30, {0: [block_key("x", 0)]}).encode()
    assert key not in data
