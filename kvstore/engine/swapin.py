"""Swap-in: staged loads → the engine's KV rows, layer by layer, off the engine thread.

The one load mechanism of the engine side. The fetcher process (``kvstore.engine.fetcher``)
stages a load in /dev/shm and publishes it layer by layer; one ``kvstore-swapin`` thread takes
loads in submission order and, for each layer i, waits until layer i is staged, copies its rows
in (``KVRows``: the request's blocks in a full-attention layer, its window in a sliding one) and
signals layer i. The engine waits for that signal only (``LayerLoad.wait(i)``), just before it
runs layer i, so layer i's copy overlaps the compute of the layers before it.

- **CUDA:** the staging area is registered as pinned host memory once (``cudaHostRegister``;
  when that is refused, each copy goes through a pinned bounce buffer); copies are
  ``non_blocking`` on a side stream that first waits for the compute already queued (rows may
  be reused blocks that compute still reads), and each layer records one ``torch.cuda.Event``.
  ``wait(i)`` makes the *current* stream wait on event i: the host never waits for the device.
- **CPU:** the same thread does the copy (a numpy row scatter: a memcpy per row that releases
  the GIL; torch's CPU ``index_copy_`` goes element by element, about ten times slower), and
  the per-layer signal is host-side: layers land in order, so one counter under a condition is
  every layer's event.

A block is usable only when every layer of it was copied from bytes the tier returned: misses,
and every block of a load that failed part-way, are reported (``LoadResult.failed_block_ids``)
for the engine to recompute. A ``whole`` load (all or nothing: a hybrid model's, whose request
waits for it) first waits until everything is staged and copies nothing unless every block and
the window state arrived. A load the engine gave up on (``LayerLoad.abandon``) is never written
to afterwards: the engine may already be recomputing those rows.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.engine._torch import engine_thread, index_tensor, load_row_kernels, torch_module
from kvstore.engine.rows import KVRows, as_ids, run_start
from kvstore.engine.staging import StagedSource, StagingArea
from kvstore.errors import InvalidArgument, LoadTimeout, SwapInError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadTarget:
    """Where a staged load goes: the engine rows of each staged block (staging order) and, for
    a hybrid model, the rows of each sliding group's window."""

    request_id: str
    block_ids: np.ndarray
    windows: tuple[np.ndarray, ...] = ()
    #: All or nothing: any block or the window state missing fails the whole load.
    whole: bool = False


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    #: Engine blocks to recompute: misses, and every block of a load that failed.
    failed_block_ids: tuple[int, ...]
    blocks_loaded: int
    state_loaded: bool
    #: Why the whole load failed (nothing of it is usable), else None.
    error: str | None = None


@dataclass
class _Task:
    source: StagedSource
    target: LoadTarget
    load: LayerLoad
    #: CUDA: recorded on the submitter's stream; the side stream waits on it before it writes
    #: rows that compute already queued may still be reading.
    after: Any = None


