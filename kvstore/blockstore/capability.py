"""Read capabilities: what lets an engine read one lease's shards straight from the storage nodes.

The tier grants a lease (QueryHit); with it, it can mint a ``ReadCapability`` naming the lease,
its tenant, its end, and exactly the shards the engine may read: per storage node, the block
keys of the shards that node holds for the lease (a node keeps at most one shard of a block, so
node id + block key names one shard). An engine presents it to a node's engine read socket
(``readserver``) and gets those shards and nothing else: no other key, no other node, no put or
delete (the socket has no such operation), nothing after the lease's end or its release.

**Signed per node.** Each node's part (``NodeGrant``) carries its own HMAC-SHA256 under the
cluster read key, over the canonical bytes of (lease id, tenant, expiry, node id, its keys):
an engine sends each node only that node's part (``for_node``), so a request carries 1/width of
the lease, and a node learns nothing of what the other nodes hold. A part is checked whole (its
MAC) before any key in it counts; one byte changed anywhere, in a field or a key, and it is
refused (``CapabilityRefused``, reason ``FORGED``).

**The read key** is 32 random bytes made when the block tier is deployed
(``kvstore.runtime.deploy``) and held by the storage nodes (they verify) and the in-cluster
processes that mint (the tier, through Ray, as the actors' fastcall keys are handed out). It is
never sent to an engine or a client: what they get is a capability, which only names shards.

**Expiry and clock skew.** ``expires`` is the lease's end on the meta shards' wall clock
(``Lease.until``); a node compares it with its own wall clock and adds no grace. The cluster's
clocks are kept in step (NTP: well under a second, where leases last tens of seconds): a node
whose clock runs ahead refuses a little early (the engine's read is a miss and goes through the
gateway, never wrong bytes), one that runs behind serves at most its skew past the lease's end
(the same shards, to the same tenant). A capability ending more than ``MAX_LIFETIME_S`` from
the node's now is refused too: a tier clock far ahead would otherwise mint keys to the
cluster's data that outlive every revocation the nodes remember.

**Revocation.** A released lease's capability must stop reading at once, not at its end:
the tier tells each node ``revoke(lease_ids, until)`` through the in-cluster actor path, and
``Revocations`` remembers each id until its capability would have ended anyway; bounded in
memory by raising a floor (every capability ending at or before it counts as revoked) instead
of forgetting an id, so a full table refuses more, never less.

Sizes are bounded: a capability names at most ``MAX_LEASE_BLOCKS`` (a 1M-token prompt's blocks)
keys per node and ``MAX_SHARDS`` (those blocks times the widest stripe) in all.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import operator
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from kvstore.ec.shard import MAX_SHARDS as MAX_STRIPE_WIDTH
from kvstore.errors import Forbidden, InvalidArgument
from kvstore.keys import BLOCK_TOKENS, KEY_BYTES

if TYPE_CHECKING:
    from kvstore.blockstore.records import Lease

#: The cluster read key's length (HMAC-SHA256 key).
READ_KEY_BYTES = 32
MAC_BYTES = 32
#: Blocks one lease holds at the most: a 1M-token prompt's (the gateway's ``max_tokens``).
MAX_LEASE_BLOCKS = (1 << 20) // BLOCK_TOKENS
#: Shards a capability names at the most, all nodes together.
MAX_SHARDS = MAX_LEASE_BLOCKS * MAX_STRIPE_WIDTH
#: Nodes a capability names at the most.
MAX_NODES = 4096
MAX_LEASE_ID_BYTES = 128
MAX_TENANT_BYTES = 128
#: How far ahead of a node's clock a capability may end (leases last tens of seconds).
MAX_LIFETIME_S = 3600.0

MAGIC = b"KVRCAP01"
#: What a grant's MAC covers begins with this label, so no other HMAC made under the read
#: key (were one ever added) can pass as a grant.
_DOMAIN = b"kvstore.read-capability.v1\x00"
_HEAD = struct.Struct("<8sdHHI")  # magic, expires, lease id bytes, tenant bytes, grants
_GRANT = struct.Struct("<II")  # node id, keys
_KEY_ITEM = np.dtype(f"V{KEY_BYTES}")
_SIGNED = struct.Struct("<dHHII")  # expires, lease id bytes, tenant bytes, node id, keys
#: The largest encoding: every field at its bound.
MAX_ENCODED_BYTES = (
    _HEAD.size
    + MAX_LEASE_ID_BYTES
    + MAX_TENANT_BYTES
    + MAX_NODES * (_GRANT.size + MAC_BYTES)
    + MAX_SHARDS * KEY_BYTES
)
#: The largest encoding of one node's part (``for_node``): what a node is sent.
MAX_NODE_PART_BYTES = (
    _HEAD.size
    + MAX_LEASE_ID_BYTES
    + MAX_TENANT_BYTES
    + _GRANT.size
    + MAC_BYTES
    + MAX_LEASE_BLOCKS * KEY_BYTES
)


class CapabilityRefused(Forbidden):
    """A capability that does not let this read happen; ``reason`` says why, in one word (it is
    also what a node answers on the wire, ``readserver.STATUS``)."""

    MALFORMED = "malformed"
    FORGED = "forged"
    EXPIRED = "expired"
    REVOKED = "revoked"
    OTHER_NODE = "other_node"
    OTHER_SHARD = "other_shard"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"read capability refused ({reason}): {message}")
        self.reason = reason


@dataclass(frozen=True, eq=False)
class NodeGrant:
    """One node's part of a capability: the block keys of the shards it may serve (sorted,
    distinct) and the MAC over them and the capability's fields."""

    keys: tuple[bytes, ...]
    mac: bytes
    #: The keys end to end, as signed and sent ("" until asked: made from ``keys`` then).
    joined: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.joined:
            object.__setattr__(self, "joined", b"".join(self.keys))

    @cached_property
    def key_set(self) -> frozenset[bytes]:
        return frozenset(self.keys)


