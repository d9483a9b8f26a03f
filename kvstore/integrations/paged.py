"""The engine-neutral core of a paged-KV connector: what to load and save, and doing it.

An engine with a paged KV cache (vLLM's) keeps, per attention layer, one tensor whose first
dimension is the block id; one block of 128 tokens is one opaque row of bytes. The connector's
two halves, which may live in two processes, are:

- ``PagedScheduler`` (decides; never touches bytes): asks the tier once per request how much of
  its prompt is cached (one QueryHit with the prompt's chained block keys, a lease taken),
  records which engine blocks a load must fill, which newly full blocks a step must save, and
  hands both to the worker as a picklable ``StepPlan``. A tier that does not answer within
  ``lookup_timeout_s`` is a miss, and for ``retry_after_s`` after that every lookup is a miss
  without asking, so a dead tier costs one timeout, not one per request.
- ``PagedWorker`` (moves bytes): a load is fetched by the fetcher process
  (``kvstore.gpu.fetcher``) into a /dev/shm staging region, layer by layer; ``wait_layer(i)``
  copies layer i of every block that arrived intact into the cache (a block that did not is
  never written and is reported by ``load_errors`` so the engine recomputes it). A save gathers
  the rows of its blocks after each layer is computed (a copy: the put never reads the engine's
  cache afterwards) and a writer thread puts whole blocks (layer-major payloads) to the tier;
  past ``max_pending_save_bytes`` a save is dropped, never waited for.

Both halves work on plain Python and torch objects, so they are tested without an engine; the
vLLM glue (``kvstore.integrations.vllm``) maps vLLM's calls onto them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.gpu.fetcher import Fetcher, StagedFetch
from kvstore.gpu.kvlayout import KVLayout
from kvstore.gpu.staging import StagingArea
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys
from kvstore.tier.protocols import HitSource, ReaderFactory, TierWriter
from kvstore.tier.records import HitAnswer, HitRequest

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A tier that is down fails every save; say so at most this often.
_SAVE_WARNING_EVERY_S = 30.0


def describe(error: BaseException) -> str:
    """One line for a failed call (a gRPC error's code and details, not its repr)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class PagedLoad:
    """Fill ``block_ids`` (engine blocks) with the tier's blocks ``keys`` (same order)."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    lease_id: str | None = None


@dataclass(frozen=True)
class PagedSave:
    """Store engine blocks ``block_ids`` under ``keys`` (same order)."""

    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    traffic_class: str = ""


@dataclass
class StepPlan:
    """What the scheduler decided since the last step (crosses to the worker pickled)."""

    loads: list[PagedLoad] = field(default_factory=list)
    saves: list[PagedSave] = field(default_factory=list)
    #: Requests that finished with saves still to be gathered: request → saves emitted for it.
    #: The worker reports one as done once it has gathered that many.
    finished: dict[str, int] = field(default_factory=dict)


@dataclass
class _Tracked:
    """Scheduler-side facts about one request."""

    answer: HitAnswer | None
    computed: int = 0  # tokens the engine had (its own prefix cache) when the load was planned
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = -1  # blocks known to be in the tier or handed to a save; -1: not yet
    saves_emitted: int = 0
    loading: PagedLoad | None = None


class PagedScheduler:
    """The deciding half (one per engine; not thread-safe: the engine's scheduler loop calls
    it from one thread)."""

    def __init__(
        self,
        hits: HitSource,
        fingerprint: bytes,
        *,
        mode: str,
        traffic_class: str = "",
        retry_after_s: float = 5.0,
        load: bool = True,
        save: bool = True,
        reads_end_leases: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reads_end_leases``: the worker's read with a lease ends it (the gRPC gateway
        does); False for a tier whose leases only this process can end (an in-cluster
        ``ClusterTier``: the fetcher reads with the id unknown), so the scheduler ends each
        load's lease when it plans the step after it."""
        self._hits = hits
        self._reads_end_leases = reads_end_leases
        self._sent_leases: list[str] = []
        self.fingerprint = fingerprint
        self.mode = mode
        self.traffic_class = traffic_class
        self._retry_after_s = retry_after_s
        self._load, self._save = load, save
        self._clock = clock
        self._down_until = 0.0
        self._requests: dict[str, _Tracked] = {}
        self._next = StepPlan()
        self.lookups = 0
        self.lookup_failures = 0

    def keys(self, token_ids: Sequence[int], blocks: int) -> list[BlockKey]:
        """Keys of the first ``blocks`` full blocks of ``token_ids``."""
        return block_keys(self.fingerprint, list(token_ids[: blocks * BLOCK_TOKENS]))

    def _answer(self, request_id: str, prompt: Sequence[int]) -> HitAnswer | None:
        tracked = self._requests.get(request_id)
        if tracked is not None:
            return tracked.answer
        answer = None
        full = (len(prompt) - 1) // BLOCK_TOKENS  # ≥ 1 token is always computed
        if self._load and full > 0 and self._clock() >= self._down_until:
            self.lookups += 1
            try:
                answer = self._hits.query_hit(
                    HitRequest(
                        block_keys=self.keys(prompt, full),
                        prompt_len=len(prompt),
                        mode=self.mode,
                        traffic_class=self.traffic_class,
                        take_lease=True,
                    )
                )
            except Exception as error:  # noqa: BLE001 - a tier that does not answer is a miss
                self.lookup_failures += 1
                self._down_until = self._clock() + self._retry_after_s
                log.warning(
                    "kvstore lookup failed (%s); every lookup is a miss for %.0f s",
                    describe(error),
                    self._retry_after_s,
                )
        self._requests[request_id] = _Tracked(answer)
        return answer

    def matched_tokens(
        self, request_id: str, prompt: Sequence[int], num_computed_tokens: int
    ) -> int:
        """Tokens beyond ``num_computed_tokens`` (a whole number of blocks: the engine's own
        prefix cache) that the tier can provide: whole blocks, at most ``len(prompt) − 1``."""
        if num_computed_tokens % BLOCK_TOKENS:
            raise InvalidArgument(
                "num_computed_tokens",
                f"{num_computed_tokens} is not whole {BLOCK_TOKENS}-token blocks",
            )
        answer = self._answer(request_id, prompt)
        hit = 0 if answer is None else answer.plan.hit_tokens
        hit = min(hit, (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)
        self._requests[request_id].computed = num_computed_tokens
        return max(hit - num_computed_tokens, 0)

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """The engine gave the request ``block_ids`` (its whole block table) and accepted
        ``num_external`` tokens from the tier: plan the load of those blocks."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(None)
        tracked.block_ids = [int(b) for b in block_ids]
        if num_external <= 0:
            self._release(tracked)
            return
        answer = tracked.answer
        if answer is None or num_external % BLOCK_TOKENS:
            raise InvalidArgument(
                "num_external_tokens", f"{num_external} is not whole blocks of a planned hit"
            )
        first = tracked.computed // BLOCK_TOKENS
        last = first + num_external // BLOCK_TOKENS
        keys = answer.hit_block_keys
        if last > len(keys) or last > len(tracked.block_ids):
            raise InvalidArgument(
                "num_external_tokens",
                f"{num_external} tokens from block {first} exceed the hit "
                f"({len(keys)} blocks) or the block table ({len(tracked.block_ids)})",
            )
        load = PagedLoad(
            request_id,
            tuple(tracked.block_ids[first:last]),
            tuple(bytes(k) for k in keys[first:last]),
            answer.lease_id,
        )
        tracked.loading = load
        tracked.saved_blocks = last  # what was loaded is in the tier already
        self._next.loads.append(load)

    def step(
        self,
        request_id: str,
        tokens: Sequence[int],
        computed: int,
        *,
        table: Sequence[int] | None = None,
        appended: Sequence[int] = (),
    ) -> None:
        """The step being planned takes the request to ``computed`` tokens of KV (``tokens``
        holds at least those). ``table``: its whole block table (a new or resumed request),
        else ``appended``: blocks that joined it. Saves the blocks this step completes."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked(None)
        if table is not None:
            tracked.block_ids = [int(b) for b in table]
        else:
            tracked.block_ids.extend(int(b) for b in appended)
        if tracked.saved_blocks < 0:
            # Blocks the engine had cached itself were saved when it computed them.
            tracked.saved_blocks = tracked.computed // BLOCK_TOKENS
        full = min(computed, len(tokens)) // BLOCK_TOKENS
        full = min(full, len(tracked.block_ids))
        if not self._save or full <= tracked.saved_blocks:
            return
        first = tracked.saved_blocks
        keys = self.keys(tokens, full)[first:]
        self._next.saves.append(
            PagedSave(
                request_id,
                tuple(tracked.block_ids[first:full]),
                tuple(bytes(k) for k in keys),
                self.traffic_class,
            )
        )
        tracked.saved_blocks = full
        tracked.saves_emitted += 1

    def build(self) -> StepPlan:
        """Everything decided since the last call (a load goes out once)."""
        plan, self._next = self._next, StepPlan()
        # The loads sent with the last plan have run (a late one reads without its lease: at
        # worst a miss, recomputed).
        for lease in self._sent_leases:
            self._release_id(lease)
        self._sent_leases = []
        for load in plan.loads:
            if load.lease_id is not None and not self._reads_end_leases:
                self._sent_leases.append(load.lease_id)
            tracked = self._requests.get(load.request_id)
            if tracked is not None:
                tracked.loading = None
                if tracked.answer is not None:  # the load's read ends the lease
                    tracked.answer = dataclasses.replace(tracked.answer, lease_id=None)
        return plan

    def finished(self, request_id: str) -> bool:
        """The request is done: True when its blocks must stay allocated until the worker
        reports it (it has saves whose rows are read during a step)."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return False
        if tracked.loading is not None:  # planned, never sent: drop it, give the lease back
            self._next.loads = [x for x in self._next.loads if x is not tracked.loading]
            self._release(tracked)
        if tracked.saves_emitted:
            self._next.finished[request_id] = tracked.saves_emitted
            return True
        return False

    def _release(self, tracked: _Tracked) -> None:
        answer = tracked.answer
        if answer is None or answer.lease_id is None:
            return
        tracked.answer = dataclasses.replace(answer, lease_id=None)
        self._release_id(answer.lease_id)

    def _release_id(self, lease: str) -> None:
        try:
            self._hits.release_lease(lease)
        except Exception:  # noqa: BLE001 - an unreleased lease only expires later
            log.info("lease %s not released", lease, exc_info=True)


# --- the worker half ---------------------------------------------------------------------------


def _run_start(ids: np.ndarray) -> int | None:
    """``ids[0]`` when ``ids`` are consecutive ascending (copy them as one span), else None."""
    if ids.size and np.array_equal(ids, np.arange(ids[0], ids[0] + ids.size)):
        return int(ids[0])
    return None


@dataclass
class WorkerStats:
    """Figures a benchmark reads: what moved and how long the forward waited for it."""

    loads: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    bytes_loaded: int = 0
    #: Seconds from a load's start to its last layer being copied in.
    load_seconds: float = 0.0
    #: Seconds from a load's start until the fetcher had staged its first layer (the tier's
    #: read: every block is read before any layer is published) and its last layer.
    read_seconds: float = 0.0
    staged_seconds: float = 0.0
    #: Seconds the forward spent waiting in ``wait_layer`` (the part not hidden by compute).
    wait_seconds: float = 0.0
    blocks_saved: int = 0
    saves_dropped: int = 0
    saves_failed: int = 0


@dataclass
class _ActiveLoad:
    load: PagedLoad
    staged: StagedFetch | None
    started: float
    ids: Any = None  # torch index of the good blocks' engine ids, made once
    run: int | None = None  # first id when those ids are consecutive
    ok: np.ndarray | None = None
    layers_done: int = 0
    failed: bool = False


class PagedWorker:
    """The byte-moving half over per-layer block tensors (``[num_blocks, ...]`` each, block
    rows contiguous; any dtype: rows are copied as bytes)."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        reader_factory: ReaderFactory,
        writer: TierWriter,
        *,
        staging_bytes: int,
        staging_dir: str = "/dev/shm",
        layer_timeout_s: float = 30.0,
        max_pending_save_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        import torch

        self._torch = torch
        if not layers:
            raise InvalidArgument("layers", "needs at least one KV cache tensor")
        num_blocks = int(layers[0].shape[0])
        self._rows: list[torch.Tensor] = []
        for index, tensor in enumerate(layers):
            if int(tensor.shape[0]) != num_blocks:
                raise InvalidArgument(
                    f"layers[{index}]", f"has {tensor.shape[0]} blocks, layer 0 has {num_blocks}"
                )
            if not tensor.is_contiguous():
                raise InvalidArgument(f"layers[{index}]", "block rows must be contiguous")
            # A view of the same memory in which a row is one block of this layer, whatever the
            # dtype: 8-byte words when the row allows (copies of 1-byte elements run several
            # times slower), else bytes.
            raw = tensor.view(num_blocks, -1).view(torch.uint8)
            self._rows.append(raw.view(torch.int64) if raw.shape[1] % 8 == 0 else raw)
        self.num_blocks = num_blocks
        self.kv = KVLayout.blocks_only(
            [int(rows.shape[1]) * rows.element_size() for rows in self._rows]
        )
        self._layer_timeout = layer_timeout_s
        self._max_pending_bytes = max_pending_save_bytes
        self._writer = writer
        self.area = StagingArea(staging_bytes, staging_dir)
        try:
            self.fetcher = Fetcher(reader_factory, self.area, self.kv)
        except BaseException:
            self.area.close()
            raise
        self.stats = WorkerStats()
        self._active: list[_ActiveLoad] = []
        self._gathers: list[tuple[PagedSave, list[torch.Tensor]]] = []
        self._errors: set[int] = set()
        self._gathered: dict[str, int] = {}
        self._awaiting: dict[str, int] = {}
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._save_warned = -_SAVE_WARNING_EVERY_S
        self._queue: queue.Queue[tuple[PagedSave, list[bytes]] | None] = queue.Queue()
        self._put_thread = threading.Thread(target=self._put_loop, name="kvstore-put", daemon=True)
        self._put_thread.start()

    @property
    def block_bytes(self) -> int:
        return self.kv.block_bytes

    # --- one step ----------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Begin this step: send its loads to the fetcher, open its saves."""
        now = time.perf_counter()
        for load in plan.loads:
            if any(not 0 <= b < self.num_blocks for b in load.block_ids):
                raise InvalidArgument("block_ids", f"must lie in [0, {self.num_blocks})")
            try:
                staged = self.fetcher.submit(load.keys, lease_id=load.lease_id)
            except KVStoreError as error:  # no room, no fetcher: recompute, nothing written
                log.warning("load of %s not started: %s", load.request_id, error)
                self._fail(_ActiveLoad(load, None, now))
                continue
            self._active.append(_ActiveLoad(load, staged, now))
        self._gathers = [(save, []) for save in plan.saves]
        self._awaiting.update(plan.finished)

    def wait_layer(self, layer: int) -> None:
        """Before ``layer`` runs: its rows of every load of this step are in the cache (or
        reported as load errors)."""
        started = time.perf_counter()
        for active in self._active:
            if active.failed or active.layers_done > layer:
                continue
            for index in range(active.layers_done, layer + 1):
                self._copy_layer(active, index)
                if active.failed:
                    break
        self.stats.wait_seconds += time.perf_counter() - started

    def _copy_layer(self, active: _ActiveLoad, layer: int) -> None:
        staged = active.staged
        assert staged is not None
        if not staged.wait_layer(layer, self._layer_timeout) or staged.failure is not None:
            log.warning(
                "load of %s failed at layer %d: %s",
                active.load.request_id,
                layer,
                staged.failure or "timed out",
            )
            self._fail(active)
            return
        if active.ok is None:
            active.ok = staged.block_ok()
            good = np.flatnonzero(active.ok)
            ids = np.asarray(active.load.block_ids, dtype=np.int64)[good]
            active.run = _run_start(ids)
            active.ids = self._torch.from_numpy(ids).to(self._rows[0].device)
        view = staged.layout.blocks_view(staged.region(), layer)
        if active.ids.numel():
            target = self._rows[layer]
            # Straight from staging when every block arrived (one copy, not two).
            rows = self._torch.from_numpy(view if active.ok.all() else view[active.ok])
            rows = rows.view(target.dtype).to(target.device)
            if active.run is not None:  # consecutive block ids (a fresh request's): one span
                target[active.run : active.run + rows.shape[0]].copy_(rows)
            else:
                target.index_copy_(0, active.ids, rows)
        active.layers_done = layer + 1

    def _fail(self, active: _ActiveLoad) -> None:
        # Layers already copied hold good bytes, but the engine recomputes the whole block:
        # a block is used only when every layer of it arrived.
        active.failed = True
        with self._lock:
            self._errors.update(active.load.block_ids)

    def save_layer(self, layer: int) -> None:
        """``layer`` is computed: copy its rows of this step's saves (the forward goes on)."""
        for save, rows in self._gathers:
            index = self._torch.as_tensor(save.block_ids, dtype=self._torch.int64)
            rows.append(self._rows[layer].index_select(0, index.to(self._rows[layer].device)))

    def finish_step(self) -> None:
        """End of the forward: finish this step's loads, hand its saves to the writer."""
        for active in self._active:
            if not active.failed:
                self.wait_layer(self.kv.num_layers - 1)
            staged = active.staged
            if staged is not None:
                staged.release()
            self.stats.loads += 1
            if active.failed:
                self.stats.blocks_failed += len(active.load.block_ids)
                continue
            assert active.ok is not None
            good = int(active.ok.sum())
            bad = np.asarray(active.load.block_ids)[~active.ok]
            with self._lock:
                self._errors.update(int(b) for b in bad)
            self.stats.blocks_loaded += good
            self.stats.blocks_failed += len(bad)
            self.stats.bytes_loaded += good * self.kv.block_bytes
            self.stats.load_seconds += time.perf_counter() - active.started
            first, last = (staged.staged_at[0], staged.staged_at[-1]) if staged else (None, None)
            if first is not None and last is not None:
                self.stats.read_seconds += first - active.started
                self.stats.staged_seconds += last - active.started
        self._active = []
        for save, rows in self._gathers:
            self._gathered[save.request_id] = self._gathered.get(save.request_id, 0) + 1
            if len(rows) != self.kv.num_layers:
                log.warning("save of %s skipped: not every layer ran", save.request_id)
                continue
            self._enqueue(save, rows)
        self._gathers = []

    def _enqueue(self, save: PagedSave, rows: list[torch.Tensor]) -> None:
        size = len(save.block_ids) * self.kv.block_bytes
        with self._lock:
            if self._pending_bytes + size > self._max_pending_bytes:
                self.stats.saves_dropped += len(save.block_ids)
                return
            self._pending_bytes += size
        host = [r.cpu().numpy().view(np.uint8) for r in rows]
        payloads = [
            b"".join(layer[i].tobytes() for layer in host) for i in range(len(save.block_ids))
        ]
        self._queue.put((save, payloads))

    def _put_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            save, payloads = item
            try:
                answer = self._writer.put_blocks(list(save.keys), payloads, save.traffic_class)
                self.stats.blocks_saved += answer.committed
                self.stats.saves_failed += len(answer.failed_keys)
            except Exception as error:  # noqa: BLE001 - a failed save is a future miss
                self.stats.saves_failed += len(save.keys)
                now = time.monotonic()
                if now - self._save_warned >= _SAVE_WARNING_EVERY_S:
                    self._save_warned = now
                    log.warning(
                        "kvstore save failed (%s); %d blocks failed so far",
                        describe(error),
                        self.stats.saves_failed,
                    )
            finally:
                with self._lock:
                    self._pending_bytes -= len(payloads) * self.kv.block_bytes
                self._queue.task_done()

    # --- what the engine asks after a step ---------------------------------------------------

    def load_errors(self) -> set[int]:
        """Engine blocks that failed to load since the last call: recompute them."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def finished_saving(self) -> set[str]:
        """Finished requests whose saves have all been gathered: free their blocks now."""
        done = {r for r, n in self._awaiting.items() if self._gathered.get(r, 0) >= n}
        for request in done:
            del self._awaiting[request]
            self._gathered.pop(request, None)
        return done

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every handed-out save has been put (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_bytes == 0 and self._queue.empty():
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.flush(timeout=10.0)
        self._queue.put(None)
        self._put_thread.join(timeout=10.0)
        self.fetcher.close()
        self.area.close()
