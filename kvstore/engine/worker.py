"""The connector's worker side: the bytes of a ``StepPlan`` moved between the tier and the cache.

Loads are fetched by the fetcher process (``kvstore.engine.fetcher``: it reads, checks and
stages them in /dev/shm, layer by layer) and copied into the engine's rows by swap-in
(``kvstore.engine.swapin``: its own thread, a side stream on CUDA). On a CPU cache moved into
shared memory (``kvstore.engine.sharedkv``) a step load's blocks land in the rows themselves,
and a step does not end while its fetch may still write them (``_end_in_place_writes``):

- a **step load** (a dense model) is waited for layer by layer: ``wait_layer(i)``, just before
  layer i runs, returns once layer i is in, so the fetch and copy of later layers overlap the
  compute of earlier ones; a block that did not arrive intact is never written and is reported
  by ``load_errors`` (the engine recomputes it);
- an **asynchronous load** (a hybrid model: its request waits until the load is done) is all or
  nothing: any block or the window state missing fails the whole load (``finished_loading``
  reports it) and the engine recomputes the request.

Saves are gathered layer by layer by the save gather (``kvstore.engine.save``: its own thread,
a side stream on CUDA) as each layer is computed (``save_layer``); the ``kvstore-put`` thread
assembles the payloads (layer-major) and puts them, the saves queued while a put ran together
in the next put. A decode-time window state is held until its request ends, then put (only the
last one). Past ``max_pending_save_bytes`` a save is dropped, never waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.engine.fetcher import Fetcher, StagedFetch
from kvstore.engine.groups import EngineGroups
from kvstore.engine.plan import PagedLoad, PagedSave, StateSave, StepPlan, describe
from kvstore.engine.rows import KVRows, as_ids
from kvstore.engine.save import Gatherer, SaveBatch, SaveRows
from kvstore.engine.sharedkv import move_or_none
from kvstore.engine.staging import StagingArea
from kvstore.engine.swapin import LayerLoad, LoadResult, LoadTarget, SwapIn
from kvstore.errors import KVStoreError, LoadTimeout
from kvstore.tier.protocols import ReaderFactory, TierWriter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A tier that is down fails every save; say so at most this often.
_SAVE_WARNING_EVERY_S = 30.0
#: How long a step's end waits for a fetch still writing into its KV rows before the fetcher is
#: killed (the fetch announces its end microseconds after its last layer; only a load given up
#: on can take longer).
_IN_PLACE_GRACE_S = 2.0
#: Save batches queued behind the one the put thread takes join its put up to this many bytes.
_GROUP_BYTES = 32 * 1024 * 1024


@dataclass
class WorkerStats:
    """Figures a benchmark reads: what moved and how long the forward waited for it."""

    loads: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0
    bytes_loaded: int = 0
    #: Of ``blocks_loaded``, those that landed in the KV rows themselves (no copy).
    blocks_in_place: int = 0
    #: Window states loaded and their bytes (a hybrid model's sliding layers).
    states_loaded: int = 0
    state_bytes_loaded: int = 0
    loads_failed: int = 0
    #: Seconds from a load's start to its last layer being copied in.
    load_seconds: float = 0.0
    #: Seconds from a load's start until the fetcher had staged its first layer (a direct
    #: read hands layers on as they arrive; through the gateway every block is read first)
    #: and its last layer.
    read_seconds: float = 0.0
    staged_seconds: float = 0.0
    #: Seconds the forward spent waiting in ``wait_layer`` (the part not hidden by compute).
    wait_seconds: float = 0.0
    blocks_saved: int = 0
    states_saved: int = 0
    saves_dropped: int = 0
    saves_failed: int = 0


@dataclass
class _Load:
    load: PagedLoad
    staged: StagedFetch | None
    handle: LayerLoad | None
    started: float


class PagedWorker:
    """The byte-moving half over per-layer block tensors (``[num_blocks, ...]`` each, block
    rows contiguous; any dtype: rows are copied as bytes), in the order ``groups`` names the
    layers (None: every layer is full attention)."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        reader_factory: ReaderFactory,
        writer: TierWriter,
        *,
        groups: EngineGroups | None = None,
        staging_bytes: int,
        staging_dir: str | None = None,
        layer_timeout_s: float = 30.0,
        max_pending_save_bytes: int = 256 * 1024 * 1024,
        loads_in_place: bool = True,
        views: Sequence[torch.Tensor] = (),
    ) -> None:
        """``loads_in_place``: on a CPU cache, move it into shared memory so step loads land
        in the rows themselves (``kvstore.engine.sharedkv``; ``views``: the engine's other
        tensors over that memory, moved with it); before anything here views it. A hybrid
        model's loads are all asynchronous (``_in_place``): its cache stays put."""
        on_cpu = bool(layers) and all(t.device.type == "cpu" for t in layers)
        step_loads = groups is None or not groups.sliding_groups
        wanted = loads_in_place and on_cpu and step_loads
        self.shared = move_or_none(layers, views) if wanted else None
        self.rows = KVRows.of(layers, groups)
        self.kv = self.rows.kv
        self.num_blocks = self.rows.num_blocks
        self._layer_timeout = layer_timeout_s
        self._max_pending_bytes = max_pending_save_bytes
        self._writer = writer
        self.area = StagingArea(staging_bytes, staging_dir)
        self._reader_factory = reader_factory
        try:
            self.fetcher = Fetcher(reader_factory, self.area, self.kv, shared=self.shared)
        except BaseException:
            self.area.close()
            raise
        self.swapin = SwapIn(self.rows, area=self.area, layer_timeout_s=layer_timeout_s)
        self.gatherer = Gatherer(self.rows)
        self.stats = WorkerStats()
        self._step_loads: list[_Load] = []
        self._async_loads: list[_Load] = []
        self._batch: SaveBatch | None = None
        self._saves: list[PagedSave] = []
        self._errors: set[int] = set()
        #: Asynchronous loads finished since the engine last asked (all of them / the failed).
        self._loaded: set[str] = set()
        self._load_failed: set[str] = set()
        self._load_figures: list[tuple[int, float]] = []
        self._gathered: dict[str, int] = {}
        self._awaiting: dict[str, int] = {}
        self._held: dict[str, tuple[StateSave, bytes]] = {}
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._save_warned = -_SAVE_WARNING_EVERY_S
        #: (a sealed batch, its admitted saves by index in the batch), or a request that ended.
        self._queue: queue.Queue[tuple[SaveBatch, list[tuple[int, PagedSave]]] | str | None] = (
            queue.Queue()
        )
        self._put_thread = threading.Thread(target=self._put_loop, name="kvstore-put", daemon=True)
        self._put_thread.start()

    @property
    def block_bytes(self) -> int:
        return self.kv.block_bytes

    # --- one step ----------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Begin this step: send its loads to the fetcher and swap-in, open its saves."""
        now = time.perf_counter()
        for load in plan.loads:
            target = LoadTarget(
                load.request_id,
                self.rows.check_ids(load.block_ids, "block_ids"),
                tuple(self.rows.check_ids(w, "windows") for w in load.windows),
                whole=load.asynchronous,
            )
            try:
                staged = self.fetcher.submit(
                    load.keys,
                    lease_id=load.lease_id,
                    state_key=load.state_key,
                    state_position=load.state_position,
                    direct=load.direct,
                    by_layer=self.swapin.cuda,
                    rows=target.block_ids if self._in_place(load) else None,
                )
            except KVStoreError as error:  # no room, no fetcher: recompute, nothing written
                log.warning("load of %s not started: %s", load.request_id, error)
                self._account(_Load(load, None, None, now), None)
                continue
            entry = _Load(load, staged, self.swapin.submit(staged, target), now)
            (self._async_loads if load.asynchronous else self._step_loads).append(entry)
        self._saves = list(plan.saves)
        self._batch = self.gatherer.begin([self._rows_of(save) for save in plan.saves])
        self._awaiting.update(plan.finished)
        for request in plan.ended:
            self._queue.put(request)  # after the request's saves already queued

    def _in_place(self, load: PagedLoad) -> bool:
        """Whether ``load`` lands in the KV rows themselves: a step load on a shared cache.
        (An asynchronous load's request may be aborted while it is read, and vLLM frees its
        rows then: its bytes go through staging, where a late write harms nothing.)"""
        return self.shared is not None and not load.asynchronous

    def _end_in_place_writes(self, entries: Sequence[_Load]) -> None:
        """Before a step ends, every fetch writing into its KV rows must be over: after the
        step vLLM may recompute those rows (a failed load) or hand them to another request.
        One still running (its load abandoned, the fetcher stuck on a node) ends with its
        fetcher process: killed, so it writes nothing more, and a new one started."""
        for entry in entries:
            staged = entry.staged
            if staged is None or not staged.layout.blocks_in_place:
                continue
            if staged.wait_finished(_IN_PLACE_GRACE_S):
                continue
            log.error(
                "kvstore: the fetch into %s's KV rows did not end with its step; "
                "restarting the fetcher so that it can write nothing more",
                entry.load.request_id,
            )
            self.fetcher.kill()
            self.fetcher = Fetcher(self._reader_factory, self.area, self.kv, shared=self.shared)

    def _rows_of(self, save: PagedSave) -> SaveRows:
        windows = save.state.windows if save.state is not None else ()
        return SaveRows(as_ids(save.block_ids), tuple(as_ids(w) for w in windows))

    def wait_layer(self, layer: int) -> None:
        """Before ``layer`` runs: its rows of every step load are in the cache (or reported as
        load errors when the load failed)."""
        started = time.perf_counter()
        for entry in self._step_loads:
            if entry.handle is None:
                continue
            try:
                entry.handle.wait(layer, self._layer_timeout * (layer + 1))
            except LoadTimeout as error:
                log.warning("load of %s abandoned: %s", entry.load.request_id, error)
                entry.handle.abandon()
                self._account(entry, None)
                entry.handle = None
        self.stats.wait_seconds += time.perf_counter() - started

    def save_layer(self, layer: int) -> None:
        """``layer`` is computed: gather its rows of this step's saves (off this thread)."""
        if self._batch is not None:
            self._batch.gather_layer(layer)

    def finish_step(self) -> None:
        """End of the forward: finish this step's loads, hand its saves to the put thread."""
        for entry in self._step_loads:
            if entry.handle is not None:
                self.wait_layer(self.kv.num_layers - 1)
                self._account(entry, entry.handle.result())
        self._end_in_place_writes(self._step_loads)
        self._step_loads = []
        batch, saves = self._batch, self._saves
        self._batch, self._saves = None, []
        if batch is None:
            return
        batch.seal()
        queued = []
        for index, save in enumerate(saves):
            self._gathered[save.request_id] = self._gathered.get(save.request_id, 0) + 1
            if not batch.complete(index):
                log.warning("save of %s skipped: not every layer ran", save.request_id)
            elif self._admit(save):
                queued.append((index, save))
        if queued:
            self._queue.put((batch, queued))

    def _account(self, entry: _Load, result: LoadResult | None) -> None:
        """Stats and load errors of a finished load (``result`` None: it never ran)."""
        stats, load = self.stats, entry.load
        stats.loads += 1
        if result is None or result.error is not None:
            if result is not None:
                log.warning("load of %s failed: %s", load.request_id, result.error)
            stats.loads_failed += 1
            stats.blocks_failed += len(load.block_ids)
            with self._lock:
                if load.asynchronous:
                    self._load_failed.add(load.request_id)
                else:
                    self._errors.update(load.block_ids)
            return
        with self._lock:
            self._errors.update(result.failed_block_ids)
            if load.asynchronous:
                self._loaded.add(load.request_id)
        stats.blocks_loaded += result.blocks_loaded
        if entry.staged is not None and entry.staged.layout.blocks_in_place:
            stats.blocks_in_place += result.blocks_loaded
        stats.blocks_failed += len(result.failed_block_ids)
        stats.bytes_loaded += result.blocks_loaded * self.kv.block_bytes
        if result.state_loaded:
            stats.states_loaded += 1
            stats.state_bytes_loaded += self.kv.state_bytes
        ended = time.perf_counter()
        stats.load_seconds += ended - entry.started
        staged = entry.staged
        first, last = (staged.staged_at[0], staged.staged_at[-1]) if staged else (None, None)
        if first is not None and last is not None:
            stats.read_seconds += first - entry.started
            stats.staged_seconds += last - entry.started
        moved = result.blocks_loaded * self.kv.block_bytes
        if moved:
            with self._lock:
                self._load_figures.append((moved, (last or ended) - entry.started))

    def take_load_figures(self) -> list[tuple[int, float]]:
        """(bytes, seconds from start to last layer staged) of each load finished since the
        last call: what the scheduler side's ``LoadWorth`` learns the tier's speed from."""
        with self._lock:
            figures, self._load_figures = self._load_figures, []
        return figures

    def _save_bytes(self, save: PagedSave) -> int:
        return len(save.block_ids) * self.kv.block_bytes + (
            self.kv.state_bytes if save.state is not None else 0
        )

    def _admit(self, save: PagedSave) -> bool:
        size = self._save_bytes(save)
        with self._lock:
            if self._pending_bytes + size > self._max_pending_bytes:
                self.stats.saves_dropped += _save_items(save)
                return False
            self._pending_bytes += size
        return True

    # --- the put thread ----------------------------------------------------------------------

    def _put_loop(self) -> None:
        while True:
            items = self._waiting_items()
            try:
                saves = [
                    (batch, index, save)
                    for batch, queued in (item for item in items if isinstance(item, tuple))
                    for index, save in queued
                ]
                if saves:
                    self._put_saves(saves)
                if isinstance(items[-1], str):
                    self._put_held(items[-1])
            finally:
                for _ in items:
                    self._queue.task_done()
            if items[-1] is None:
                return

    def _waiting_items(self) -> list[tuple[SaveBatch, list[tuple[int, PagedSave]]] | str | None]:
        """The next item of the queue (waited for) and the save batches queued right behind
        it, up to ``_GROUP_BYTES`` and through the first request end (or close): what was
        queued while the last put ran goes out in one put. A put's cost is mostly per call
        (benchmarks/README.md: ~20 ms of CPU over a deployed tier's processes a put, ~0.2 ms
        a block), and a decode step saves a block or none a request."""
        items = [self._queue.get()]
        size = 0
        while isinstance(items[-1], tuple):
            size += sum(self._save_bytes(save) for _, save in items[-1][1])
            if size >= _GROUP_BYTES:
                break
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return items

    def _put_saves(self, saves: list[tuple[SaveBatch, int, PagedSave]]) -> None:
        """Put these saves' blocks, one put per traffic class, then their states in order."""
        ready: list[tuple[PagedSave, dict[int, np.ndarray]]] = []
        try:
            for batch, index, save in saves:
                try:
                    ready.append((save, batch.host_rows(index)))
                except Exception as error:  # noqa: BLE001 - a failed save is a future miss
                    self._save_failed(_save_items(save), error)
            failed: set[str] = set()  # the traffic classes whose put raised
            by_class: dict[str, list[tuple[PagedSave, dict[int, np.ndarray]]]] = {}
            for save, rows in ready:
                if save.block_ids:
                    by_class.setdefault(save.traffic_class, []).append((save, rows))
            for traffic_class, members in by_class.items():
                try:
                    self._put_blocks(members, traffic_class)
                except Exception as error:  # noqa: BLE001 - a failed save is a future miss
                    failed.add(traffic_class)
                    self._save_failed(sum(_save_items(save) for save, _ in members), error)
            for save, rows in ready:
                if save.state is None or (save.block_ids and save.traffic_class in failed):
                    continue  # no state, or its blocks failed: its state is not stored alone
                try:
                    self._keep_state(save.request_id, save.state, rows)
                except Exception as error:  # noqa: BLE001 - a failed save is a future miss
                    self._save_failed(1, error)
        finally:
            with self._lock:
                self._pending_bytes -= sum(self._save_bytes(save) for _, _, save in saves)

    def _save_failed(self, count: int, error: Exception) -> None:
        self.stats.saves_failed += count
        now = time.monotonic()
        if now - self._save_warned >= _SAVE_WARNING_EVERY_S:
            self._save_warned = now
            log.warning(
                "kvstore save failed (%s); %d saves failed so far",
                describe(error),
                self.stats.saves_failed,
            )

    def _put_blocks(
        self, saves: list[tuple[PagedSave, dict[int, np.ndarray]]], traffic_class: str
    ) -> None:
        """Assemble the saves' payloads (layer-major) and put them in one call (here, off the
        engine's thread). A block two requests saved in the same group goes once."""
        keys: list[bytes] = []
        payloads: list[bytes] = []
        seen: set[bytes] = set()
        for save, rows in saves:
            layers = [rows[layer] for layer in self.kv.block_layers]
            for i, key in enumerate(save.keys):
                if key not in seen:
                    seen.add(key)
                    keys.append(key)
                    payloads.append(b"".join(layer[i] for layer in layers))  # one copy
        answer = self._writer.put_blocks(keys, payloads, traffic_class)
        self.stats.blocks_saved += answer.committed
        self.stats.saves_failed += len(answer.failed_keys)

    def _keep_state(self, request: str, state: StateSave, rows: dict[int, np.ndarray]) -> None:
        """Put a save's window state, or hold it until its request ends (``hold``)."""
        payload = b"".join(rows[layer].tobytes() for layer in self.kv.state_layers)
        if state.hold:
            self._held[request] = (state, payload)  # the last one is put at the end
            return
        self._put_state(state, payload)

    def _put_state(self, state: StateSave, payload: bytes) -> None:
        self._writer.put_swa_state(
            state.key, state.position, payload, state_bytes=self.kv.state_bytes
        )
        self.stats.states_saved += 1

    def _put_held(self, request: str) -> None:
        held = self._held.pop(request, None)
        if held is None:
            return
        try:
            self._put_state(*held)
        except Exception as error:  # noqa: BLE001 - a failed save is a future miss
            self._save_failed(1, error)

    # --- what the engine asks after a step ---------------------------------------------------

    def load_errors(self) -> set[int]:
        """Engine blocks of step loads that failed since the last call: recompute them."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def finished_loading(self) -> tuple[set[str], set[str]]:
        """(asynchronous loads finished since the last call — failed ones included —, the
        failed ones): a failed one's request is recomputed from its start."""
        still = []
        for entry in self._async_loads:
            if entry.handle is not None and entry.handle.done():
                self._account(entry, entry.handle.result())
            else:
                still.append(entry)
        self._async_loads = still
        with self._lock:
            done, failed = self._loaded | self._load_failed, self._load_failed
            self._loaded, self._load_failed = set(), set()
        return done, failed

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
                if self._pending_bytes == 0 and self._queue.unfinished_tasks == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.flush(timeout=10.0)
        self.swapin.close(timeout=10.0)
        self.gatherer.close(timeout=10.0)
        self._queue.put(None)
        self._put_thread.join(timeout=10.0)
        self.fetcher.close()
        self.area.close()
        if self.shared is not None:
            self.shared.close()


def _save_items(save: PagedSave) -> int:
    """What a save stores: its blocks and its state, if it has one."""
    return len(save.keys) + (save.state is not None)