@dataclass(frozen=True, eq=False)
class ReadCapability:
    """What one lease lets its tenant read, node by node (see the module doc)."""

    lease_id: str
    tenant: str
    #: The lease's end, wall-clock seconds (the meta shards' clock).
    expires: float
    grants: Mapping[int, NodeGrant]

    def for_node(self, node_id: int) -> ReadCapability:
        """Only ``node_id``'s part (still valid there): what an engine sends that node."""
        grant = self.grants.get(node_id)
        return ReadCapability(
            self.lease_id, self.tenant, self.expires, {} if grant is None else {node_id: grant}
        )

    def node_part(self, node_id: int) -> bytes:
        """``for_node(node_id).encode()``, made without the intermediate capability (and once
        per node): the bytes an engine sends that node with every request of a read."""
        part = self._node_parts.get(node_id)
        if part is None:
            grant = self.grants.get(node_id)
            part = self._encoded([] if grant is None else [(node_id, grant)])
            self._node_parts[node_id] = part
        return part

    @cached_property
    def _node_parts(self) -> dict[int, bytes]:
        return {}

    def keys_for(self, node_id: int) -> tuple[bytes, ...]:
        grant = self.grants.get(node_id)
        return () if grant is None else grant.keys

    @property
    def shards(self) -> int:
        return sum(len(grant.keys) for grant in self.grants.values())

    def encode(self) -> bytes:
        """The canonical bytes (``decode`` gives it back; a re-encoding is byte for byte)."""
        return self._encoded(sorted(self.grants.items()))

    def _encoded(self, grants: list[tuple[int, NodeGrant]]) -> bytes:
        """The bytes of this capability with ``grants`` (sorted by node) as its node parts."""
        lease, tenant = self.lease_id.encode(), self.tenant.encode()
        parts = [_HEAD.pack(MAGIC, self.expires, len(lease), len(tenant), len(grants))]
        parts += [lease, tenant]
        for node_id, grant in grants:
            parts += [_GRANT.pack(node_id, len(grant.keys)), grant.joined, grant.mac]
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ReadCapability:
        """A capability from its bytes, checked for shape and bounds (not for its MACs: that
        is ``verify``'s, with the key). ``CapabilityRefused`` (``MALFORMED``) naming what is
        wrong; nothing that is not canonical is taken (each capability has one encoding)."""
        view = memoryview(data).cast("B")
        if len(view) > MAX_ENCODED_BYTES:
            raise _malformed(f"{len(view)} bytes, at most {MAX_ENCODED_BYTES}")
        if len(view) < _HEAD.size:
            raise _malformed(f"{len(view)} bytes, shorter than its {_HEAD.size}-byte head")
        magic, expires, lease_len, tenant_len, count = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise _malformed(f"magic {bytes(magic)!r}, expected {MAGIC!r}")
        _check_fields(expires, lease_len, tenant_len)
        if count > MAX_NODES:
            raise _malformed(f"names {count} nodes, at most {MAX_NODES}")
        at = _HEAD.size
        lease = _text(view[at : at + lease_len], "lease id", lease_len)
        at += lease_len
        tenant = _text(view[at : at + tenant_len], "tenant", tenant_len)
        at += tenant_len
        grants: dict[int, NodeGrant] = {}
        total = 0
        previous = -1
        for _ in range(count):
            if at + _GRANT.size > len(view):
                raise _malformed("ends inside a node's part")
            node_id, keys = _GRANT.unpack_from(view, at)
            at += _GRANT.size
            if node_id <= previous:
                raise _malformed("node parts out of order or repeated (not canonical)")
            previous = node_id
            total += keys
            if not 0 < keys <= MAX_LEASE_BLOCKS or total > MAX_SHARDS:
                raise _malformed(
                    f"names {keys} shards on node {node_id} ({total} so far), at most "
                    f"{MAX_LEASE_BLOCKS} a node and {MAX_SHARDS} in all"
                )
            end = at + keys * KEY_BYTES
            if end + MAC_BYTES > len(view):
                raise _malformed(f"ends inside node {node_id}'s part")
            raw = bytes(view[at:end])
            # The keys as bytes, made in C (a fixed-size void item's tolist is its bytes,
            # trailing zeros kept); strictly increasing, compared in C too.
            names = tuple(np.frombuffer(raw, _KEY_ITEM).tolist())
            if not all(map(operator.lt, names, names[1:])):
                raise _malformed(f"node {node_id}'s keys out of order or repeated")
            grants[node_id] = NodeGrant(names, bytes(view[end : end + MAC_BYTES]), raw)
            at = end + MAC_BYTES
        if at != len(view):
            raise _malformed(f"{len(view) - at} bytes after its last part")
        return cls(lease, tenant, expires, grants)


