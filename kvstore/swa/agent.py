"""A machine's SWA store plus the bookkeeping that keeps the directory in step with it.

The store is the truth; the directory is a soft copy. The agent records every change of what
the store holds (put → register, eviction / expiry → unregister) in a per-shard pending table and
turns it into ``SyncRequest``s. It never assumes a sync arrived until the shard answered:

- a change is cleared only when a sync carrying *that* change (same sequence number) succeeded,
  so a later change of the same key is never lost to an earlier reply;
- a failed or timed-out sync leaves everything pending; the next heartbeat sends it again
  (register / unregister are idempotent at the shard). Every sync carries *all* changes not yet
  acknowledged, so a newer sync supersedes an older one, and shards drop a sync that arrives
  after a newer one (its ``seq``): a timed-out sync delivered late can never undo newer state;
- a shard answering ``needs_full`` (a replacement entrypoint, or one that gave up on us) gets the
  whole set this store holds for it in the next sync.

Pure logic, no I/O: the Ray shell (``kvstore.runtime.swa_actors``) moves the messages.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.swa.directory import ShardMap, StoreRef, SyncReply, SyncRequest
from kvstore.swa.store import SWAStore

_REGISTER = "register"
_UNREGISTER = "unregister"


@dataclass(frozen=True)
class SyncTicket:
    """What one outgoing sync carried, so its reply clears exactly that."""

    shard_id: str
    full: bool
    #: key -> sequence number of the change sent (delta syncs).
    sent: dict[BlockKey, int]
    #: Highest sequence number folded into a full sync.
    up_to: int


class StoreAgent:
    def __init__(
        self,
        store: SWAStore,
        ref: StoreRef,
        shards: ShardMap,
        incarnation: str | None = None,
    ) -> None:
        self.store = store
        self.ref = ref
        self.shards = shards
        self.incarnation = incarnation or uuid.uuid4().hex
        self._seq = 0  # numbers changes
        self._sync_seq = 0  # numbers outgoing syncs (shards drop overtaken ones)
        self._pending: dict[str, dict[BlockKey, tuple[str, int]]] = {s: {} for s in shards.ids}
        # First contact with every shard is a full sync: it tells the shard our incarnation.
        self._needs_full: set[str] = set(shards.ids)

    # --- changes of the store ---------------------------------------------------------

    def put(self, key: BlockKey, position: int, blob: object, *, owner: str = "") -> list[BlockKey]:
        """Store ``owner``'s state (``SWAStore.put``); returns the keys LRU evicted. Raises
        ``InvalidArgument`` on a bad put (and then changes nothing)."""
        evicted = self.store.put(key, position, blob, owner=owner)
        self._record_removed()
        self._record(key, _REGISTER)
        return evicted

    def get(self, key: BlockKey) -> Any | None:
        blob = self.store.get(key)
        self._record_removed()
        return blob

    def tick(self) -> list[BlockKey]:
        """Expire by TTL (call it on every heartbeat); returns the expired keys."""
        expired = self.store.expire()
        self._record_removed()
        return expired

    def _record_removed(self) -> None:
        for key in self.store.drain_removed():
            self._record(key, _UNREGISTER)

    def _record(self, key: BlockKey, op: str) -> None:
        self._seq += 1
        self._pending[self.shards.shard_of(key)][key] = (op, self._seq)

    # --- messages to the directory ----------------------------------------------------

    def dirty_shards(self) -> list[str]:
        """Shards with something to send beyond a bare heartbeat."""
        return [s for s in self.shards.ids if self._pending[s] or s in self._needs_full]

    def is_registered(self, key: BlockKey) -> bool:
        """True when the directory has acknowledged the latest change of ``key``."""
        shard = self.shards.shard_of(key)
        return shard not in self._needs_full and key not in self._pending[shard]

    def pending_count(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def outgoing(self, shard_id: str) -> tuple[SyncRequest, SyncTicket]:
        """The sync to send to ``shard_id`` now (a heartbeat even when nothing changed)."""
        if shard_id not in self._pending:
            raise InvalidArgument("shard_id", f"unknown shard {shard_id!r}")
        self._sync_seq += 1
        if shard_id in self._needs_full:
            held = tuple(k for k in self.store.keys() if self.shards.shard_of(k) == shard_id)
            request = SyncRequest(
                self.ref, self.incarnation, seq=self._sync_seq, full=True, register=held
            )
            return request, SyncTicket(shard_id, True, {}, self._seq)
        pending = self._pending[shard_id]
        register = tuple(k for k, (op, _) in pending.items() if op == _REGISTER)
        unregister = tuple(k for k, (op, _) in pending.items() if op == _UNREGISTER)
        sent = {k: seq for k, (_, seq) in pending.items()}
        request = SyncRequest(
            self.ref,
            self.incarnation,
            seq=self._sync_seq,
            register=register,
            unregister=unregister,
        )
        return request, SyncTicket(shard_id, False, sent, self._seq)

    def on_reply(self, ticket: SyncTicket, reply: SyncReply) -> None:
        pending = self._pending[ticket.shard_id]
        if ticket.full:
            # The full set reflected every change up to ``up_to``; later ones stay pending.
            for key in [k for k, (_, seq) in pending.items() if seq <= ticket.up_to]:
                del pending[key]
            self._needs_full.discard(ticket.shard_id)
        else:
            for key, seq in ticket.sent.items():
                current = pending.get(key)
                if current is not None and current[1] == seq:
                    del pending[key]
        if reply.needs_full:
            self._needs_full.add(ticket.shard_id)

    def on_failure(self, ticket: SyncTicket) -> None:
        """The sync failed or timed out: keep everything pending for the next heartbeat."""
        del ticket  # nothing to undo: only a reply clears pending changes
