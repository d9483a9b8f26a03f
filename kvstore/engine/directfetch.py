"""The fetcher's direct path: a load's blocks read straight from the storage nodes with its
lease's read grant (``kvstore.tier.records.DirectGrant``), instead of relayed by the gateway.

The gateway path moves every byte node → gateway → gRPC → fetcher; here each node's shards
land where the engine will take them from: the load's staging region, layer-major
(``kvstore.engine.staging.StageLayout``: a block's slice of layer i in layer i's section), or
a CPU engine's KV rows themselves (``kvstore.engine.sharedkv``).
``DirectReader.read_into`` receives each data shard's fragment in place, cut at the layer
boundaries it crosses (``Spread``), hashes each block once and decodes from parity only when a
shard is missing or bad: no scratch buffer, no copy between the socket and staging. A block the
reader cannot assemble is a miss here, and the fetcher reads it through the gateway
(``fetcher._read_blocks``) and copies that one into staging.

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
from kvstore.blockstore.readblocks import ReadBlocks, Spread
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

    def read_into(
        self,
        grant: DirectGrant,
        nbytes: int,
        out: np.ndarray,
        segments: tuple[tuple[int, int, int], ...],
        rows: np.ndarray,
        on_prefix: Callable[[int, np.ndarray, np.ndarray], bool] | None = None,
    ) -> np.ndarray | None:
        """Read ``grant``'s blocks straight into their places in ``out``: block i's slice of
        each layer where ``segments`` puts that layer's row 0, ``rows[i]`` rows further on (a
        staging region, ``StageLayout.block_segments`` and rows 0..n-1; or the engine's shared
        KV cache, ``KVFile.segments`` and the request's block ids); which were read whole (a
        miss's bytes there are undefined, never marked OK).
        None: this process reads through the gateway. A block of another size than
        ``nbytes`` is a miss, never read. ``on_prefix(nbytes, whole, read)``: the read's
        progress, per block of the grant (``DirectReader.read_into``'s, with ``read`` the
        blocks asked for)."""
        n = len(grant)
        reader = self._reader_for(grant)
        if not self._decide(reader, grant):
            return None
        ok = np.zeros(n, bool)
        chosen = np.flatnonzero(grant.sizes == nbytes)
        if not chosen.size:
            return ok
        capability = _capability(grant)
        if capability is None:
            return ok
        blocks = ReadBlocks(grant.keys[chosen], grant.placements[chosen], grant.sizes[chosen])
        spread = Spread(segments, tuple(rows[chosen].tolist()))
        asked = np.zeros(n, bool)
        asked[chosen] = True

        def progress(prefix: int, whole: np.ndarray) -> bool:
            assert on_prefix is not None
            mask = np.zeros(n, bool)
            mask[chosen] = whole
            return on_prefix(prefix, mask, asked)

        ok[chosen] = reader.read_into(
            capability, blocks, out, spread=spread, on_prefix=progress if on_prefix else None
        )
        return ok

    def read_whole(self, grant: DirectGrant, nbytes: int) -> bool | None:
        """Read ``grant``'s blocks (each ``nbytes``) end to end into a buffer of their own:
        whether every one came whole; None: this process reads through the gateway. What a
        load probe times (``kvstore.engine.probe``); the bytes are dropped."""
        reader = self._reader_for(grant)
        if not self._decide(reader, grant):
            return None
        if not len(grant) or not bool((grant.sizes == nbytes).all()):
            return False
        capability = _capability(grant)
        if capability is None:
            return False
        blocks = ReadBlocks(grant.keys, grant.placements, grant.sizes)
        out = np.empty(len(blocks) * nbytes, np.uint8)
        return all(reader.read_into(capability, blocks, out))

    @property
    def counters(self) -> Mapping[str, int]:
        return {} if self._reader is None else dict(self._reader.counters)


def _capability(grant: DirectGrant) -> ReadCapability | None:
    """The grant's read capability (None, said in the log: malformed, every block a miss)."""
    try:
        return ReadCapability.decode(grant.capability)
    except CapabilityRefused as error:
        log.warning("a load's read capability is malformed: %s", error)
        return None