class LayerLoad:
    """One load: ``wait(layer)`` before running a layer, ``result()`` at the end."""

    def __init__(self, request_id: str, num_layers: int, device: Any) -> None:
        self.request_id = request_id
        self.num_layers = num_layers
        self._device = device
        # Layers are signalled in order, so one counter and one condition say it all (cheaper
        # to build per load than an event per layer: a load is built on the step's path).
        self._ready_upto = 0
        self._changed = threading.Condition(threading.Lock())
        self._cuda_events: list[Any] = [None] * num_layers
        self._result: LoadResult | None = None
        #: Held while a layer is copied; ``abandon`` takes it so no copy runs after it returns.
        self._copying = threading.Lock()
        self._abandoned = False

    def _signal(self, layer: int, cuda_event: Any = None) -> None:
        self._cuda_events[layer] = cuda_event
        with self._changed:
            self._ready_upto = max(self._ready_upto, layer + 1)
            self._changed.notify_all()

    def _finish(self, result: LoadResult) -> None:
        with self._changed:
            self._result = result
            self._ready_upto = self.num_layers
            self._changed.notify_all()

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` is usable by compute on the current stream (CPU: its bytes are
        in; CUDA: its copy is queued and the current stream waits on it). ``LoadTimeout``
        after ``timeout`` seconds."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument("layer", f"must lie in [0, {self.num_layers}), got {layer}")
        if layer >= self._ready_upto:
            with self._changed:
                if not self._changed.wait_for(lambda: layer < self._ready_upto, timeout):
                    raise LoadTimeout(
                        f"request {self.request_id}: layer {layer} not loaded after {timeout} s"
                    )
        event = self._cuda_events[layer]
        if event is not None:
            torch_module().cuda.current_stream(self._device).wait_event(event)

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> LoadResult:
        """Wait for the whole load (its device copies included) and say what arrived."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._result is not None, timeout):
                raise LoadTimeout(f"request {self.request_id}: load not finished after {timeout} s")
        assert self._result is not None
        return self._result

    def abandon(self) -> None:
        """The engine recomputes this load's rows: nothing is copied into them from now on."""
        with self._copying:
            self._abandoned = True


class SwapIn:
    """The copy thread (and, on CUDA, the side stream) that moves staged loads into the rows."""

    def __init__(
        self,
        rows: KVRows,
        *,
        area: StagingArea | None = None,
        layer_timeout_s: float = 30.0,
    ) -> None:
        self.rows = rows
        self.layer_timeout_s = layer_timeout_s
        self._torch = torch_module()
        self.cuda = rows.cuda
        self._stream: Any = None
        self._registered: int | None = None
        #: Whether staged bytes reach the device straight from registered (pinned) memory.
        self.pinned_staging = False
        if self.cuda:
            self._stream = self._torch.cuda.Stream(device=rows.device)
            load_row_kernels(rows.rows[0], self._stream)
            if area is not None:
                self._register(area)
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._thread = engine_thread("kvstore-swapin", self._run)
        self._closed = False

    def _register(self, area: StagingArea) -> None:
        pointer, size = int(area.buffer.ctypes.data), int(area.buffer.nbytes)
        code = self._torch.cuda.cudart().cudaHostRegister(pointer, size, 0)
        if int(code) == 0:
            self._registered = pointer
            self.pinned_staging = True
        else:
            log.warning("cudaHostRegister of the staging area refused (%s): bounce buffers", code)

    def submit(self, source: StagedSource, target: LoadTarget) -> LayerLoad:
        """Queue a load (validated here: bad rows raise before anything is queued)."""
        if self._closed:
            raise SwapInError("swap-in is closed")
        if len(target.block_ids) != source.layout.n_blocks:
            raise InvalidArgument(
                "target", f"{len(target.block_ids)} target blocks for {source.layout.n_blocks}"
            )
        self.rows.check_ids(target.block_ids, "block_ids")
        for window in target.windows:
            self.rows.check_ids(window, "windows")
        load = LayerLoad(target.request_id, self.rows.num_layers, self.rows.device)
        after = None
        if self.cuda:
            after = self._torch.cuda.Event()
            after.record(self._torch.cuda.current_stream(self.rows.device))
        self._queue.put(_Task(source, target, load, after))
        return load

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._registered is not None:
            self._torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    # --- the copy thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                result = self._load(task)
            except Exception as error:  # noqa: BLE001 - the load fails, the thread goes on
                log.exception("swap-in of %s failed", task.target.request_id)
                result = self._failed(task, f"{type(error).__name__}: {error}")
            finally:
                task.source.release()
            task.load._finish(result)

    @staticmethod
    def _failed(task: _Task, why: str) -> LoadResult:
        ids = tuple(int(b) for b in task.target.block_ids)
        return LoadResult(task.target.request_id, ids, 0, False, why)

    def _missing(self, task: _Task) -> str | None:
        """A whole load: wait until all is staged; what is missing (None: nothing)."""
        source, target = task.source, task.target
        last = self.rows.num_layers - 1
        if not source.wait_layer(last, self.layer_timeout_s * self.rows.num_layers):
            return "timed out"
        if source.failure is not None:
            return source.failure
        ok = np.asarray(source.block_ok(), dtype=bool)
        if not ok.all():
            return f"{int((~ok).sum())} of {ok.size} blocks"
        if target.windows and not source.state_ok():
            return "the window state"
        return None

    def _load(self, task: _Task) -> LoadResult:
        source, target, load = task.source, task.target, task.load
        if target.whole:
            missing = self._missing(task)
            if missing is not None:
                return self._failed(task, f"{missing} did not arrive")
        if task.after is not None:
            self._stream.wait_event(task.after)
        kv, layout = self.rows.kv, source.layout
        ok: np.ndarray | None = None
        good = block_ids = as_ids(())
        windows: tuple[np.ndarray, ...] = ()
        last_event: Any = None
        for layer in range(kv.num_layers):
            if not source.wait_layer(layer, self.layer_timeout_s):
                return self._failed(task, f"layer {layer} not staged in {self.layer_timeout_s} s")
            if source.failure is not None:
                return self._failed(task, source.failure)
            item = kv.layers[layer]
            if layer == 0 and target.windows and source.state_ok():
                # The state's status is final before layer 0 is published.
                windows = target.windows
            if ok is None and item.block_nbytes:
                # Block statuses are set before the first layer with block bytes (a block
                # may still fail later: checked again after the last layer).
                ok = np.asarray(source.block_ok(), dtype=bool)
                good = np.flatnonzero(ok)
                block_ids = target.block_ids[good]
            with load._copying:
                if load._abandoned:
                    return self._failed(task, "abandoned by the engine")
                region = source.region()
                if item.block_nbytes and good.size and not layout.blocks_in_place:
                    assert ok is not None
                    staged = layout.blocks_view(region, layer)
                    self._scatter(layer, block_ids, staged if ok.all() else staged[good])
                if item.state_nbytes and windows:
                    ids = self.rows.ids_in_layer(layer, block_ids, windows)
                    self._scatter(layer, ids, layout.state_view(region, layer))
                event = None
                if self.cuda:
                    event = self._torch.cuda.Event()
                    event.record(self._stream)
                    last_event = event
            load._signal(layer, event)
        if last_event is not None:
            # The staging region must outlive the device copies that read it.
            last_event.synchronize()
        # A block may fail after its first layers were staged (``StageHeader.fail_blocks``):
        # what the statuses say once the last layer is in is final.
        final = np.asarray(source.block_ok(), dtype=bool)
        ok = final if ok is None else ok & final
        failed = target.block_ids[np.flatnonzero(~ok)]
        return LoadResult(
            target.request_id, tuple(int(b) for b in failed), int(ok.sum()), bool(windows)
        )

    def _scatter(self, layer: int, ids: np.ndarray, staged: np.ndarray) -> None:
        """Staged rows (bytes) into rows ``ids`` of ``layer``."""
        dest = self.rows.rows[layer]
        source = self.rows.host_view(staged, layer)
        start = run_start(ids)
        if not self.cuda:
            target = dest.numpy()
            if start is not None:  # consecutive ids (a fresh request's): one span
                target[start : start + ids.size] = source
            else:
                target[ids] = source
            return
        torch = self._torch
        with torch.cuda.stream(self._stream):
            host = torch.from_numpy(source)
            if not self.pinned_staging:
                host = host.pin_memory()
            device_rows = host.to(self.rows.device, non_blocking=True)
            if start is not None:
                dest[start : start + ids.size].copy_(device_rows, non_blocking=True)
            else:
                dest.index_copy_(0, index_tensor(ids, self.rows.device), device_rows)
