"""Save: device pools → tier, off the critical path (SPEC §6, §8).

What is saved and when (the connector decides; this module moves bytes):

- after the last prefill chunk: the prompt's full blocks that did not come from the tier, and the
  stored region of the state at ``p = floor((L − 1) / 128) · 128`` (none when L ≤ 128);
- at a decode boundary crossing: the block just completed, and a device-side copy of the ring
  (``DevicePools.snapshot_window``); at request end the state is stored from the last copy,
  anchored at the boundary below it.

Only the stored region is ever read: the stored SWA layers' windows, in window order. The dropped
region (consumer layers, fp32 accumulators) is never gathered.

How it stays off the step: a ``SaveBatch`` gathers layer by layer as the forward pass finishes
each layer (``gather_layer``), then ``seal`` is called once at the end of the step.

- CUDA: each gather runs on a side stream that first waits on an event recorded on the compute
  stream, and copies device → pinned host memory with ``non_blocking``; ``seal`` makes the
  compute stream wait on the last gather event, so the next step cannot overwrite a row before
  it is read. The host never waits for the device in the step; the put thread does, later.
- CPU: a gather thread does the copies while the engine thread computes; ``seal`` waits for them
  (the rows may be overwritten after it returns).

A put thread then assembles layer-major block payloads and calls the writer. A failed put is a
future miss, reported in ``SaveResult``, never an exception in the engine's step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, SwapInError
from kvstore.gpu._torch import index_tensor, torch_module
from kvstore.gpu.pools import DevicePools
from kvstore.keys import BlockKey, check_key
from kvstore.tier.protocols import TierWriter

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateSave:
    """The stored region of one slot, anchored at ``position``."""

    slot: int
    #: Key of the block that ends at ``position`` (the state's key in the tier).
    key: BlockKey
    position: int
    #: Tokens written into the ring when it is read (ignored with ``from_snapshot``).
    written: int = 0
    from_snapshot: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """One request's save: pool rows with their keys, and optionally its state."""

    request_id: str
    block_ids: tuple[int, ...] = ()
    keys: tuple[BlockKey, ...] = ()
    state: StateSave | None = None
    traffic_class: str = ""

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.keys):
            raise InvalidArgument(
                "block_ids", f"{len(self.block_ids)} blocks for {len(self.keys)} keys"
            )
        for index, key in enumerate(self.keys):
            check_key(key, f"keys[{index}]")


@dataclass(frozen=True)
class SaveResult:
    request_id: str
    saved_keys: tuple[BlockKey, ...]
    failed_keys: tuple[BlockKey, ...]
    state_saved: bool
    #: Why the state was not saved (None when saved, or when none was asked for).
    state_error: str | None = None
    error: str | None = None


