"""The connector's worker side: the bytes of a ``StepPlan`` moved between the tier and the cache.

Loads are fetched by the fetcher process (``kvstore.gpu.fetcher``: it reads, checks and stages
them in /dev/shm, layer by layer); this side copies each staged layer into the engine's rows:

- a **step load** (a dense model) is copied by ``wait_layer(i)`` just before layer i runs, so
  the fetch of later layers overlaps the compute of earlier ones; a block that did not arrive
  intact is never written and is reported by ``load_errors`` (the engine recomputes it);
- an **asynchronous load** (a hybrid model: its request waits until the load is done) is copied
  by the ``kvstore-swapin`` thread as its layers land: the full-attention blocks into their rows,
  the window state into each sliding group's window rows. It is all or nothing: any block or
  the state missing fails the whole load (``finished_loading`` reports it), and the engine
  recomputes the request.

A save gathers its rows after each layer is computed (``save_layer``: a copy, so the put never
reads the engine's cache afterwards); the ``kvstore-put`` thread assembles the payloads
(layer-major) and puts them. A decode-time window state is held until its request ends, then
put (only the last one). Past ``max_pending_save_bytes`` a save is dropped, never waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.gpu.fetcher import Fetcher, StagedFetch
from kvstore.gpu.kvlayout import KVLayout
from kvstore.gpu.staging import StagingArea
from kvstore.integrations.groups import EngineGroups
from kvstore.integrations.plan import PagedLoad, PagedSave, StateSave, StepPlan, describe
from kvstore.tier.protocols import ReaderFactory, TierWriter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: A tier that is down fails every save; say so at most this often.
_SAVE_WARNING_EVERY_S = 30.0


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
    #: Window states loaded and their bytes (a hybrid model's sliding layers).
    states_loaded: int = 0
    state_bytes_loaded: int = 0
    loads_failed: int = 0
    #: Seconds from a load's start to its last layer being copied in.
    load_seconds: float = 0.0
    #: Seconds from a load's start until the fetcher had staged its first layer (the tier's
    #: read: every block is read before any layer is published) and its last layer.
    read_seconds: float = 0.0
    staged_seconds: float = 0.0
    #: Seconds the forward spent waiting in ``wait_layer`` (the part not hidden by compute).
    wait_seconds: float = 0.0
    blocks_saved: int = 0
    states_saved: int = 0
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
        row_bytes = [int(rows.shape[1]) * rows.element_size() for rows in self._rows]
        if groups is None:
            self.kv = KVLayout.blocks_only(row_bytes)
            self._window_of: list[int] = [-1] * len(row_bytes)
        else:
            if len(groups.layer_names) != len(layers) or set(row_bytes) != {groups.page_bytes}:
                raise InvalidArgument(
                    "layers",
                    f"{len(layers)} tensors of {sorted(set(row_bytes))} B rows do not "
                    f"match {len(groups.layer_names)} layers of {groups.page_bytes} B pages",
                )
            self.kv = groups.kv_layout()
            owner = groups.group_of_layer()
            sliding = groups.sliding_groups
            self._window_of = [sliding.index(g) if g in sliding else -1 for g in owner]
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
        self._gathers: list[tuple[PagedSave, dict[int, torch.Tensor]]] = []
        self._errors: set[int] = set()
        self._gathered: dict[str, int] = {}
        self._awaiting: dict[str, int] = {}
        self._held: dict[str, tuple[StateSave, bytes]] = {}
        self._loaded: set[str] = set()
        self._load_failed: set[str] = set()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._save_warned = -_SAVE_WARNING_EVERY_S
        #: (a save and its gathered rows by layer) or (None, a request that ended).
        self._queue: queue.Queue[tuple[PagedSave | None, Any] | None] = queue.Queue()
        self._put_thread = threading.Thread(target=self._put_loop, name="kvstore-put", daemon=True)
        self._put_thread.start()
        self._loads: queue.Queue[_ActiveLoad | None] = queue.Queue()
        self._swapin = threading.Thread(
            target=self._swapin_loop, name="kvstore-swapin", daemon=True
        )
        self._swapin.start()

    @property
    def block_bytes(self) -> int:
        return self.kv.block_bytes

    # --- one step ----------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Begin this step: send its loads to the fetcher, open its saves."""
        now = time.perf_counter()
        for load in plan.loads:
            rows = [*load.block_ids, *(b for window in load.windows for b in window)]
            if any(not 0 <= b < self.num_blocks for b in rows):
                raise InvalidArgument("block_ids", f"must lie in [0, {self.num_blocks})")
            try:
                staged = self.fetcher.submit(
                    load.keys,
                    lease_id=load.lease_id,
                    state_key=load.state_key,
                    state_position=load.state_position,
                )
            except KVStoreError as error:  # no room, no fetcher: recompute, nothing written
                log.warning("load of %s not started: %s", load.request_id, error)
                self._fail(_ActiveLoad(load, None, now))
                continue
            active = _ActiveLoad(load, staged, now)
            if load.asynchronous:
                self._loads.put(active)
            else:
                self._active.append(active)
        self._gathers = [(save, {}) for save in plan.saves]
        self._awaiting.update(plan.finished)
        for request in plan.ended:
            self._release_held(request)

    def wait_layer(self, layer: int) -> None:
        """Before ``layer`` runs: its rows of every step load are in the cache (or reported as
        load errors)."""
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
        item = self.kv.layers[layer]
        target = self._rows[layer]
        if item.block_nbytes and active.ids.numel():
            view = staged.layout.blocks_view(staged.region(), layer)
            # Straight from staging when every block arrived (one copy, not two).
            rows = self._torch.from_numpy(view if active.ok.all() else view[active.ok])
            rows = rows.view(target.dtype).to(target.device)
            if active.run is not None:  # consecutive block ids (a fresh request's): one span
                target[active.run : active.run + rows.shape[0]].copy_(rows)
            else:
                target.index_copy_(0, active.ids, rows)
        if item.state_nbytes and active.load.windows:
            window = self._torch.from_numpy(staged.layout.state_view(staged.region(), layer))
            window_ids = list(active.load.windows[self._window_of[layer]])
            rows = window.reshape(len(window_ids), -1).view(target.dtype).to(target.device)
            target.index_copy_(0, self._torch.as_tensor(window_ids, device=target.device), rows)
        active.layers_done = layer + 1

    def _fail(self, active: _ActiveLoad) -> None:
        # Layers already copied hold good bytes, but the engine recomputes the whole block:
        # a block is used only when every layer of it arrived.
        active.failed = True
        with self._lock:
            if active.load.asynchronous:
                self._load_failed.add(active.load.request_id)
            else:
                self._errors.update(active.load.block_ids)

    def _swapin_loop(self) -> None:
        while True:
            active = self._loads.get()
            if active is None:
                return
            try:
                self._copy_whole(active)
            except Exception:  # noqa: BLE001 - the load fails, the thread goes on
                log.exception("swap-in of %s failed", active.load.request_id)
                self._fail(active)
            self._account(active)
            with self._lock:
                if not active.failed:
                    self._loaded.add(active.load.request_id)

    def _copy_whole(self, active: _ActiveLoad) -> None:
        """An asynchronous load, all or nothing: every block and the state staged intact, then
        copied in; anything missing fails the load and nothing is copied."""
        staged = active.staged
        assert staged is not None
        load = active.load
        missing = None
        if not staged.wait_finished(self._layer_timeout * self.kv.num_layers):
            missing = "timed out"
        elif staged.failure is not None:
            missing = staged.failure
        elif not staged.block_ok().all():
            missing = f"{int((~staged.block_ok()).sum())} of {len(load.keys)} blocks"
        elif load.state_key is not None and not staged.state_ok():
            missing = f"the window state at {load.state_position}"
        if missing is not None:
            log.warning("load of %s failed (%s): recomputed", load.request_id, missing)
            self._fail(active)
            return
        for layer in range(self.kv.num_layers):
            self._copy_layer(active, layer)

    def _account(self, active: _ActiveLoad) -> None:
        staged = active.staged
        if staged is not None:
            staged.release()
        stats = self.stats
        stats.loads += 1
        if active.failed:
            stats.loads_failed += 1
            stats.blocks_failed += len(active.load.block_ids)
            return
        assert active.ok is not None
        good = int(active.ok.sum())
        bad = np.asarray(active.load.block_ids)[~active.ok]
        with self._lock:
            self._errors.update(int(b) for b in bad)
        stats.blocks_loaded += good
        stats.blocks_failed += len(bad)
        stats.bytes_loaded += good * self.kv.block_bytes
        if active.load.state_key is not None:
            stats.states_loaded += 1
            stats.state_bytes_loaded += self.kv.state_bytes
        stats.load_seconds += time.perf_counter() - active.started
        first, last = (staged.staged_at[0], staged.staged_at[-1]) if staged else (None, None)
        if first is not None and last is not None:
            stats.read_seconds += first - active.started
            stats.staged_seconds += last - active.started

    def save_layer(self, layer: int) -> None:
        """``layer`` is computed: copy its rows of this step's saves (the forward goes on)."""
        item = self.kv.layers[layer]
        source = self._rows[layer]
        for save, rows in self._gathers:
            ids: Sequence[int] = ()
            if item.block_nbytes:
                ids = save.block_ids
            elif item.state_nbytes and save.state is not None:
                ids = save.state.windows[self._window_of[layer]]
            if ids:
                index = self._torch.as_tensor(ids, dtype=self._torch.int64, device=source.device)
                rows[layer] = source.index_select(0, index)

    def finish_step(self) -> None:
        """End of the forward: finish this step's loads, hand its saves to the put thread."""
        for active in self._active:
            if not active.failed:
                self.wait_layer(self.kv.num_layers - 1)
            self._account(active)
        self._active = []
        for save, rows in self._gathers:
            self._gathered[save.request_id] = self._gathered.get(save.request_id, 0) + 1
            wanted = len(self.kv.block_layers) if save.block_ids else 0
            wanted += len(self.kv.state_layers) if save.state is not None else 0
            if len(rows) != wanted:
                log.warning("save of %s skipped: not every layer ran", save.request_id)
                continue
            self._enqueue(save, rows)
        self._gathers = []

    def _save_bytes(self, save: PagedSave) -> int:
        return len(save.block_ids) * self.kv.block_bytes + (
            self.kv.state_bytes if save.state is not None else 0
        )

    def _enqueue(self, save: PagedSave, rows: dict[int, Any]) -> None:
        size = self._save_bytes(save)
        with self._lock:
            if self._pending_bytes + size > self._max_pending_bytes:
                self.stats.saves_dropped += len(save.block_ids) + (save.state is not None)
                return
            self._pending_bytes += size
        self._queue.put((save, rows))

    def _release_held(self, request: str) -> None:
        """The request ended: its held decode state goes to the tier (after every save of
        the request already queued: the queue keeps their order)."""
        self._queue.put((None, request))

    # --- the put thread ----------------------------------------------------------------------

    def _put_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            save, rows = item
            try:
                if save is None:
                    self._put_held(rows)
                else:
                    self._put(save, rows)
            except Exception as error:  # noqa: BLE001 - a failed save is a future miss
                self.stats.saves_failed += (
                    1 if save is None else len(save.keys) + (save.state is not None)
                )
                now = time.monotonic()
                if now - self._save_warned >= _SAVE_WARNING_EVERY_S:
                    self._save_warned = now
                    log.warning(
                        "kvstore save failed (%s); %d saves failed so far",
                        describe(error),
                        self.stats.saves_failed,
                    )
            finally:
                if save is not None:
                    with self._lock:
                        self._pending_bytes -= self._save_bytes(save)
                self._queue.task_done()

    def _put(self, save: PagedSave, rows: dict[int, Any]) -> None:
        """Assemble the payloads (layer-major) and put them (here, off the engine's thread)."""
        if save.block_ids:
            host = [rows[layer].cpu().numpy().view(np.uint8) for layer in self.kv.block_layers]
            payloads = [
                b"".join(layer[i].tobytes() for layer in host) for i in range(len(save.keys))
            ]
            answer = self._writer.put_blocks(list(save.keys), payloads, save.traffic_class)
            self.stats.blocks_saved += answer.committed
            self.stats.saves_failed += len(answer.failed_keys)
        state = save.state
        if state is None:
            return
        payload = b"".join(
            rows[layer].cpu().numpy().view(np.uint8).tobytes() for layer in self.kv.state_layers
        )
        if state.hold:
            self._held[save.request_id] = (state, payload)  # the last one is put at the end
            return
        self._writer.put_swa_state(
            state.key, state.position, payload, state_bytes=self.kv.state_bytes
        )
        self.stats.states_saved += 1

    def _put_held(self, request: str) -> None:
        held = self._held.pop(request, None)
        if held is not None:
            state, payload = held
            self._writer.put_swa_state(
                state.key, state.position, payload, state_bytes=self.kv.state_bytes
            )
            self.stats.states_saved += 1

    # --- what the engine asks after a step ---------------------------------------------------

    def load_errors(self) -> set[int]:
        """Engine blocks of step loads that failed since the last call: recompute them."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def finished_loading(self) -> tuple[set[str], set[str]]:
        """(asynchronous loads finished since the last call — failed ones included —, the
        failed ones): a failed one's request is recomputed from its start."""
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
                if self._pending_bytes == 0 and self._queue.empty():
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.flush(timeout=10.0)
        self._loads.put(None)
        self._swapin.join(timeout=10.0)
        self._queue.put(None)
        self._put_thread.join(timeout=10.0)
        self.fetcher.close()
        self.area.close()