def _malformed(message: str) -> CapabilityRefused:
    return CapabilityRefused(CapabilityRefused.MALFORMED, message)


def _check_fields(expires: float, lease_len: int, tenant_len: int) -> None:
    if not math.isfinite(expires) or expires <= 0:
        raise _malformed(f"expiry {expires!r} is not a time")
    if lease_len > MAX_LEASE_ID_BYTES:
        raise _malformed(f"lease id of {lease_len} bytes, at most {MAX_LEASE_ID_BYTES}")
    if tenant_len > MAX_TENANT_BYTES:
        raise _malformed(f"tenant of {tenant_len} bytes, at most {MAX_TENANT_BYTES}")


def _text(raw: memoryview, what: str, length: int) -> str:
    if len(raw) != length:
        raise _malformed(f"ends inside its {what}")
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        raise _malformed(f"its {what} is not UTF-8") from None


def _mac(
    key: bytes, lease: bytes, tenant: bytes, expires: float, node_id: int, keys: bytes
) -> bytes:
    count = len(keys) // KEY_BYTES
    signed = _SIGNED.pack(expires, len(lease), len(tenant), node_id, count)
    return hmac.new(key, b"".join((_DOMAIN, signed, lease, tenant, keys)), hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != READ_KEY_BYTES:
        raise InvalidArgument("read_key", f"must be {READ_KEY_BYTES} bytes")


def mint(
    key: bytes,
    lease_id: str,
    tenant: str,
    expires: float,
    shards: Mapping[int, Iterable[bytes]],
) -> ReadCapability:
    """A capability for ``tenant``'s lease ``lease_id`` ending at ``expires`` (wall clock),
    letting node ``n`` serve the shards of the blocks ``shards[n]`` and nothing else.
    ``InvalidArgument`` naming the field over its bound (the tier then answers without one:
    the engine reads through the gateway)."""
    _check_key(key)
    lease, name = lease_id.encode(), tenant.encode()
    try:
        _check_fields(expires, len(lease), len(name))
    except CapabilityRefused as error:
        raise InvalidArgument("capability", str(error)) from None
    grants: dict[int, NodeGrant] = {}
    total = 0
    for node_id, keys in sorted(shards.items()):
        if not 0 <= node_id < 2**32:
            raise InvalidArgument("shards", f"node id {node_id} out of range")
        names = tuple(sorted({bytes(k) for k in keys}))
        if not names:
            continue
        if any(len(k) != KEY_BYTES for k in names):
            raise InvalidArgument("shards", f"a key of node {node_id} is not {KEY_BYTES} bytes")
        total += len(names)
        if len(names) > MAX_LEASE_BLOCKS or total > MAX_SHARDS or len(grants) >= MAX_NODES:
            raise InvalidArgument(
                "shards",
                f"{len(names)} shards on node {node_id} ({total} so far): at most "
                f"{MAX_LEASE_BLOCKS} a node and {MAX_SHARDS} in all",
            )
        joined = b"".join(names)
        grants[node_id] = NodeGrant(names, _mac(key, lease, name, expires, node_id, joined), joined)
    return ReadCapability(lease_id, tenant, expires, grants)


def mint_for_lease(
    key: bytes, lease: Lease, tenant: str, now: float | None = None
) -> ReadCapability:
    """The capability of a lease the tier just granted: every shard of its blocks at the
    node the lookup placed it on (``Lease.placements``; -1, a lost shard, names nothing),
    ending with the lease (``Lease.until``), or ``MAX_LIFETIME_S`` after ``now`` if that is
    sooner (a node refuses a capability ending later; a lease configured longer is read
    through the gateway after that)."""
    per_node: dict[int, list[bytes]] = {}
    for key_of_block, row in zip(lease.block_keys, lease.placements.tolist(), strict=True):
        for node_id in row:
            if node_id >= 0:
                per_node.setdefault(int(node_id), []).append(bytes(key_of_block))
    expires = float(lease.until)
    if now is not None:
        expires = min(expires, now + MAX_LIFETIME_S)
    return mint(key, lease.lease_id, tenant, expires, per_node)


def check_grant(
    key: bytes,
    capability: ReadCapability,
    node_id: int,
    now: float,
    revoked: Revocations | None = None,
) -> NodeGrant:
    """``node_id``'s part of ``capability`` once it is proven (MAC under ``key``, constant
    time) and current (``check_current``); then each asked key is looked up in the part.
    ``CapabilityRefused`` naming what failed."""
    _check_key(key)
    grant = capability.grants.get(node_id)
    if grant is None:
        raise CapabilityRefused(
            CapabilityRefused.OTHER_NODE, f"lease {capability.lease_id!r} names no shard here"
        )
    expected = _mac(
        key,
        capability.lease_id.encode(),
        capability.tenant.encode(),
        capability.expires,
        node_id,
        b"".join(grant.keys),
    )
    if not hmac.compare_digest(expected, grant.mac):
        raise CapabilityRefused(CapabilityRefused.FORGED, "its MAC does not match its contents")
    check_current(capability, now, revoked)
    return grant


def check_current(
    capability: ReadCapability, now: float, revoked: Revocations | None = None
) -> None:
    """That a proven ``capability`` still holds at ``now``: not past its end, not ending too
    far ahead, not revoked. Its proof depends on its bytes alone, so a node that proved these
    bytes once (on a connection that presents them again) checks only this, every request.
    ``CapabilityRefused`` naming what failed."""
    if now > capability.expires:
        raise CapabilityRefused(
            CapabilityRefused.EXPIRED,
            f"lease {capability.lease_id!r} ended {now - capability.expires:.3f} s ago",
        )
    if capability.expires - now > MAX_LIFETIME_S:
        raise CapabilityRefused(
            CapabilityRefused.EXPIRED,
            f"ends {capability.expires - now:.0f} s from now, more than {MAX_LIFETIME_S:.0f} s "
            "(the minting clock is off)",
        )
    if revoked is not None and revoked.revoked(capability.lease_id, capability.expires):
        raise CapabilityRefused(
            CapabilityRefused.REVOKED, f"lease {capability.lease_id!r} was released"
        )


def verify(
    key: bytes,
    capability: ReadCapability,
    node_id: int,
    shard_key: bytes,
    now: float,
    revoked: Revocations | None = None,
) -> None:
    """Whether ``capability`` lets node ``node_id`` serve its shard of block ``shard_key`` at
    ``now``: returns, or raises ``CapabilityRefused`` naming why not."""
    grant = check_grant(key, capability, node_id, now, revoked)
    if bytes(shard_key) not in grant.key_set:
        raise CapabilityRefused(
            CapabilityRefused.OTHER_SHARD,
            f"lease {capability.lease_id!r} names no shard of block {bytes(shard_key).hex()[:16]}"
            " on this node",
        )


#: Revoked lease ids a node remembers at the most (each a short string and a float).
MAX_REVOKED = 200_000


class Revocations:
    """Lease ids whose capabilities a node no longer honours, each until it would have
    ended anyway; thread-safe. At ``limit`` ids, the one ending first is dropped and the floor
    raised to its end: every capability ending at or before the floor counts as revoked (more
    refusals, never fewer; leases end in about the order they are granted, so the floor sits
    among those about to end)."""

    def __init__(self, limit: int = MAX_REVOKED) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self._limit = limit
        self._until: dict[str, float] = {}
        self._ends: list[tuple[float, str]] = []  # heap of (end, id), entries may be stale
        self._floor = 0.0
        self._lock = threading.Lock()

    def revoke(self, lease_ids: Iterable[str], until: float, now: float) -> int:
        """Revoke ``lease_ids`` until ``until`` (their capabilities' end, or later); returns
        how many are remembered now. Ids already past ``until`` at ``now`` need no memory."""
        with self._lock:
            self._drop_ended(now)
            if until <= now:
                return len(self._until)
            for lease_id in lease_ids:
                if len(lease_id.encode()) > MAX_LEASE_ID_BYTES:
                    continue  # no capability names such an id
                if self._until.get(lease_id, -math.inf) >= until:
                    continue
                self._until[lease_id] = until
                heapq.heappush(self._ends, (until, lease_id))
                while len(self._until) > self._limit:
                    end, dropped = heapq.heappop(self._ends)
                    if self._until.get(dropped) == end:
                        del self._until[dropped]
                        self._floor = max(self._floor, end)
            return len(self._until)

    def revoked(self, lease_id: str, expires: float) -> bool:
        with self._lock:
            return expires <= self._floor or lease_id in self._until

    def _drop_ended(self, now: float) -> None:
        while self._ends and self._ends[0][0] < now:
            end, lease_id = heapq.heappop(self._ends)
            if self._until.get(lease_id) == end:
                del self._until[lease_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._until)
