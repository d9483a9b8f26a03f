"""The fetcher: a separate process that reads a hit plan's blocks and SWA state from the tier
into a /dev/shm staging region, layer by layer, announcing each layer as it lands
(docs/rules.md §8).

Why a process: reading from the tier (gRPC, Ray, checksums, erasure decoding) is Python work
that would otherwise hold the engine process's GIL while the model runs. The fetcher is a fresh
interpreter (``python -m kvstore.engine.fetcher``: no inherited CUDA context, locks or threads)
and never imports torch. It is started with ``subprocess``, not ``multiprocessing``, because
engines run their workers as daemonic ``multiprocessing`` processes (vLLM does), which
``multiprocessing`` forbids to have children; the pipes are ``multiprocessing.connection``
objects over inherited file descriptors, and the reader factory is the first message. The
staging area is inherited the same way, as its open (and locked) file: the fetcher maps that
descriptor and never opens the area by name, so a name unlinked or a file planted at it cannot
receive KV (``kvstore.engine.staging``, issue 31).

Protocol (two one-way pipes): the engine sends ``FetchJob`` objects (``None`` to stop); the
fetcher answers ``("layer", job, i)`` after it has written layer i and set its ready word,
``("done", job)`` at the end, or ``("failed", job, why)``. For each job it

1. reads the SWA state (when the plan found one), then the blocks, in one call each; the blocks
   are read when the first layer that has block KV is due, so the leading state-only layers
   are published while the block read is still in flight. A job carrying its lease's read
   grant reads the blocks straight from the storage nodes into their places in the region
   (``kvstore.engine.directfetch``), and only those the nodes did not give whole through the
   tier; a job with ``rows`` lands its blocks in the engine's shared KV cache instead, in those
   rows (``kvstore.engine.sharedkv``: the region then holds the header and the window only);
2. marks the state and each block OK or FAILED in the header: a miss, a wrong key or a wrong
   size is FAILED (a failed read is a miss, and its staged bytes are never copied to the pools);
3. writes layer 0's slices of every block read through the tier and its window, publishes
   layer 0, then layer 1, ...

The engine side (``Fetcher``) owns the process, a receiver thread that turns those messages into
per-layer ``threading.Event``s on a ``StagedFetch``, and the region's lifetime: a region goes back
to the area only once the fetcher has finished with it, so a late write can never land in the
next load's region. When the process dies, every load in flight fails at once (its blocks are
reported as load errors) instead of hanging.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvstore.childenv import child_env
from kvstore.engine.directfetch import DirectBlocks
from kvstore.engine.kvlayout import KVLayout
from kvstore.engine.plan import describe
from kvstore.engine.sharedkv import KVFile, SharedKV, check_rows
from kvstore.engine.staging import (
    OK,
    StageHeader,
    StageLayout,
    StagingArea,
    StagingRegion,
    map_staging_fd,
)
from kvstore.errors import InvalidArgument, SwapInError
from kvstore.geometry import GeometryConfig
from kvstore.keys import check_key
from kvstore.tier.protocols import ReaderFactory, TierReader
from kvstore.tier.records import DirectGrant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchJob:
    """One load for the fetcher process (plain data: it is pickled through a pipe)."""

    job_id: int
    region_offset: int
    region_nbytes: int
    kv: KVLayout
    keys: tuple[bytes, ...]
    lease_id: str | None = None
    state_key: bytes | None = None
    state_position: int | None = None
    #: The lease's read grant for ``keys`` (``PagedLoad.direct``): read from the nodes.
    direct: DirectGrant | None = None
    #: Hand the layers of a direct read on as they arrive (``_Layers.on_prefix``), not once
    #: every block is in: for an engine whose forward runs on a GPU. A CPU engine's forward
    #: shares its cores with the read; there reading whole first measured faster
    #: (``vllm_ttft.py``: 0.211 against 0.223 s, benchmarks/README.md).
    by_layer: bool = False
    #: Where the blocks land when the engine's KV cache is shared (``kvstore.engine.sharedkv``):
    #: block i in row ``rows[i]`` of every layer, read straight into place; None: in staging.
    rows: tuple[int, ...] | None = None

    @property
    def with_state(self) -> bool:
        return self.state_key is not None


class LayerGate(Protocol):
    """Called by the fetcher before it writes each layer. Must be picklable."""

    def before_layer(self, job_id: int, layer: int) -> None: ...


class FileGate:
    """Step-through gate: the fetcher writes layer i only once ``<directory>/open-<i>`` exists.

    Freezes a fetch at a layer boundary so the engine side can be observed mid-load (tests,
    debugging a stalled pipeline). Gives up after ``timeout_s`` and goes on.
    """

    def __init__(self, directory: str | os.PathLike[str], timeout_s: float = 60.0) -> None:
        self.directory = str(directory)
        self.timeout_s = timeout_s

    def open(self, *layers: int) -> None:
        for layer in layers:
            (Path(self.directory) / f"open-{layer}").touch()

    def before_layer(self, job_id: int, layer: int) -> None:
        flag = Path(self.directory) / f"open-{layer}"
        deadline = time.monotonic() + self.timeout_s
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.002)


# --- the fetcher process ----------------------------------------------------------------------


def fetcher_main(
    jobs: Connection,
    events: Connection,
    factory: ReaderFactory,
    gate: LayerGate | None,
    buffer: np.ndarray,
    kv_file: KVFile | None = None,
) -> None:
    """Entry point of the fetcher process: serve jobs into ``buffer`` (the mapped staging
    area) and ``kv_file`` (the engine's shared KV cache, if any) until ``None`` or the engine
    goes away."""
    try:
        reader = factory()
    except Exception as error:  # noqa: BLE001 - reported to the engine, which fails every load
        events.send(("dead", 0, f"reader factory failed: {type(error).__name__}: {error}"))
        return
    # One per process: its connections outlive a job; its choice of path is logged by the
    # engine side (this process has no log of its own).
    direct = DirectBlocks(on_decided=lambda text: events.send(("path", 0, text)))
    # No cyclic garbage collection during a job: a read allocates thousands of short-lived
    # objects, and the collections they set off walked every object of this process (grpc,
    # numpy, ...): ~9% of a 99 MB read's CPU here. The objects made so far are frozen (never
    # walked again); a job's cycles, if any, are collected after it.
    gc.freeze()

    def announce(*message: Any) -> None:
        events.send(message)

    while True:
        try:
            job = jobs.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        gc.disable()
        try:
            region = buffer[job.region_offset : job.region_offset + job.region_nbytes]
            run_job(job, region, reader, gate, announce, direct, kv_file)
        except Exception as error:  # noqa: BLE001 - one bad job must not stop the fetcher
            events.send(("failed", job.job_id, f"{type(error).__name__}: {error}"))
        finally:
            gc.enable()


def run_job(
    job: FetchJob,
    region: np.ndarray,
    reader: TierReader,
    gate: LayerGate | None,
    announce: Any,
    direct: DirectBlocks | None = None,
    kv_file: KVFile | None = None,
) -> None:
    """Fetch one job into its region, publishing layer by layer (also usable in-process).
    ``direct``: reads a job that carries a read grant from the storage nodes; ``kv_file``:
    where a job with ``rows`` lands its blocks."""
    kv = job.kv
    layout = StageLayout.plan(kv, len(job.keys), job.with_state, job.rows is not None)
    header = layout.header(region)
    header.check(job.job_id)
    target = _BlockTarget(layout, region, kv_file, job.rows)

    # The state first: layers without block KV (V4.1's two pure-SWA layers) become usable
    # while the blocks are still being read from the tier.
    state: np.ndarray | None = None
    if job.state_key is not None and job.state_position is not None:
        state = _read_state(reader, job.state_key, job.state_position, kv.state_bytes)
        header.set_state_status(state is not None)
    layers = _Layers(job, layout, region, target, gate, announce, state)
    layers.publish_until(layers.first_with_blocks)
    payloads, block_ok, lease_open = _load_blocks(
        reader, job, target, direct, layers if job.by_layer else None
    )
    if layers.statuses_set:  # handed on as they arrived: what failed since is a miss now
        header.fail_blocks(~block_ok)
    else:
        header.set_block_statuses(block_ok)
    layers.payloads = payloads
    layers.publish_until(kv.num_layers)
    header.publish_done()
    announce("done", job.job_id)
    if lease_open and job.lease_id is not None:
        _release(reader, job.lease_id)


class _BlockTarget:
    """Where a job's blocks land: its staging region, layer-major (row i of each layer's
    section: block i), or the engine's KV rows themselves (block i in row ``rows[i]``)."""

    def __init__(
        self,
        layout: StageLayout,
        region: np.ndarray,
        kv_file: KVFile | None,
        rows: Sequence[int] | None,
    ) -> None:
        self.layout, self.region = layout, region
        #: The KV file when the blocks land in its rows, None when they land in staging.
        self.kv_file: KVFile | None = None
        if rows is None:
            self.rows = np.arange(layout.n_blocks)
            return
        if kv_file is None:
            raise SwapInError("the job lands in the KV rows, but this fetcher has no KV file")
        self.kv_file = kv_file
        self.rows = check_rows(rows, kv_file.num_rows, layout.n_blocks)

    def buffer_and_segments(self) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
        """What a direct read writes into, and where each layer's slice of row 0 goes."""
        if self.kv_file is None:
            return self.region, self.layout.block_segments()
        return self.kv_file.buffer, self.kv_file.segments(self.layout.kv)

    def layer_rows(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s rows, indexed by ``self.rows``."""
        if self.kv_file is None:
            return self.layout.blocks_view(self.region, layer)
        return self.kv_file.rows(layer, self.layout.kv.layer(layer).block_nbytes)


class _Layers:
    """Publishes one job's layers in order, each once, after its gate: the window state's
    slices and the blocks read through the gateway (``payloads``) are copied in first; a
    block read directly is in place already. A direct read hands the layers on as its blocks'
    bytes arrive (``on_prefix``), so that layer 0 can be swapped in while the later layers
    are still on the wire."""

    def __init__(
        self,
        job: FetchJob,
        layout: StageLayout,
        region: np.ndarray,
        target: _BlockTarget,
        gate: LayerGate | None,
        announce: Any,
        state: np.ndarray | None,
    ) -> None:
        self.job, self.layout, self.region, self.target = job, layout, region, target
        self.header = layout.header(region)
        self._gate, self._announce, self._state = gate, announce, state
        kv = job.kv
        with_blocks = [item.layer for item in kv.layers if item.block_nbytes]
        #: The blocks are read when this layer is due (the last one when none has blocks).
        self.first_with_blocks = with_blocks[0] if with_blocks else kv.num_layers - 1
        #: Where each layer's block bytes end in a block.
        self._ends = [item.block_offset + item.block_nbytes for item in kv.layers]
        self.next = 0
        self.statuses_set = False
        self.payloads: list[np.ndarray | None] = []

    def publish_until(self, stop: int) -> None:
        """Publish the layers before ``stop`` not published yet."""
        kv = self.job.kv
        while self.next < stop:
            item = kv.layers[self.next]
            if self._gate is not None:
                self._gate.before_layer(self.job.job_id, item.layer)
            if item.block_nbytes and any(p is not None for p in self.payloads):
                rows, at = self.target.layer_rows(item.layer), self.target.rows
                start, stop_at = item.block_offset, item.block_offset + item.block_nbytes
                for index, payload in enumerate(self.payloads):
                    if payload is not None:
                        rows[at[index]] = payload[start:stop_at]
            if self._state is not None and item.state_nbytes:
                window = self.layout.state_view(self.region, item.layer)
                window.reshape(-1)[:] = self._state[
                    item.state_offset : item.state_offset + item.state_nbytes
                ]
            self.header.publish_layer(item.layer)
            self._announce("layer", self.job.job_id, item.layer)
            self.next += 1

    def on_prefix(self, nbytes: int, whole: np.ndarray, read: np.ndarray) -> bool:
        """A direct read's progress: every block in ``whole`` has its first ``nbytes`` bytes
        in place and checked; ``read``: the blocks it reads (the others are misses). Publishes
        the layers those bytes complete once every block read is that far; True once any
        layer with block bytes has been handed on (the read must not rewrite a block now)."""
        if whole[read].all():
            stop = self.next
            while stop < len(self._ends) and self._ends[stop] <= nbytes:
                stop += 1
            if stop > self.first_with_blocks and self.next <= self.first_with_blocks:
                self.header.set_block_statuses(read)  # a block failing later is failed then
                self.statuses_set = True
            self.publish_until(stop)
        return self.statuses_set


def _load_blocks(
    reader: TierReader,
    job: FetchJob,
    target: _BlockTarget,
    direct: DirectBlocks | None,
    layers: _Layers | None = None,
) -> tuple[list[np.ndarray | None], np.ndarray, bool]:
    """Which of the job's blocks were read, the payloads of those read through the gateway
    (to be copied into ``target``; a block read directly is already there), and whether the
    job's lease is still open (read directly in full: no gateway read ended it, the fetcher
    gives it back once the load is staged). With a grant, the blocks come from the storage
    nodes and only those that did not are read through the tier (a miss there too is a
    miss), unless ``layers`` handed some of them on while they arrived: then the blocks that
    did not come whole are misses."""
    nbytes = job.kv.block_bytes
    grant = job.direct
    if direct is None or grant is None or len(grant) != len(job.keys) or not job.keys:
        return (*_read_blocks(reader, job.keys, job.lease_id, nbytes), False)
    try:
        buffer, segments = target.buffer_and_segments()
        on_prefix = None if layers is None else layers.on_prefix
        placed = direct.read_into(grant, nbytes, buffer, segments, target.rows, on_prefix)
    except Exception as error:  # noqa: BLE001 - the gateway path still reads every block
        log.warning("direct read of %d blocks failed: %s", len(job.keys), error)
        placed = None
    payloads: list[np.ndarray | None] = [None] * len(job.keys)
    if layers is not None and layers.statuses_set:
        return payloads, np.zeros(len(job.keys), bool) if placed is None else placed, True
    if placed is None:
        return (*_read_blocks(reader, job.keys, job.lease_id, nbytes), False)
    missing = np.flatnonzero(~placed)
    if not missing.size:
        return payloads, placed, True
    keys = [job.keys[i] for i in missing.tolist()]
    again, again_ok = _read_blocks(reader, keys, job.lease_id, nbytes)  # ends the lease
    for index, payload in zip(missing.tolist(), again, strict=True):
        payloads[index] = payload
    block_ok = placed.copy()
    block_ok[missing] = again_ok
    return payloads, block_ok, False


def _release(reader: TierReader, lease_id: str) -> None:
    """Give back a lease read directly (the gateway read that would have ended it never
    happened); a reader that cannot end leases leaves it to its end."""
    release = getattr(reader, "release_lease", None)
    if release is None:
        return
    try:
        release(lease_id)
    except Exception as error:  # noqa: BLE001 - the lease ends on its own
        log.info("releasing lease %s after a direct read failed: %s", lease_id, describe(error))


def _read_state(reader: TierReader, key: bytes, position: int, nbytes: int) -> np.ndarray | None:
    try:
        answer = reader.get_swa_state(key, position, state_bytes=nbytes)
    except Exception as error:  # noqa: BLE001 - a failed read is a miss
        log.warning("SWA state read at %s failed: %s", position, error)
        return None
    if answer.state is None or len(answer.state) != nbytes:
        return None
    return np.frombuffer(answer.state, dtype=np.uint8)


def _read_blocks(
    reader: TierReader, keys: Sequence[bytes], lease_id: str | None, nbytes: int
) -> tuple[list[np.ndarray | None], np.ndarray]:
    payloads: list[np.ndarray | None] = [None] * len(keys)
    if not keys:
        return payloads, np.zeros(0, dtype=bool)
    try:
        reads = reader.get_blocks(list(keys), lease_id)
    except Exception as error:  # noqa: BLE001 - a failed read is a miss for every block
        log.warning("block read of %d keys failed: %s", len(keys), error)
        reads = []
    by_key = {bytes(read.key): read for read in reads}
    for index, key in enumerate(keys):
        read = by_key.get(bytes(key))
        if read is None or read.payload is None or len(read.payload) != nbytes:
            continue
        payloads[index] = np.frombuffer(read.payload, dtype=np.uint8)
    block_ok = np.array([payload is not None for payload in payloads], dtype=bool)
    return payloads, block_ok


# --- the engine side --------------------------------------------------------------------------


class StagedFetch:
    """One load being fetched into staging: per-layer readiness for swap-in (a ``StagedSource``)."""

    def __init__(
        self,
        fetcher: Fetcher,
        job_id: int,
        layout: StageLayout,
        region: StagingRegion,
        view: np.ndarray,
    ) -> None:
        self.job_id = job_id
        self.layout = layout
        self._fetcher = fetcher
        self._staging = region
        self._view = view
        self._header: StageHeader = layout.header(view)
        self._layers = [threading.Event() for _ in range(layout.kv.num_layers)]
        #: ``time.perf_counter()`` when each layer was announced staged (None: not yet).
        self.staged_at: list[float | None] = [None] * layout.kv.num_layers
        self._finished = threading.Event()
        self._failure: str | None = None
        self._release_wanted = False
        self._released = False
        self._lock = threading.Lock()

    # receiver-thread side ----------------------------------------------------------------

    def _on_layer(self, layer: int) -> None:
        if not self._header.layer_ready(layer):
            # The fetcher is still running and may write on: fail the load, keep the region.
            self._mark_failed(f"layer {layer} announced but its ready word is not set")
            return
        self.staged_at[layer] = time.perf_counter()
        self._layers[layer].set()

    def _mark_failed(self, why: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = why
        for event in self._layers:
            event.set()

    def _on_finished(self, failure: str | None) -> None:
        if failure is not None:
            self._mark_failed(failure)
        with self._lock:
            for event in self._layers:
                event.set()
            self._finished.set()
            release = self._release_wanted and not self._released
            self._released = self._released or release
        if release:
            self._fetcher._free(self._staging)

    def _on_failed(self, why: str) -> None:
        self._on_finished(why)

    # StagedSource ------------------------------------------------------------------------

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return self._layers[layer].wait(timeout)

    def layer_staged(self, layer: int) -> bool:
        """Whether the fetcher has published ``layer`` (read from the shared header)."""
        return self._header.layer_ready(layer)

    def wait_finished(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def region(self) -> np.ndarray:
        return self._view

    def block_ok(self) -> np.ndarray:
        if self._failure is not None or not self._header.statuses_final:
            return np.zeros(self.layout.n_blocks, dtype=bool)
        return self._header.block_status() == OK

    def state_ok(self) -> bool:
        if self._failure is not None:
            return False
        return self.layout.with_state and self._header.state_status == OK

    @property
    def failure(self) -> str | None:
        return self._failure

    def release(self) -> None:
        """Give the region back now if the fetcher is finished with it, else when it is."""
        with self._lock:
            if self._released:
                return
            if not self._finished.is_set():
                self._release_wanted = True
                return
            self._released = True
        self._fetcher._free(self._staging)


class Fetcher:
    """Owns the fetcher process, its pipes and the receiver thread (engine side)."""

    def __init__(
        self,
        reader_factory: ReaderFactory,
        area: StagingArea,
        geometry: GeometryConfig | KVLayout,
        *,
        gate: LayerGate | None = None,
        shared: SharedKV | None = None,
    ) -> None:
        """``shared``: the engine's KV cache in shared memory; the process maps it, and a load
        given ``rows`` lands there (``submit``)."""
        if not callable(reader_factory):
            raise InvalidArgument(
                "reader_factory", "must be a picklable zero-argument callable returning a reader"
            )
        self.area = area
        # A model preset's layout, or an engine's own (``KVLayout.blocks_only``).
        self.kv = geometry if isinstance(geometry, KVLayout) else KVLayout.from_geometry(geometry)
        jobs_read, jobs_write = os.pipe()
        events_read, events_write = os.pipe()
        staging = area.fileno()
        self.shared = shared
        kv_fds = () if shared is None else (shared.fd,)
        try:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvstore.engine.fetcher",
                    str(jobs_read),
                    str(events_write),
                    str(staging),
                    *(str(fd) for fd in kv_fds),
                ],
                # The staging file itself, open: the child keeps it (and so its lock) until it
                # exits, and never looks the area up by name (the KV file has no name at all).
                pass_fds=(jobs_read, events_write, staging, *kv_fds),
                env=child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            # Close our copies of the child's ends: when the child dies, our recv sees EOF.
            os.close(jobs_read)
            os.close(events_write)
        self._jobs = Connection(jobs_write, readable=False)
        self._events = Connection(events_read, writable=False)
        try:
            kv_map = None if shared is None else (shared.places, shared.num_rows)
            self._jobs.send((reader_factory, gate, kv_map))
        except (OSError, ValueError) as error:
            self._process.kill()
            raise SwapInError(f"cannot start the fetcher: {error}") from error
        self._lock = threading.Lock()
        self._pending: dict[int, StagedFetch] = {}
        #: How the fetcher reads blocks, once it decided (its first load with a read grant).
        self.read_path: str | None = None
        self._next_job = 1
        self._dead: str | None = None
        self._receiver = threading.Thread(
            target=self._receive, name="kvstore-fetch-receiver", daemon=True
        )
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.poll() is None

    def submit(
        self,
        keys: Sequence[bytes],
        *,
        lease_id: str | None = None,
        state_key: bytes | None = None,
        state_position: int | None = None,
        direct: DirectGrant | None = None,
        by_layer: bool = False,
        rows: Sequence[int] | np.ndarray | None = None,
    ) -> StagedFetch:
        """Stage ``keys`` (and the SWA state at ``state_position`` under ``state_key``);
        ``direct``: the lease's read grant for ``keys``, to read them from the storage nodes;
        ``by_layer``: hand its layers on as they arrive (``FetchJob.by_layer``); ``rows``:
        land block i in row ``rows[i]`` of the shared KV cache (``FetchJob.rows``), which the
        caller must keep for this load until it is ``finished``.

        Raises ``StagingFull`` when the area has no room now, ``SwapInError`` when the fetcher
        process is gone.
        """
        typed = tuple(bytes(check_key(key, f"keys[{i}]")) for i, key in enumerate(keys))
        if (state_key is None) != (state_position is None):
            raise InvalidArgument("state_position", "give state_key and state_position together")
        if state_key is not None:
            state_key = bytes(check_key(state_key, "state_key"))
        in_place: tuple[int, ...] | None = None
        if rows is not None:
            if self.shared is None:
                raise InvalidArgument("rows", "this fetcher has no shared KV cache to land in")
            in_place = tuple(check_rows(rows, self.shared.num_rows, len(typed)).tolist())
        layout = StageLayout.plan(self.kv, len(typed), state_key is not None, rows is not None)
        with self._lock:
            if self._dead is not None:
                raise SwapInError(f"fetcher process is gone: {self._dead}")
            job_id = self._next_job
            self._next_job += 1
        region = self.area.allocate(layout.total_bytes)
        view = self.area.view(region)
        layout.header(view).initialise(job_id)
        fetch = StagedFetch(self, job_id, layout, region, view)
        job = FetchJob(
            job_id=job_id,
            region_offset=region.offset,
            region_nbytes=region.nbytes,
            kv=self.kv,
            keys=typed,
            lease_id=lease_id,
            state_key=state_key,
            state_position=state_position,
            direct=direct,
            by_layer=by_layer,
            rows=in_place,
        )
        with self._lock:
            dead = self._dead
            if dead is None:
                self._pending[job_id] = fetch
                try:
                    self._jobs.send(job)
                except (OSError, ValueError) as error:
                    del self._pending[job_id]
                    dead = f"cannot send to the fetcher: {error}"
        if dead is not None:
            self.area.free(region)
            raise SwapInError(f"fetcher process is gone: {dead}")
        return fetch

    def _free(self, region: StagingRegion) -> None:
        self.area.free(region)

    def _receive(self) -> None:
        why = "fetcher process exited"
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            kind, job_id = message[0], message[1]
            if kind == "path":  # once per fetcher: how its loads read blocks, and why
                self.read_path = str(message[2])
                log.warning("kvstore fetcher %s: loads read blocks %s", self.pid, self.read_path)
                continue
            if kind == "dead":
                why = str(message[2])
                break
            with self._lock:
                fetch = self._pending.get(job_id)
                if fetch is not None and kind in ("done", "failed"):
                    del self._pending[job_id]
            if fetch is None:
                continue
            if kind == "layer":
                fetch._on_layer(int(message[2]))
            elif kind == "done":
                fetch._on_finished(None)
            else:
                fetch._on_failed(str(message[2]))
        with self._lock:
            self._dead = self._dead or why
            orphans = list(self._pending.values())
            self._pending.clear()
        for fetch in orphans:
            fetch._on_failed(why)

    def kill(self) -> None:
        """Stop the process at once (it writes nothing after this returns) and fail whatever is
        still in flight."""
        self._process.kill()
        self._process.wait()
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the process (politely, then by force) and fail whatever is still in flight."""
        with self._lock:
            if self._dead is None:
                self._dead = "fetcher closed"
            try:
                self._jobs.send(None)
            except (OSError, ValueError):
                pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout)
        self._jobs.close()
        self._receiver.join(timeout)
        self._events.close()

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m kvstore.engine.fetcher JOBS_FD EVENTS_FD STAGING_FD [KV_FD]``: the fetcher
    process (started by ``Fetcher``; the first message on JOBS is ``(reader_factory, gate,
    kv_map)``; STAGING is the open staging file, mapped here and kept open for as long as the
    process lives; KV_FD the engine's shared KV cache, whose ``(places, num_rows)`` are
    ``kv_map``)."""
    args = sys.argv[1:] if argv is None else argv
    jobs = Connection(int(args[0]), writable=False)
    events = Connection(int(args[1]), readable=False)
    try:
        factory, gate, kv_map = jobs.recv()
    except (EOFError, OSError):
        return
    except Exception as error:  # noqa: BLE001 - an unpicklable factory: tell the engine
        events.send(("dead", 0, f"reader factory did not arrive: {type(error).__name__}: {error}"))
        return
    try:
        _, buffer = map_staging_fd(int(args[2]))
        kv_file = None if kv_map is None else KVFile.map(int(args[3]), *kv_map)
    except (OSError, ValueError, IndexError, InvalidArgument) as error:
        what = f"{type(error).__name__}: {error}"
        events.send(("dead", 0, f"cannot map the staging area or the KV cache: {what}"))
        return
    fetcher_main(jobs, events, factory, gate, buffer, kv_file)


if __name__ == "__main__":
    main()
