"""The engine read socket's wire format: the one request it takes and the reply it makes.

Shared by the node's server (``readserver``) and the engine's reader (``direct``), so neither
imports the other. Every frame is a 4-byte big-endian length, then that many bytes (as on the
fastcall sockets: ``kvstore.fastcall.frames``), inside TLS where the data-plane setting has it.

Request (the only one there is: read these shards with this capability)::

    offset size field
         0    4 magic          b"KVRD"
         4    1 op             1 = READ; any other value: the peer is dropped
         5    1 version        2 (another version: the peer is dropped)
         6    2 reserved       zero
         8    4 capability     bytes of the capability that follows (``ReadCapability``,
                               normally only this node's part: ``for_node``)
        12    4 count          shard keys asked, at most ``MAX_SHARDS_PER_REQUEST``
        16      capability, then count x 32-byte block keys (this node's shard of each)

Reply::

         0    4 magic          b"KVRR"
         4    1 refusal        0, or why the whole request was refused (a ``STATUS`` code)
         5    1 reserved       zero
         6    2 prefix         bytes before each served shard's own, at most ``MAX_PREFIX``
         8    4 count          as asked
        12    8 data bytes     sum over the served shards of prefix + length
        20      count x u8 status (``OK``: served; anything else: no bytes), zero padding to 8,
                count x u32 length (little-endian; 0 unless served),
                the served shards in the order asked, each as ``prefix`` bytes the reader
                skips, then the shard's ``length`` bytes

A refused shard carries a status and no byte; a read that is not served at all (a bad
capability) still answers every key, each with the refusal's status.

Why a prefix: a node sends shards straight from its segment files, where each shard follows
its record header (``segments``). Sending whole records lets the node send a run of shards
that lie end to end in one ``sendfile`` instead of one call per shard (a put batch's shards
are appended together, so a lease's shards on a node mostly form one run): for 64 shards of
11 KiB that halves the CPU the send and its receipt take. The prefix is that record header
(the shard's own key, stripe index, write token, LSN and times: nothing of another shard);
the reader does not interpret it. A node reading into a buffer (TLS) sends no prefix.
"""

from __future__ import annotations

import struct

from kvstore.blockstore.capability import MAX_NODE_PART_BYTES, CapabilityRefused

REQUEST_MAGIC = b"KVRD"
REPLY_MAGIC = b"KVRR"
OP_READ = 1
VERSION = 2
REQUEST = struct.Struct("<4sBBHII")
REPLY = struct.Struct("<4sBxHIQ")
#: The largest prefix a reader takes (a node's record header is 96 bytes).
MAX_PREFIX = 128
#: Shards one request asks at the most: the reply stays a few tens of MB even for the largest
#: blocks (1.35 MiB split 10 ways: 1,024 x 140 KiB), and a reader splits larger reads.
MAX_SHARDS_PER_REQUEST = 1024
#: The largest request body: one node's part of a capability and the keys (a whole
#: capability of a large lease is refused unread: a reader sends each node its part).
MAX_REQUEST_BYTES = REQUEST.size + MAX_NODE_PART_BYTES + MAX_SHARDS_PER_REQUEST * 32

OK = 0
MISSING = 1  # the capability lets it, the node does not hold it (lost, moved, deleted)
BUSY = 2  # the node's reply budget is spent: ask again (or read another way)
#: A refused shard's status, by the capability's refusal reason.
STATUS = {
    CapabilityRefused.MALFORMED: 3,
    CapabilityRefused.FORGED: 4,
    CapabilityRefused.EXPIRED: 5,
    CapabilityRefused.REVOKED: 6,
    CapabilityRefused.OTHER_NODE: 7,
    CapabilityRefused.OTHER_SHARD: 8,
}
REASON = {code: reason for reason, code in STATUS.items()}
NAMES = {OK: "ok", MISSING: "missing", BUSY: "busy", **REASON}


def table_bytes(count: int) -> int:
    """Bytes of a reply's status and length table for ``count`` keys."""
    return padded(count) + 4 * count


def padded(count: int) -> int:
    return -(-count // 8) * 8
