"""Save gather: the engine's KV rows → host memory, layer by layer, off the engine thread.

The one save mechanism of the engine side. A step's saves are one ``SaveBatch``: the engine
calls ``gather_layer(i)`` as soon as layer i's KV is written (vLLM's ``save_kv_layer``) and
``seal()`` once at the end of the step; the put thread then reads each save's host rows
(``host_rows``), assembles the payloads and puts them. The gather copies (a copy, so a put never
reads the engine's cache afterwards) run here:

- **CUDA:** on a side stream that first waits on an event recorded on the compute stream, device
  → pinned host memory with ``non_blocking``. ``seal`` makes the compute stream wait on the last
  gather, so the next step cannot overwrite a row before it is read; the host never waits for
  the device in the step (the put thread does, in ``host_rows``).
- **CPU:** in the ``kvstore-save-gather`` thread (``torch.index_select`` into the host buffer,
  which releases the GIL) while the engine thread computes the next layers. ``seal`` waits for
  them: the rows may be overwritten once it returns.

A gather that fails fails its batch's saves (``host_rows`` raises): a failed save is a future
miss, never an exception in the engine's step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.engine._torch import engine_thread, index_tensor, load_row_kernels, torch_module
from kvstore.engine.rows import KVRows
from kvstore.errors import InvalidArgument, SwapInError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveRows:
    """The rows one save reads: its blocks' (full-attention layers) and, for a window state,
    each sliding group's window rows."""

    block_ids: np.ndarray
    windows: tuple[np.ndarray, ...] = ()


def _gather(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """Rows ``index`` of ``source`` into ``out`` (the one device-to-host read of a save)."""
    import torch

    torch.index_select(source, 0, index, out=out)


class SaveBatch:
    """The saves of one step, gathered layer by layer (``gather_layer``), then ``seal``."""

    def __init__(self, gatherer: Gatherer, saves: Sequence[SaveRows]) -> None:
        rows = gatherer.rows
        self._gatherer = gatherer
        #: Per save: layer → (its row ids, the host tensor they are gathered into).
        self._jobs: list[dict[int, tuple[np.ndarray, Any]]] = []
        for save in saves:
            rows.check_ids(save.block_ids, "block_ids")
            for window in save.windows:
                rows.check_ids(window, "windows")
            jobs = {}
            for layer in range(rows.num_layers):
                ids = rows.ids_in_layer(layer, save.block_ids, save.windows)
                if ids.size:
                    jobs[layer] = (ids, gatherer.host_buffer(layer, ids.size))
            self._jobs.append(jobs)
        self._gathered: set[int] = set()
        self._pending = 0
        self._lock = threading.Lock()
        self._all_gathered = threading.Event()
        self._error: str | None = None
        self._last_event: Any = None
        self._sealed = False

    def gather_layer(self, layer: int) -> None:
        """Start reading ``layer`` of every save (call once the layer's KV is written)."""
        if self._sealed:
            raise InvalidArgument("layer", "this save batch is already sealed")
        if layer in self._gathered or not any(layer in jobs for jobs in self._jobs):
            return
        self._gathered.add(layer)
        if self._gatherer.cuda:
            self._gather_cuda(layer)
            return
        with self._lock:
            self._pending += 1
        self._gatherer.queue_job(lambda: self._gather_cpu(layer))

    def _layer_jobs(self, layer: int) -> list[tuple[np.ndarray, Any]]:
        return [jobs[layer] for jobs in self._jobs if layer in jobs]

    def _gather_cpu(self, layer: int) -> None:
        source = self._gatherer.rows.rows[layer]
        try:
            for ids, host in self._layer_jobs(layer):
                _gather(source, index_tensor(ids, source.device), host)
        except Exception as error:  # noqa: BLE001 - the batch's saves fail, the engine goes on
            log.exception("save gather of layer %d failed", layer)
            self._error = f"{type(error).__name__}: {error}"
        with self._lock:
            self._pending -= 1
            if self._pending == 0 and self._sealed:
                self._all_gathered.set()

    def _gather_cuda(self, layer: int) -> None:
        gatherer = self._gatherer
        torch, stream, device = gatherer.torch, gatherer.stream, gatherer.rows.device
        source = gatherer.rows.rows[layer]
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            stream.wait_event(computed)
            for ids, host in self._layer_jobs(layer):
                host.copy_(source.index_select(0, index_tensor(ids, device)), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._last_event = event

    def complete(self, save: int) -> bool:
        """Whether every layer save ``save`` reads was gathered (a layer that did not run this
        step leaves its save incomplete: it is not put)."""
        return set(self._jobs[save]) <= self._gathered

    def seal(self) -> None:
        """End of the step: order the next step after the gathers (CUDA), or wait for them
        (CPU: the engine may overwrite the rows once this returns)."""
        if self._sealed:
            return
        with self._lock:
            self._sealed = True
            if self._pending == 0:
                self._all_gathered.set()
        gatherer = self._gatherer
        if gatherer.cuda:
            if self._last_event is not None:
                current = gatherer.torch.cuda.current_stream(gatherer.rows.device)
                current.wait_event(self._last_event)
        else:
            self._all_gathered.wait()

    def host_rows(self, save: int) -> dict[int, np.ndarray]:
        """Save ``save``'s gathered rows by layer, as bytes ``[n, row]`` (the put thread calls
        this: on CUDA it waits for the gathers here, not in the step)."""
        if not self._sealed:
            raise SwapInError("save batch read before it was sealed")
        if self._last_event is not None:
            self._last_event.synchronize()
        if self._error is not None:
            raise SwapInError(f"save gather failed: {self._error}")
        return {layer: host.numpy().view(np.uint8) for layer, (_, host) in self._jobs[save].items()}


class Gatherer:
    """The gather thread (CPU) or side stream (CUDA) every save batch of one engine uses."""

    def __init__(self, rows: KVRows) -> None:
        self.rows = rows
        self.torch = torch_module()
        self.cuda = rows.cuda
        self.stream: Any = self.torch.cuda.Stream(device=rows.device) if self.cuda else None
        if self.cuda:
            load_row_kernels(rows.rows[0], self.stream)
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if not self.cuda:
            self._thread = engine_thread("kvstore-save-gather", self._serve)
        self._closed = False

    def begin(self, saves: Sequence[SaveRows]) -> SaveBatch:
        """A batch for this step's saves (validated now: bad row ids raise here)."""
        if self._closed:
            raise SwapInError("the save gatherer is closed")
        return SaveBatch(self, saves)

    def host_buffer(self, layer: int, n_rows: int) -> torch.Tensor:
        """Host memory for ``n_rows`` rows of ``layer`` (pinned on CUDA)."""
        like = self.rows.rows[layer]
        shape = (n_rows, int(like.shape[1]))
        return self.torch.empty(shape, dtype=like.dtype, pin_memory=self.cuda)

    def queue_job(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
