"""Read capabilities (``kvstore.blockstore.capability``): the encoding, its bounds, the MAC, the
expiry and the revocation table."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from kvstore.blockstore.capability import (
    MAX_LEASE_BLOCKS,
    MAX_LIFETIME_S,
    CapabilityRefused,
    ReadCapability,
    Revocations,
    check_grant,
    mint,
    mint_for_lease,
    verify,
)
from kvstore.blockstore.records import Lease
from kvstore.errors import InvalidArgument
from kvstore.keys import key_words

KEY = os.urandom(32)
NOW = 1_700_000_000.0


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _small() -> ReadCapability:
    return mint(KEY, "lease-7", "alice", NOW + 30, {0: [_key(1), _key(2)], 3: [_key(1)]})


def _pairs(capability: ReadCapability) -> set[tuple[int, bytes]]:
    """The (node, block key) pairs ``capability`` lets be read now."""
    allowed = set()
    for node_id, grant in capability.grants.items():
        for key in grant.keys:
            try:
                verify(KEY, capability, node_id, key, NOW)
            except CapabilityRefused:
                continue
            allowed.add((node_id, key))
    return allowed


def test_round_trip_is_canonical_and_every_named_shard_verifies() -> None:
    capability = _small()
    data = capability.encode()
    again = ReadCapability.decode(data)
    assert again.encode() == data
    assert (again.lease_id, again.tenant, again.expires) == ("lease-7", "alice", NOW + 30)
    assert _pairs(again) == {(0, _key(1)), (0, _key(2)), (3, _key(1))}


def test_one_nodes_part_verifies_there_and_nowhere_else() -> None:
    part = ReadCapability.decode(_small().for_node(3).encode())
    verify(KEY, part, 3, _key(1), NOW)
    with pytest.raises(CapabilityRefused) as refused:
        verify(KEY, part, 0, _key(1), NOW)
    assert refused.value.reason == CapabilityRefused.OTHER_NODE
    with pytest.raises(CapabilityRefused) as refused:
        verify(KEY, part, 3, _key(2), NOW)
    assert refused.value.reason == CapabilityRefused.OTHER_SHARD


def test_a_nodes_part_is_made_byte_for_byte_as_its_capabilitys_encoding() -> None:
    # What an engine sends each node (``node_part``) must be the part a node decodes and
    # proves: the canonical encoding of ``for_node``, for a node with a part and one without.
    capability = _small()
    decoded = ReadCapability.decode(capability.encode())  # as an engine has it
    for node_id in (0, 3, 5):
        assert capability.node_part(node_id) == capability.for_node(node_id).encode()
        assert decoded.node_part(node_id) == capability.for_node(node_id).encode()
        assert decoded.node_part(node_id) is decoded.node_part(node_id)  # made once
    assert ReadCapability.decode(capability.node_part(5)).grants == {}


def test_changing_any_byte_lets_nothing_new_be_read() -> None:
    data = _small().encode()
    original = _pairs(ReadCapability.decode(data))
    for at in range(len(data)):
        tampered = bytearray(data)
        tampered[at] ^= 0x01
        try:
            decoded = ReadCapability.decode(bytes(tampered))
        except CapabilityRefused:
            continue
        # Whatever still verifies was in the original, and something no longer does.
        assert _pairs(decoded) < original, f"byte {at}"


def test_a_capability_under_another_key_is_forged() -> None:
    other = mint(os.urandom(32), "lease-7", "alice", NOW + 30, {0: [_key(1)]})
    with pytest.raises(CapabilityRefused) as refused:
        verify(KEY, other, 0, _key(1), NOW)
    assert refused.value.reason == CapabilityRefused.FORGED


def test_expiry_holds_until_its_second_and_not_after() -> None:
    capability = _small()
    verify(KEY, capability, 0, _key(1), NOW + 30)
    with pytest.raises(CapabilityRefused) as refused:
        verify(KEY, capability, 0, _key(1), NOW + 30.001)
    assert refused.value.reason == CapabilityRefused.EXPIRED
    far = mint(KEY, "l", "alice", NOW + MAX_LIFETIME_S + 1, {0: [_key(1)]})
    with pytest.raises(CapabilityRefused, match="minting clock") as refused:
        verify(KEY, far, 0, _key(1), NOW)


def test_a_revoked_lease_is_refused_until_it_would_have_ended() -> None:
    revoked = Revocations()
    capability = _small()
    revoked.revoke(["lease-7"], NOW + 30, NOW)
    with pytest.raises(CapabilityRefused) as refused:
        check_grant(KEY, capability, 0, NOW, revoked)
    assert refused.value.reason == CapabilityRefused.REVOKED
    other = mint(KEY, "lease-8", "alice", NOW + 30, {0: [_key(1)]})
    check_grant(KEY, other, 0, NOW, revoked)
    revoked.revoke([], NOW + 60, NOW + 31)  # past its end: forgotten
    assert len(revoked) == 0


def test_a_full_revocation_table_refuses_more_never_less() -> None:
    revoked = Revocations(limit=2)
    for i, end in enumerate((NOW + 10, NOW + 20, NOW + 30)):
        revoked.revoke([f"lease-{i}"], end, NOW)
    assert len(revoked) == 2
    assert revoked.revoked("lease-0", NOW + 10)  # forgotten, under the floor
    assert revoked.revoked("never-revoked", NOW + 5)  # under the floor too: refused
    assert not revoked.revoked("never-revoked", NOW + 11)
    assert revoked.revoked("lease-1", NOW + 20) and revoked.revoked("lease-2", NOW + 30)


def test_sizes_are_bounded_at_mint_and_at_decode() -> None:
    too_many = [i.to_bytes(32, "big") for i in range(MAX_LEASE_BLOCKS + 1)]
    with pytest.raises(InvalidArgument, match="at most"):
        mint(KEY, "l", "alice", NOW + 30, {0: too_many})
    with pytest.raises(InvalidArgument, match="lease id"):
        mint(KEY, "x" * 200, "alice", NOW + 30, {0: [_key(1)]})
    fits = mint(KEY, "l", "alice", NOW + 30, {0: too_many[:-1]})
    assert len(ReadCapability.decode(fits.encode()).keys_for(0)) == MAX_LEASE_BLOCKS
    # A part claiming more keys than allowed is refused before anything is read for it.
    data = bytearray(fits.encode())
    at = 8 + 8 + 2 + 2 + 4 + 1 + 5  # head, "l", "alice": then node id, key count
    data[at + 4 : at + 8] = (MAX_LEASE_BLOCKS + 1).to_bytes(4, "little")
    with pytest.raises(CapabilityRefused, match="at most"):
        ReadCapability.decode(bytes(data))
    with pytest.raises(CapabilityRefused, match="bytes after"):
        ReadCapability.decode(fits.encode() + b"\0")
    with pytest.raises(CapabilityRefused, match="shorter"):
        ReadCapability.decode(b"")


def test_keys_out_of_order_are_not_canonical() -> None:
    data = bytearray(mint(KEY, "l", "a", NOW + 30, {0: [_key(1), _key(2)]}).encode())
    at = 8 + 8 + 2 + 2 + 4 + 1 + 1 + 8
    first, second = bytes(data[at : at + 32]), bytes(data[at + 32 : at + 64])
    data[at : at + 64] = second + first
    with pytest.raises(CapabilityRefused, match="out of order"):
        ReadCapability.decode(bytes(data))
    data[at : at + 64] = first + first
    with pytest.raises(CapabilityRefused, match="repeated"):
        ReadCapability.decode(bytes(data))


def test_keys_that_end_in_zero_bytes_decode_whole() -> None:
    keys = [bytes(31) + b"\1", b"\7" + bytes(31), bytes(32)]
    capability = mint(KEY, "l", "a", NOW + 30, {4: keys})
    again = ReadCapability.decode(capability.encode())
    assert again.keys_for(4) == tuple(sorted(keys))
    assert again.encode() == capability.encode()


def test_mint_for_lease_names_every_placed_shard() -> None:
    keys = [_key(i) for i in range(3)]
    placements = np.array([[0, 1, 2], [1, 2, -1], [2, 0, 1]], np.int32)
    lease = Lease("lease-9", NOW + 30, key_words(keys), placements, np.full(3, 100, np.int64))
    capability = mint_for_lease(KEY, lease, "bob")
    assert (capability.tenant, capability.expires) == ("bob", NOW + 30)
    assert set(capability.keys_for(0)) == {keys[0], keys[2]}
    assert set(capability.keys_for(1)) == {keys[0], keys[1], keys[2]}
    assert set(capability.keys_for(2)) == {keys[0], keys[1], keys[2]}
    assert capability.shards == 8


def test_a_lease_longer_than_a_node_honours_gets_a_capability_ending_sooner() -> None:
    keys = [_key(0)]
    lease = Lease(
        "long",
        NOW + 2 * MAX_LIFETIME_S,
        key_words(keys),
        np.array([[0]], np.int32),
        np.full(1, 100, np.int64),
    )
    capability = mint_for_lease(KEY, lease, "bob", now=NOW)
    assert capability.expires == NOW + MAX_LIFETIME_S
    verify(KEY, capability, 0, keys[0], NOW)
