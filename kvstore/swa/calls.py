"""What an SWA directory shard answers remotely: one Protocol.

Clients' lookups come through a fanout (``EntrypointCalls``, ``kvstore.swa.transport``); the
stores' heartbeats call ``sync`` through a Ray handle. The entrypoint's Ray shell
(``kvstore.runtime.swa_actors``) gets its forwarders generated from this Protocol
(``kvstore.runtime.forwards``), so these signatures are written here and in
``DirectoryShard`` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvstore.swa.directory import SyncReply, SyncRequest
from kvstore.swa.transport import EntrypointCalls

if TYPE_CHECKING:
    from kvstore.swa.directory import DirectoryShard


class DirectoryShardCalls(EntrypointCalls, Protocol):
    def sync(self, request: SyncRequest) -> SyncReply: ...


if TYPE_CHECKING:  # the plain shard answers every call (its types; forwards checks the rest)
    _shard: type[DirectoryShardCalls] = DirectoryShard