class SaveTicket:
    """Completion of one request's save (the put included)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._done = threading.Event()
        self._result: SaveResult | None = None

    def _finish(self, result: SaveResult) -> None:
        self._result = result
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveResult:
        if not self._done.wait(timeout):
            raise SwapInError(f"save of {self.request_id} not finished after {timeout} s")
        assert self._result is not None
        return self._result


class _Staged:
    """Host buffers for one spec: per block layer ``[n, bytes]``, plus the stored state."""

    def __init__(self, saver: Saver, spec: SaveSpec) -> None:
        pools = saver.pools
        self.spec = spec
        self.ids = pools.check_block_ids(spec.block_ids, "block_ids")
        self.rows: dict[int, np.ndarray] = {}
        self.tensors: dict[int, Any] = {}
        if self.ids.size:
            for layer in pools.kv.block_layers:
                shape = (self.ids.size, pools.kv.layers[layer].block_nbytes)
                self.tensors[layer], self.rows[layer] = saver._host_buffer(shape)
        self.state_error: str | None = None
        self.positions: np.ndarray | None = None
        self.state_tensor: Any = None
        self.state: np.ndarray | None = None
        if spec.state is not None:
            try:
                self.positions = pools.window_positions(
                    spec.state.slot,
                    spec.state.position,
                    written=spec.state.written,
                    from_snapshot=spec.state.from_snapshot,
                )
            except KVStoreError as error:
                self.state_error = str(error)
            else:
                self.state_tensor, self.state = saver._host_buffer((pools.kv.state_bytes,))


class SaveBatch:
    """The saves of one step, gathered layer by layer (``gather_layer``), then ``seal``."""

    def __init__(self, saver: Saver, specs: Sequence[SaveSpec]) -> None:
        self._saver = saver
        self._staged = [_Staged(saver, spec) for spec in specs]
        self.tickets = [SaveTicket(spec.request_id) for spec in specs]
        self._gathered: set[int] = set()
        self._pending = 0
        self._lock = threading.Lock()
        self._all_gathered = threading.Event()
        self._error: str | None = None
        self._last_event: Any = None
        self._sealed = False

    def gather_layer(self, layer: int) -> None:
        """Start reading ``layer`` of every spec (call once the layer's compute is queued)."""
        if self._sealed:
            raise InvalidArgument("layer", "this save batch is already sealed")
        if layer in self._gathered:
            return
        self._gathered.add(layer)
        if self._saver.cuda:
            self._gather_cuda(layer)
            return
        with self._lock:
            self._pending += 1
        self._saver._gather_queue.put(lambda: self._gather_cpu(layer))

    def _jobs(self, layer: int) -> list[tuple[Any, Any, Any]]:
        """(device tensor, row index on the device, host tensor to fill) for ``layer``."""
        pools = self._saver.pools
        jobs: list[tuple[Any, Any, Any]] = []
        item = pools.kv.layers[layer]
        for staged in self._staged:
            if item.block_nbytes and staged.ids.size:
                index = index_tensor(staged.ids, pools.device)
                jobs.append((pools.block_kv[layer], index, staged.tensors[layer]))
            if item.state_nbytes and staged.positions is not None:
                state = staged.spec.state
                assert state is not None
                source = pools.snapshot[layer] if state.from_snapshot else pools.swa[layer]
                index = index_tensor(staged.positions, pools.device)
                span = staged.state_tensor[
                    item.state_offset : item.state_offset + item.state_nbytes
                ]
                jobs.append((source[state.slot], index, span.view(pools.kv.window_shape)))
        return jobs

    def _gather_cpu(self, layer: int) -> None:
        torch = self._saver._torch
        try:
            for source, index, host in self._jobs(layer):
                torch.index_select(source, 0, index, out=host)
        except Exception as error:  # noqa: BLE001 - the batch's saves fail, the engine goes on
            log.exception("save gather of layer %d failed", layer)
            self._error = f"{type(error).__name__}: {error}"
        with self._lock:
            self._pending -= 1
            if self._pending == 0 and self._sealed:
                self._all_gathered.set()

    def _gather_cuda(self, layer: int) -> None:
        torch, saver = self._saver._torch, self._saver
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(saver.pools.device))
        with torch.cuda.stream(saver._stream):
            saver._stream.wait_event(computed)
            for source, index, host in self._jobs(layer):
                host.copy_(source.index_select(0, index), non_blocking=True)
            event = torch.cuda.Event()
            event.record(saver._stream)
        self._last_event = event

    def seal(self) -> list[SaveTicket]:
        """End of the step: gather what was not gathered yet, order the next step after the
        gathers, and hand the batch to the put thread. Returns one ticket per spec."""
        if self._sealed:
            return self.tickets
        for layer in range(self._saver.pools.kv.num_layers):
            self.gather_layer(layer)
        with self._lock:
            self._sealed = True
            if self._pending == 0:
                self._all_gathered.set()
        saver = self._saver
        if saver.cuda:
            if self._last_event is not None:
                saver._torch.cuda.current_stream(saver.pools.device).wait_event(self._last_event)
        else:
            self._all_gathered.wait()
        saver._put_queue.put(self)
        return self.tickets

    # --- put thread ------------------------------------------------------------------------

    def _put(self) -> None:
        if self._last_event is not None:
            self._last_event.synchronize()
        saver = self._saver
        for staged, ticket in zip(self._staged, self.tickets, strict=True):
            ticket._finish(saver._put_one(staged, self._error))


