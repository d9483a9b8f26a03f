"""Swap-in: staging → device pools, layer by layer, in a thread of the engine process (SPEC §8).

One copy thread per ``SwapIn`` takes loads in submission order. For each layer i of a load it
waits until the fetcher has published layer i in staging, copies it into the pools (blocks
scattered into the block-table rows, the SWA window into the sequence's slot) and signals layer
i. The model's layer i waits for that signal only, so layer i's copy overlaps the compute of the
layers before it.

- On CUDA the staging area is registered as pinned host memory once (``cudaHostRegister``; when
  that is refused, each layer goes through a pinned bounce buffer), copies are ``non_blocking``
  on a side stream, and each layer records one ``torch.cuda.Event``. ``LayerLoad.wait(i)`` makes
  the *current* stream wait on event i (``wait_event``): the host does not synchronise with the
  device; it only waits until the copy has been enqueued.
- On CPU the same code runs; the copy is done by the copy thread (torch releases the GIL while
  it copies) and each layer's signal is host-side: layers land in order, so one counter under
  a condition is the per-layer event (cheap to create on the step's path).

A block is marked loaded in the pools only when every layer of it was copied from bytes the tier
returned. Misses, and every block of a load whose fetch failed part-way, are reported as load
errors (``LoadResult.failed_block_ids``) so the engine recomputes them.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, LoadTimeout, SwapInError
from kvstore.gpu._torch import index_tensor, torch_module
from kvstore.gpu.pools import DevicePools, key_rows
from kvstore.gpu.staging import StagedSource, StagingArea
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadTarget:
    """Where a staged load goes: pool rows for each staged block, and the state slot."""

    request_id: str
    #: Physical block per staged block, in staging order (the hit part of the block table).
    block_ids: tuple[int, ...]
    #: Key of each staged block (marks the pool rows loaded).
    keys: tuple[BlockKey, ...]
    #: State slot for the SWA window (None: no state to load).
    slot: int | None = None
    #: Anchor of the staged window (the hit plan's SWA position).
    anchor: int | None = None

    #: ``keys`` validated, as an ``[n, 32]`` uint8 array (computed here, when the target is
    #: built on the scheduler side, not on the step's critical path).
    key_rows: np.ndarray = field(init=False, repr=False, compare=False)
    #: ``block_ids`` as an int64 array.
    rows: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.keys):
            raise InvalidArgument(
                "block_ids", f"{len(self.block_ids)} blocks for {len(self.keys)} keys"
            )
        if (self.slot is None) != (self.anchor is None):
            raise InvalidArgument("anchor", "give slot and anchor together")
        object.__setattr__(self, "key_rows", key_rows(self.keys))
        object.__setattr__(self, "rows", np.asarray(self.block_ids, dtype=np.int64))


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    loaded_block_ids: tuple[int, ...]
    #: Blocks the engine must recompute: misses, and all blocks of a failed fetch.
    failed_block_ids: tuple[int, ...]
    state_loaded: bool
    #: A state was expected (the plan found one) but did not arrive.
    state_failed: bool
    error: str | None = None


@dataclass
class _Task:
    source: StagedSource
    target: LoadTarget
    load: LayerLoad
    stage_timeout_s: float | None
    #: CUDA: recorded on the submitter's stream; the side stream waits on it before writing rows
    #: that compute already queued may still be reading.
    after: Any = None


class LayerLoad:
    """Handle of one load: ``wait(layer)`` before running a layer, ``result()`` at the end."""

    def __init__(self, request_id: str, num_layers: int, device: Any) -> None:
        self.request_id = request_id
        self.num_layers = num_layers
        self._device = device
        # Layers are signalled in order, so one counter and one condition say it all (cheaper to
        # build per load than an event per layer, and the load is built on the step's path).
        self._ready_upto = 0
        self._changed = threading.Condition(threading.Lock())
        self._cuda_events: list[Any] = [None] * num_layers
        self._done = False
        self._result: LoadResult | None = None

    def _signal(self, layer: int, cuda_event: Any = None) -> None:
        self._cuda_events[layer] = cuda_event
        with self._changed:
            self._ready_upto = max(self._ready_upto, layer + 1)
            self._changed.notify_all()

    def _finish(self, result: LoadResult) -> None:
        with self._changed:
            self._result = result
            self._ready_upto = self.num_layers
            self._done = True
            self._changed.notify_all()

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise InvalidArgument("layer", f"must be an integer, got {type(layer).__name__}")
        if not 0 <= int(layer) < self.num_layers:
            raise InvalidArgument("layer", f"must lie in [0, {self.num_layers}), got {layer}")
        return int(layer)

    def is_ready(self, layer: int) -> bool:
        """Layer ``layer`` has been copied (CPU) or its copy enqueued (CUDA)."""
        return self._check_layer(layer) < self._ready_upto

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Block until layer ``layer`` is usable by compute on the current stream.

        CPU: returns once the bytes are in the pools. CUDA: returns once the copy is enqueued,
        after making the current stream wait on the layer's event (no host–device sync).
        Raises ``LoadTimeout`` after ``timeout`` seconds.
        """
        layer = self._check_layer(layer)
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
        return self._done

    def result(self, timeout: float | None = None) -> LoadResult:
        """Wait for the whole load (including the device copies) and say what arrived."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._done, timeout):
                raise LoadTimeout(f"request {self.request_id}: load not finished after {timeout} s")
        assert self._result is not None
        return self._result


class SwapIn:
    """The copy thread (and, on CUDA, the side stream) that moves staged loads into the pools."""

    def __init__(
        self,
        pools: DevicePools,
        *,
        area: StagingArea | None = None,
        stage_timeout_s: float | None = 120.0,
    ) -> None:
        self.pools = pools
        self.stage_timeout_s = stage_timeout_s
        torch = torch_module()
        self._torch = torch
        self.cuda = pools.device.type == "cuda"
        self._stream: Any = None
        self._registered: tuple[int, int] | None = None
        #: Whether staged bytes reach the device straight from registered (pinned) memory.
        self.pinned_staging = False
        if self.cuda:
            self._stream = torch.cuda.Stream(device=pools.device)
            if area is not None:
                self._register(area)
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvstore-swapin", daemon=True)
        self._thread.start()
        self._closed = False

    def _register(self, area: StagingArea) -> None:
        pointer, size = int(area.buffer.ctypes.data), int(area.buffer.nbytes)
        code = self._torch.cuda.cudart().cudaHostRegister(pointer, size, 0)
        if int(code) == 0:
            self._registered = (pointer, size)
            self.pinned_staging = True
        else:
            log.warning("cudaHostRegister of the staging area refused (%s): bounce buffers", code)

    def submit(self, source: StagedSource, target: LoadTarget) -> LayerLoad:
        if self._closed:
            raise SwapInError("swap-in is closed")
        if len(target.block_ids) != source.layout.n_blocks:
            raise InvalidArgument(
                "target",
                f"{len(target.block_ids)} target blocks for {source.layout.n_blocks} staged",
            )
        self.pools.check_block_ids(target.rows, "target.block_ids")
        if target.slot is not None:
            self.pools.check_slot(target.slot)
        load = LayerLoad(target.request_id, self.pools.kv.num_layers, self.pools.device)
        after = None
        if self.cuda:
            after = self._torch.cuda.Event()
            after.record(self._torch.cuda.current_stream(self.pools.device))
        self._queue.put(_Task(source, target, load, self.stage_timeout_s, after))
        return load

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._registered is not None:
            self._torch.cuda.cudart().cudaHostUnregister(self._registered[0])
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

    def _failed(self, task: _Task, why: str) -> LoadResult:
        target = task.target
        self.pools.forget_loaded(target.block_ids)
        if target.slot is not None:
            self.pools.note_state_loaded(target.slot, None)
        return LoadResult(
            request_id=target.request_id,
            loaded_block_ids=(),
            failed_block_ids=tuple(target.block_ids),
            state_loaded=False,
            state_failed=target.slot is not None,
            error=why,
        )

    def _load(self, task: _Task) -> LoadResult:
        source, target, load = task.source, task.target, task.load
        pools, layout = self.pools, source.layout
        ids = target.rows
        # The rows are about to be overwritten: whatever they were loaded with is gone.
        pools.forget_loaded(ids)
        block_ok: np.ndarray | None = None
        state_ok = False
        last_event: Any = None
        if task.after is not None:
            self._stream.wait_event(task.after)
        for item in layout.kv.layers:
            if not source.wait_layer(item.layer, task.stage_timeout_s):
                return self._failed(task, f"layer {item.layer} not staged in time")
            if source.failure is not None:
                return self._failed(task, source.failure)
            if item.layer == 0:
                # The state's status is final before layer 0 is published.
                state_ok = bool(source.state_ok() and target.slot is not None)
                if state_ok:
                    assert target.slot is not None and target.anchor is not None
                    pools.set_ring_origin(target.slot, target.anchor)
            if block_ok is None and item.block_nbytes:
                # Block statuses are final before the first layer with block bytes.
                block_ok = np.asarray(source.block_ok(), dtype=bool)
            region = source.region()
            if item.block_nbytes and block_ok is not None and block_ok.any():
                rows = np.flatnonzero(block_ok)
                self._copy_blocks(
                    item.layer, ids[rows], layout.blocks_view(region, item.layer), rows
                )
            if item.state_nbytes and state_ok:
                assert target.slot is not None
                self._copy_window(item.layer, target.slot, layout.state_view(region, item.layer))
            event = None
            if self.cuda and (item.block_nbytes or item.state_nbytes):
                event = self._torch.cuda.Event()
                event.record(self._stream)
                last_event = event
            load._signal(item.layer, event)
        if last_event is not None:
            # The staging region must outlive the device copies reading it.
            last_event.synchronize()
        if block_ok is None:
            block_ok = np.asarray(source.block_ok(), dtype=bool)
        good = np.flatnonzero(block_ok)
        pools.mark_loaded(ids[good], target.key_rows[good])
        if target.slot is not None:
            pools.note_state_loaded(target.slot, target.anchor if state_ok else None)
        return LoadResult(
            request_id=target.request_id,
            loaded_block_ids=tuple(ids[good].tolist()),
            failed_block_ids=tuple(ids[np.flatnonzero(~block_ok)].tolist()),
            state_loaded=state_ok,
            state_failed=layout.with_state and not state_ok,
        )

    def _host(self, array: np.ndarray) -> torch.Tensor:
        tensor = self._torch.from_numpy(array)
        if self.cuda and not self.pinned_staging:
            pinned = self._torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor)
            return pinned
        return tensor

    def _copy_blocks(
        self, layer: int, block_ids: np.ndarray, staged: np.ndarray, rows: np.ndarray
    ) -> None:
        torch = self._torch
        pool = self.pools.block_layer(layer)
        if not self.cuda:
            # numpy's row scatter is a memcpy per row and releases the GIL; torch's CPU
            # index_copy_ goes element by element (≈ 10× slower here).
            source = staged if rows.size == staged.shape[0] else staged[rows]
            pool.numpy()[block_ids] = source
            return
        device = self.pools.device
        with torch.cuda.stream(self._stream):
            device_rows = self._host(staged).to(device, non_blocking=True)
            if rows.size != staged.shape[0]:
                device_rows = device_rows.index_select(0, index_tensor(rows, device))
            pool.index_copy_(0, index_tensor(block_ids, device), device_rows)

    def _copy_window(self, layer: int, slot: int, window: np.ndarray) -> None:
        if not self.cuda:
            self.pools.write_window(layer, slot, self._torch.from_numpy(window))
            return
        with self._torch.cuda.stream(self._stream):
            self.pools.write_window(layer, slot, self._host(window))
