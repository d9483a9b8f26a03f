"""The fetcher's direct path: a load's blocks read straight from the storage nodes with its
lease's read grant (``kvstore.tier.records.DirectGrant``), instead of relayed by the gateway.

The gateway path moves every byte node → gateway → gRPC → fetcher; here each node's shards
land in the fetcher's own scratch buffer (``DirectReader.read_into``: received in place, hashed
once per block, decoded from parity only when a shard is missing or bad). One copy remains,
the same one the gateway path makes from its gRPC payloads: scratch (block-contiguous) →
staging (layer-major, ``kvstore.engine.staging.StageLayout``), layer by layer, so that layer 0
is published before the later layers are copied. A block the reader cannot assemble is a miss
here, and the fetcher reads it through the gateway (``fetcher._read_blocks``).

Whether to read directly is decided once per fetcher process: the first grant's nodes are
dialed (``DirectReader.reachable``); an engine outside the cluster's network reaches none and
reads through the gateway from then on, without waiting out a timeout on every load. The
choice is logged once, with why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np

from kvstore.blockstore.capability import CapabilityRefused, ReadCapability
from kvstore.blockstore.direct import DirectReader
from kvstore.blockstore.records import BlockLocation
from kvstore.fastcall.tls import ClientTLS, tls_from_env
from kvstore.tier.records import DirectGrant

log = logging.getLogger(__name__)


class DirectBlocks:
    """One fetcher process's direct reads (not thread-safe: the fetcher reads one job at a
    time). ``tls``: the data plane's client TLS (default: this process's
    ``KVSTORE_FASTCALL_TLS_*``, as every process of the cluster has it)."""

    def __init__(
        self,
        tls: ClientTLS | None | str = "env",
        timeout_s: float = 5.0,
        on_decided: Callable[[str], object] | None = None,
    ) -> None:
        """``on_decided``: told once, in words, which path this process's loads take and why
        (the fetcher hands it to the engine's log)."""
        self._tls: ClientTLS | None = tls_from_env()[1] if tls == "env" else tls  # type: ignore[assignment]
        self._timeout = timeout_s
        self._on_decided = on_decided
        self._reader: DirectReader | None = None
        self._geometry: tuple[int, int] | None = None
        #: None: not decided yet; True: direct; False: the gateway, for good.
        self.enabled: bool | None = None
        self.reason = ""
        self._scratch = np.zeros(0, np.uint8)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _reader_for(self, grant: DirectGrant) -> DirectReader:
        """The reader for ``grant``'s nodes: kept across loads (one connection per node),
        made again when the nodes' endpoints changed (a restarted node listens elsewhere)."""
        reader = self._reader
        if (
            reader is None
            or reader.endpoints != dict(grant.endpoints)
            or self._geometry != (grant.k, grant.m)
        ):
            if reader is not None:
                reader.close()
            reader = self._reader = DirectReader(
                grant.endpoints, grant.k, grant.m, tls=self._tls, timeout_s=self._timeout
            )
            self._geometry = (grant.k, grant.m)
        return reader

    def _decide(self, reader: DirectReader, grant: DirectGrant) -> bool:
        if self.enabled is None:
            reached = reader.reachable()
            if len(reached) >= grant.k:
                self.enabled = True
                self.reason = (
                    f"{len(reached)} of {len(grant.endpoints)} storage nodes' read sockets "
                    "answer from this process"
                )
            else:
                self.enabled = False
                self.reason = (
                    f"only {len(reached)} of {len(grant.endpoints)} storage nodes' read sockets "
                    f"answer from this process ({grant.k} needed)"
                )
            path = "direct from the storage nodes" if self.enabled else "through the gateway"
            log.info("loads read blocks %s: %s", path, self.reason)
            if self._on_decided is not None:
                self._on_decided(f"{path}: {self.reason}")
        return bool(self.enabled)

    def read(
        self, grant: DirectGrant, nbytes: int
    ) -> tuple[list[np.ndarray | None], np.ndarray] | None:
        """Each of ``grant``'s blocks (a view into this reader's scratch, valid until the next
        ``read``) and which were read whole; None: this process reads through the gateway.
        A block of another size than ``nbytes`` is a miss, never read."""
        n = len(grant)
        reader = self._reader_for(grant)
        if not self._decide(reader, grant):
            return None
        sized = grant.sizes == nbytes
        if n * nbytes > self._scratch.size:
            self._scratch = np.empty(n * nbytes, np.uint8)
        out = self._scratch[: n * nbytes]
        chosen = np.flatnonzero(sized)
        ok = np.zeros(n, bool)
        if chosen.size:
            try:
                capability = ReadCapability.decode(grant.capability)
            except CapabilityRefused as error:
                log.warning("a load's read capability is malformed: %s", error)
                return [None] * n, ok
            every = grant.blocks()
            blocks = [BlockLocation(*every[i]) for i in chosen.tolist()]
            offsets = (chosen * nbytes).tolist()
            found = reader.read_into(capability, blocks, out, offsets)
            ok[chosen] = found
        payloads: list[np.ndarray | None] = [
            out[i * nbytes : (i + 1) * nbytes] if good else None
            for i, good in enumerate(ok.tolist())
        ]
        return payloads, ok

    @property
    def counters(self) -> Mapping[str, int]:
        return {} if self._reader is None else dict(self._reader.counters)