class Saver:
    """Gathers from the pools and puts to the tier in background threads."""

    def __init__(
        self,
        pools: DevicePools,
        writer: TierWriter,
        *,
        on_done: Callable[[SaveResult], None] | None = None,
    ) -> None:
        self.pools = pools
        self.writer = writer
        self._on_done = on_done
        torch = torch_module()
        self._torch = torch
        self.cuda = pools.device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=pools.device) if self.cuda else None
        self._gather_queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._put_queue: queue.Queue[SaveBatch | None] = queue.Queue()
        self._gather_thread = threading.Thread(
            target=self._serve_gathers, name="kvstore-save-gather", daemon=True
        )
        self._put_thread = threading.Thread(
            target=self._serve_puts, name="kvstore-save-put", daemon=True
        )
        self._gather_thread.start()
        self._put_thread.start()
        self._closed = False

    def begin(self, specs: Sequence[SaveSpec]) -> SaveBatch:
        """A batch for this step's saves (validated now: bad block ids raise here)."""
        if self._closed:
            raise SwapInError("saver is closed")
        return SaveBatch(self, specs)

    def save(self, spec: SaveSpec) -> SaveTicket:
        """One save outside a step (e.g. the decode state at request end): gather and seal."""
        return self.begin([spec]).seal()[0]

    def _host_buffer(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        tensor = self._torch.empty(shape, dtype=self._torch.uint8, pin_memory=self.cuda)
        return tensor, tensor.numpy()

    def _serve_gathers(self) -> None:
        while True:
            job = self._gather_queue.get()
            if job is None:
                return
            job()

    def _serve_puts(self) -> None:
        while True:
            batch = self._put_queue.get()
            if batch is None:
                return
            try:
                batch._put()
            except Exception:  # noqa: BLE001 - never kill the put thread
                log.exception("save put failed")

    def _put_one(self, staged: _Staged, gather_error: str | None) -> SaveResult:
        spec = staged.spec
        if gather_error is not None:
            result = SaveResult(spec.request_id, (), spec.keys, False, gather_error, gather_error)
            self._notify(result)
            return result
        saved: tuple[BlockKey, ...] = ()
        failed: tuple[BlockKey, ...] = ()
        error: str | None = None
        if spec.keys:
            payloads = [
                np.concatenate([staged.rows[layer][row] for layer in self.pools.kv.block_layers])
                for row in range(len(spec.keys))
            ]
            try:
                answer = self.writer.put_blocks(
                    list(spec.keys), [p.tobytes() for p in payloads], spec.traffic_class
                )
            except Exception as exc:  # noqa: BLE001 - a failed put is a future miss
                error = f"put_blocks: {type(exc).__name__}: {exc}"
                failed = spec.keys
            else:
                lost = {bytes(key) for key in answer.failed_keys}
                saved = tuple(key for key in spec.keys if bytes(key) not in lost)
                failed = tuple(key for key in spec.keys if bytes(key) in lost)
        state_saved, state_error = False, staged.state_error
        if spec.state is not None and staged.state is not None:
            try:
                self.writer.put_swa_state(
                    spec.state.key, spec.state.position, staged.state.tobytes()
                )
                state_saved = True
            except Exception as exc:  # noqa: BLE001 - a failed put is a future miss
                state_error = f"put_swa_state: {type(exc).__name__}: {exc}"
        result = SaveResult(spec.request_id, saved, failed, state_saved, state_error, error)
        self._notify(result)
        return result

    def _notify(self, result: SaveResult) -> None:
        if self._on_done is not None:
            try:
                self._on_done(result)
            except Exception:  # noqa: BLE001 - a callback bug must not stop saving
                log.exception("save callback failed")

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued saves, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._gather_queue.put(None)
        self._gather_thread.join(timeout)
        self._put_queue.put(None)
        self._put_thread.join(timeout)
