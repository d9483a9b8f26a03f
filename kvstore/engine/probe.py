"""A probe of the load path: one block of a hit, read the way the fetcher would read it, timed.

Why a probe: a fresh engine has no load figure of its own (``kvstore.engine.worth``), and
only the engine can measure the path between itself and the tier (a distant engine's thin
link is invisible to the tier's own estimates). One block is enough to tell a tier that loads
in milliseconds from one where loading loses to computing, and costs 1/N of the load it
judges. It reads the path the load will take: straight from the storage nodes with the hit's
read grant when the nodes answer this process (``kvstore.engine.directfetch``, the fetcher's
own reader, which decides reachability the same way), else through the gateway's GetBlocks.
The gateway read goes without the lease: a GetBlocks with it would end the lease the load
needs.

The scheduler side asks it (``PagedScheduler``'s ``probe``) only while the engine has no load
figure, so it runs once per fresh engine (and again once its figures age out), with a budget
(``LoadWorth.probe_budget``: two blocks' compute). The read runs on a thread of the probe's
own, and the scheduler waits for it at most the budget: a block that has not arrived by then
answers (bytes, budget), a rate the load could at best reach, which loses to computing. The
read left running finishes in the background; the next probe queues behind it (one reader,
never two at once), so it too is cut at its budget while the link is that slow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Late

from kvstore.engine.directfetch import DirectBlocks
from kvstore.engine.plan import describe
from kvstore.tier.protocols import TierReader
from kvstore.tier.records import HitAnswer

log = logging.getLogger(__name__)


class LoadProbe:
    """``probe(answer, budget_s)``: (bytes, seconds) of one of ``answer``'s blocks read over
    the load path (seconds: at most ``budget_s``, see the module doc), or None when none could
    be read (a miss, an error: the hit is judged without it)."""

    def __init__(
        self,
        gateway: TierReader,
        block_bytes: int,
        *,
        direct: DirectBlocks | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._gateway = gateway
        self._block_bytes = block_bytes
        self._direct = direct
        self._clock = clock
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-probe")

    def __call__(self, answer: HitAnswer, budget_s: float) -> tuple[int, float] | None:
        if not answer.hit_block_keys:
            return None
        read = self._reader.submit(self._read, answer)
        try:
            return read.result(timeout=budget_s)
        except Late:
            log.info("kvstore: load probe: no block within %.3f s", budget_s)
            return self._block_bytes, budget_s

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _read(self, answer: HitAnswer) -> tuple[int, float] | None:
        try:
            return self._direct_read(answer) or self._gateway_read(answer.hit_block_keys[0])
        except Exception as error:  # noqa: BLE001 - no figure: the hit is judged without one
            log.info("kvstore: load probe failed: %s", describe(error))
            return None

    def _direct_read(self, answer: HitAnswer) -> tuple[int, float] | None:
        grant, direct = answer.direct, self._direct
        if grant is None or direct is None or not len(grant):
            return None
        start = self._clock()
        try:
            whole = direct.read_whole(grant.part(0, 1), self._block_bytes)
        finally:
            direct.close()  # the probe is rare: no sockets held to every node meanwhile
        if not whole:
            return None  # the nodes do not answer this process: the gateway path is the one
        return self._block_bytes, self._clock() - start

    def _gateway_read(self, key: bytes) -> tuple[int, float] | None:
        start = self._clock()
        payload = self._gateway.get_blocks([key])[0].payload
        if payload is None:
            return None
        return len(payload), self._clock() - start
