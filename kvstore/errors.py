"""One exception tree for all of kvstore.

Rules every module follows:
- Errors cross module boundaries as exceptions from this tree, never as bool/None/int codes.
- A failed *read* is reported to the caller as a miss (a result, not an exception) wherever the
  API has a miss; exceptions are for bad input, bad configuration and broken invariants.
- Each message names what is wrong (the field, the block, the shard) so an operator can act on it.

Subsystems add their own subclasses here so the gRPC layer can map every error to one status code
(see ``grpc_status_name``).
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    #: gRPC status code name this error maps to at the API boundary.
    grpc_status = "INTERNAL"


# --- configuration and input -------------------------------------------------------------


class ConfigError(KVStoreError):
    """A configuration value is missing or invalid; raised at start-up, naming the field."""

    grpc_status = "FAILED_PRECONDITION"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # Two-argument __init__: pickle (Ray actor boundaries) must call it the same way.
        return (type(self), (self.field, self.detail))


class InvalidArgument(KVStoreError):
    """A request argument is malformed; the message names the argument."""

    grpc_status = "INVALID_ARGUMENT"

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        self.detail = message
        super().__init__(f"{argument}: {message}")

    def __reduce__(self) -> tuple[type[InvalidArgument], tuple[str, str]]:
        # Two-argument __init__: pickle (Ray actor boundaries) must call it the same way.
        return (type(self), (self.argument, self.detail))


class Unauthenticated(KVStoreError):
    """The caller did not prove who it is (no, a wrong or an ambiguous credential)."""

    grpc_status = "UNAUTHENTICATED"


class Forbidden(KVStoreError):
    """The caller is known but may not do this (write the shared namespace, use a class)."""

    grpc_status = "PERMISSION_DENIED"


class LayoutError(KVStoreError):
    """A state-block layout does not add up (would otherwise corrupt memory silently)."""


class StateRejected(InvalidArgument):
    """An SWA state put of the wrong size, or at a position docs/rules.md §6 never stores at; the
    message names both. Picklable (through ``InvalidArgument.__reduce__``) across Ray actors."""


# --- engine-side ledgers -------------------------------------------------------------------


class LedgerError(KVStoreError):
    """Misuse of a ledger (double free, unknown sequence, ...)."""

    grpc_status = "FAILED_PRECONDITION"


class OutOfBlocks(LedgerError):
    """The paged block pool has no free block left."""

    grpc_status = "RESOURCE_EXHAUSTED"


class OutOfSlots(LedgerError):
    """The state slot pool has no free slot left."""

    grpc_status = "RESOURCE_EXHAUSTED"


class SwapInError(KVStoreError):
    """The engine-side fetch/swap-in machinery failed: the fetcher process died, a load was
    misused. Blocks that did not arrive are reported as load errors, never left as wrong bytes."""

    grpc_status = "UNAVAILABLE"


class StagingFull(SwapInError):
    """The /dev/shm staging area has no room for a load right now (it is freed as loads finish)."""

    grpc_status = "RESOURCE_EXHAUSTED"


class LoadTimeout(SwapInError):
    """A layer of a load did not arrive in time; the message names the layer and the request."""

    grpc_status = "DEADLINE_EXCEEDED"


# --- erasure coding ------------------------------------------------------------------------


class ECError(KVStoreError):
    """Erasure-coding failure; messages name the block and shard."""


class TooFewShards(ECError):
    """Fewer than k readable shards: the block cannot be rebuilt (a miss to callers)."""

    grpc_status = "UNAVAILABLE"


class CorruptShard(ECError):
    """A shard failed its header or checksum check; it is treated as missing."""

    grpc_status = "DATA_LOSS"


class ShardSizeMismatch(ECError):
    """Shards of one stripe disagree in size."""

    grpc_status = "DATA_LOSS"


# --- storage tier --------------------------------------------------------------------------


class StoreError(KVStoreError):
    """A storage-tier operation failed."""

    grpc_status = "UNAVAILABLE"


class Overloaded(StoreError):
    """The service is over its admission limit; retry later."""

    grpc_status = "RESOURCE_EXHAUSTED"


class LeaseError(StoreError):
    """Unknown or expired lease."""

    grpc_status = "NOT_FOUND"


class NodeUnavailable(StoreError):
    """A storage node or meta shard did not answer (dead, restarting, unreachable, too slow).

    Internal to the block tier: the client turns it into a degraded read or a miss, never lets
    it reach its caller."""


class NodeDead(NodeUnavailable):
    """The cluster reports the storage node or meta shard dead for good (not just slow)."""


class NodeDraining(NodeUnavailable):
    """The storage node is draining (a planned removal): it takes no new shards but still
    serves reads, commits and deletes. A writer places around it without counting it failed,
    so readers keep using it. One message argument: pickles as it is (Ray actor boundaries)."""


def grpc_status_name(error: BaseException) -> str:
    """The gRPC status code name for ``error`` (INTERNAL for anything unexpected)."""
    if isinstance(error, KVStoreError):
        return error.grpc_status
    return "INTERNAL"
