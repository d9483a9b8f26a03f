"""``Revoker``: the tier's released leases, revoked on the storage nodes off the request path.

A lease's read capability (``kvstore.blockstore.capability``) would otherwise read until the
lease's end: once the tier gives a lease back (ReleaseLease, release on read, the sweep, a lease
pushed out of a full table) its blocks may be collected and their slots reused, so every node
must stop honouring it. Telling the nodes is one call per node (``send``: the runtime's
``BlockStoreHandles.revoke`` through Ray; the tier holds no Ray), far too slow for a release on
the request path and far too many calls one by one under load: releases are queued and one
thread sends them in batches, each batch's ids with the latest end among them (a node keeps an
id until then: a little longer than some need, never shorter). A batch is sent ``window_s``
after its first id was queued, so the releases of that stretch share one call per node: an
engine releases a lease after every load, and 12 node calls per load, on every machine of
the tier, would cost the cluster more CPU than the reads themselves (measured: a release's
calls on the tier's machines took ~8 ms of a 2-core engine host's forward where they shared it).

A revocation lands on the nodes within ``window_s`` plus one batch's send after the release,
not at it: in that window the released lease's capability still reads the leased blocks, which
the lease's own end would have allowed anyway (a block's key names its content, so a
collected and reused slot never answers to the old key); a node refuses nothing it may not
refuse. ``flush`` sends what is queued at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

#: Ids one batch carries at the most.
MAX_BATCH = 4096

#: How long a revocation waits for others to share its batch (seconds).
WINDOW_S = 0.5

#: Sends one batch: (lease ids, the latest end among them) to every node.
Send = Callable[[Sequence[str], float], object]


class Revoker:
    """Queues released leases' ids and sends them to the nodes in batches from one daemon
    thread (started on first use). Thread-safe."""

    def __init__(self, send: Send, window_s: float = WINDOW_S) -> None:
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {window_s!r}")
        self._send = send
        self._window_s = window_s
        self._queue: list[tuple[str, float]] = []
        self._hurry = 0  # flushes waiting: the queued batch goes without its window
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._busy = False
        self.sent = 0  # ids handed to ``send`` (figures, tests)

    def revoke(self, lease_id: str, until: float) -> None:
        """Revoke ``lease_id``'s capability on every node, until ``until`` (its end); returns at
        once."""
        with self._cond:
            if self._closed:
                return
            self._queue.append((lease_id, until))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="revoker", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every revocation queued so far was sent; False when ``timeout`` ran out."""
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)
            finally:
                self._hurry -= 1

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                # The window: the releases of the next moments share this batch's calls.
                self._cond.wait_for(
                    lambda: self._hurry or self._closed or len(self._queue) >= MAX_BATCH,
                    self._window_s,
                )
                batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                self._busy = True
            try:
                self._send([lease_id for lease_id, _ in batch], max(until for _, until in batch))
                self.sent += len(batch)
            except Exception:  # a control loop survives a failing step; the lease's end holds
                log.exception("revoking %d released leases on the nodes failed", len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
