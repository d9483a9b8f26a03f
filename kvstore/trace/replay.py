"""`kvstore replay`: a Mooncake request trace served through the block tier by simulated
engines, and held to what the trace alone says its hit rate could be (``oracle.py``).

N engines (threads, each with its own gRPC ``KVStoreClient``) take the requests from one queue
in timestamp order, so at most N are in flight; with ``speed`` the queue releases each request
at its trace time / speed, else as fast as the engines take them. Per request an engine does
what a real one does with an external prefix cache and nothing of its own: QueryHit on the
prompt's block keys (with a lease), GetBlocks of the hit blocks (every byte checked against
``expected_payload``; the first block that fails to load, or would be wrong, is where the engine
recomputes from), PutBlocks of every full block from there on, lease given back.

The tier is an embedded one (``embedded_service``, 14 storage nodes, as ``kvstore demo``)
sized from ``capacity_bytes`` / ``capacity_fraction``, or a running gateway (``address``),
whose own capacity and GC then apply.

Units. Capacities are **block payload bytes at the model's block size** (the preset's
``block_bytes``, 114,048 B for v4.1-flash), i.e. a number of blocks, whatever the payload scale:
a run with payloads scaled to 1/8 models the same cache, only with smaller bytes on disk. The
LRU oracle gets ``capacity_bytes // model block bytes`` blocks; the storage nodes get that many
blocks' worth of the bytes they count against their capacity.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tqdm import tqdm

from kvstore.api.client import ClientFactory, KVStoreClient
from kvstore.config import default_gc_config
from kvstore.demo.engine import expected_payload
from kvstore.errors import InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.hitplan import BOUNDED_REPLAY
from kvstore.keys import BLOCK_TOKENS, words_to_keys
from kvstore.tier.records import HitRequest
from kvstore.trace.capacity import disk_bytes_per_block
from kvstore.trace.mooncake import TraceFacts, TraceRequest, trace_facts
from kvstore.trace.oracle import OracleResult, check_mode, oracle_hits
from kvstore.trace.replay_report import summarize
from kvstore.trace.served import Served

#: Payload scales ``auto`` chooses from, largest first (1/64 of a v4.1-flash block is 1,782 B).
PAYLOAD_SCALES = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625)
#: The run ``auto`` aims at: what it expects the engines to take, at most (``expected_seconds``):
#: with the tier's start (under a minute) and the oracles, a run of the whole dev trace stays
#: well inside 15 minutes here.
AUTO_TIME_BUDGET_S = 600.0
#: The storage nodes' hard capacity is the run's capacity times at least this (``node_headroom``),
#: and the GC's watermarks are divided by it, so the GC still holds the cache between
#: ``gc_low`` and ``gc_high`` of the run's capacity while the nodes keep room for the writes
#: that arrive during a GC pass (seconds under load). Without it a node fills up between passes
#: and refuses shards; the put fails and its accepted shards stay on the other nodes, in no
#: placement, for good (the tier neither deletes nor reclaims them), counted as live bytes, and
#: the GC evicts real blocks in their place.
NODE_HEADROOM = 1.25
#: ... and room for this many seconds of the run's writes: a few GC passes under load.
HEADROOM_S = 10.0
#: The embedded tier's shape: 12 storage nodes hold a stripe, 2 more as in ``kvstore demo``.
STORAGE_NODES = 14
DATA_SHARDS, PARITY_SHARDS = 10, 2

# What one block costs the embedded tier here (2 cores shared with other work, fsync=never, 4
# engines over gRPC): a fixed cost per block (gRPC messages, 12 shard records or 10 shard reads,
# index rows, the GC's eviction of it later) plus a cost per payload byte (erasure coding,
# copies, the payload check: ~13 s of CPU per GB put on 2 cores, benchmarks/README.md). Fitted to
# the dev trace's two full runs at payload scale 1/16: unbounded (165,537 blocks put, 310,742
# read) 538 s of traffic, capacity 25% (268,565 put, 207,714 read) 766 s.
PUT_S_PER_BLOCK = 2.4e-3
PUT_S_PER_BYTE = 7e-9
GET_S_PER_BLOCK = 0.3e-3
GET_S_PER_BYTE = 3e-9
REQUEST_S = 6e-3  # QueryHit and the calls' own round trips, per request


def model_block_bytes() -> int:
    """The payload of one block of the configured model (``KVSTORE_PRESET``, default
    v4.1-flash: 114,048 B): the unit capacities are given in."""
    return GeometryConfig.from_env().block_bytes


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: who serves, how, against which tier and capacity. Validated on
    construction; a bad value raises ``InvalidArgument`` naming its command-line flag."""

    engines: int = 4
    #: Trace time runs this many times faster than real time; None: as fast as possible.
    speed: float | None = None
    mode: str = BOUNDED_REPLAY
    traffic_class: str = "chatbot"
    #: Share of the model's block payload each block carries; None: ``auto`` (``choose_scale``).
    payload_scale: float | None = None
    #: Block payload bytes (model block size) the tier may hold; None: unbounded.
    capacity_bytes: int | None = None
    #: ... or this share of the slice's unique blocks.
    capacity_fraction: float | None = None
    gc_high: float = 0.97
    gc_low: float = 0.94
    gc_scan_interval_s: float = 1.0
    #: A running gateway (HOST:PORT) instead of the embedded tier.
    address: str | None = None
    token: str | None = None
    #: PEM root certificate of a TLS gateway at ``address``.
    tls_root_cert: str | None = None
    #: The embedded tier's data dir (None: a temporary directory, removed afterwards).
    data_dir: Path | None = None
    storage_nodes: int = STORAGE_NODES
    progress: bool = True
    #: After a stop, how long the requests in flight may take to finish.
    drain_timeout_s: float = 60.0
    call_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or self.engines < 1:
            raise InvalidArgument("--engines", f"must be an integer >= 1, got {self.engines!r}")
        if self.speed is not None and not (math.isfinite(self.speed) and self.speed > 0):
            raise InvalidArgument("--speed", f"must be a number > 0, got {self.speed}")
        check_mode(self.mode)
        classes = default_gc_config().class_names
        if self.address is None and self.traffic_class not in classes:
            raise InvalidArgument(
                "--traffic-class",
                f"unknown class {self.traffic_class!r} (the GC policy has {', '.join(classes)})",
            )
        scale = self.payload_scale
        if scale is not None and not (math.isfinite(scale) and 0 < scale <= 1):
            raise InvalidArgument("--payload-scale", f"must be in (0, 1] or auto, got {scale}")
        if self.capacity_bytes is not None and self.capacity_fraction is not None:
            raise InvalidArgument(
                "--capacity-fraction", "give --capacity-bytes or --capacity-fraction, not both"
            )
        if self.capacity_bytes is not None and self.capacity_bytes < model_block_bytes():
            raise InvalidArgument(
                "--capacity-bytes",
                f"must hold at least one block ({model_block_bytes():,} B), "
                f"got {self.capacity_bytes:,}",
            )
        fraction = self.capacity_fraction
        if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 1):
            raise InvalidArgument("--capacity-fraction", f"must be in (0, 1], got {fraction}")
        for flag, mark in (("--gc-high", self.gc_high), ("--gc-low", self.gc_low)):
            if not (math.isfinite(mark) and 0 < mark <= 1):
                raise InvalidArgument(flag, f"must be in (0, 1], got {mark}")
        if not self.gc_low < self.gc_high:
            raise InvalidArgument(
                "--gc-low", f"must be below --gc-high ({self.gc_low} >= {self.gc_high})"
            )


# --- sizes -----------------------------------------------------------------------------------


def capacity_blocks(config: ReplayConfig, unique_blocks: int) -> int | None:
    """How many blocks the tier (and the LRU oracle) may hold; None: unbounded."""
    if config.capacity_bytes is not None:
        return config.capacity_bytes // model_block_bytes()
    if config.capacity_fraction is not None:
        return max(1, int(unique_blocks * config.capacity_fraction))
    return None


def node_headroom(blocks: int, work: Workload, block_bytes: int) -> float:
    """How much more than ``blocks`` the nodes may hold: ``NODE_HEADROOM``, or room for
    ``HEADROOM_S`` of the run's expected writes when that is more (a small cache fills in
    less time than a GC pass takes under load)."""
    per_second = work.puts / max(expected_seconds(work, block_bytes), 1e-9)
    return max(NODE_HEADROOM, 1 + HEADROOM_S * per_second / max(blocks, 1))


def node_capacity_bytes(
    blocks: int, block_bytes: int, nodes: int, headroom: float = NODE_HEADROOM
) -> int:
    """Each storage node's capacity for the tier to hold ``blocks`` blocks (times
    ``headroom``): stripes spread over every node, so each holds about ``12 / nodes`` of the
    shards."""
    return math.ceil(
        blocks * disk_bytes_per_block(block_bytes, DATA_SHARDS, PARITY_SHARDS) * headroom / nodes
    )


def segment_bytes_for(node_capacity: int) -> int:
    """Segment size for a node of this capacity: small enough that a node seals (and so can
    compact) segments long before its capacity is reached, at most the default 64 MiB."""
    return int(min(64 << 20, max(2 << 20, node_capacity // 16)))


@dataclass(frozen=True)
class Workload:
    """What the engines will move, from the oracle of the run's capacity: blocks read (the hit
    blocks) and blocks written (every full block from the hit on, already stored or not)."""

    requests: int
    gets: int
    puts: int
    unique_blocks: int

    @classmethod
    def of(cls, facts: TraceFacts, oracle: OracleResult) -> Workload:
        gets = int((oracle.hit_tokens // BLOCK_TOKENS).sum())
        return cls(facts.requests, gets, facts.kv_blocks - gets, facts.unique_kv_blocks)


def expected_seconds(work: Workload, block_bytes: int) -> float:
    """How long the engines are expected to take on the embedded tier (constants above)."""
    put = PUT_S_PER_BLOCK + block_bytes * PUT_S_PER_BYTE
    get = GET_S_PER_BLOCK + block_bytes * GET_S_PER_BYTE
    return work.requests * REQUEST_S + work.puts * put + work.gets * get


def choose_scale(work: Workload, model_bytes: int, free_disk: int) -> tuple[float, str]:
    """``auto``: the largest of ``PAYLOAD_SCALES`` at which the slice's unique blocks fit in
    half the data dir's free disk and the run is expected within ``AUTO_TIME_BUDGET_S``; the
    smallest if none is. Returns the scale and why."""
    for scale in PAYLOAD_SCALES:
        size = max(1, int(model_bytes * scale))
        disk = work.unique_blocks * disk_bytes_per_block(size, DATA_SHARDS, PARITY_SHARDS)
        seconds = expected_seconds(work, size)
        if disk <= free_disk / 2 and seconds <= AUTO_TIME_BUDGET_S:
            return scale, (
                f"largest scale with the unique blocks in half the free disk "
                f"({disk / 1e9:.1f} of {free_disk / 1e9:.0f} GB) and an expected "
                f"{seconds:.0f} s <= {AUTO_TIME_BUDGET_S:.0f} s"
            )
    scale = PAYLOAD_SCALES[-1]
    size = max(1, int(model_bytes * scale))
    seconds = expected_seconds(work, size)
    return scale, f"smallest; expected {seconds:.0f} s, over the {AUTO_TIME_BUDGET_S:.0f} s aim"


# --- one engine ------------------------------------------------------------------------------


class ReplayEngine:
    """One simulated engine: its own client, no prefix cache of its own."""

    def __init__(self, client: KVStoreClient, config: ReplayConfig, block_bytes: int) -> None:
        self._client = client
        self._config = config
        self._block_bytes = block_bytes

    def serve(self, index: int, at_s: float, request: TraceRequest, words: np.ndarray) -> Served:
        keys = words_to_keys(words)
        size = self._block_bytes
        load_errors = wrong = put_failures = 0
        get_s = put_s = None
        started = time.perf_counter()
        try:
            answer = self._client.query_hit(
                HitRequest(
                    block_keys=words,
                    prompt_len=request.input_length,
                    mode=self._config.mode,
                    traffic_class=self._config.traffic_class,
                    take_lease=True,
                )
            )
        except grpc.RpcError:  # the tier unreachable: a miss, the engine keeps serving
            answer = None
            load_errors += 1
        query_s = time.perf_counter() - started
        planned = answer.plan.hit_tokens if answer is not None else 0
        hit_blocks = planned // BLOCK_TOKENS
        usable = 0
        if hit_blocks and answer is not None:
            started = time.perf_counter()
            try:
                reads = self._client.get_blocks(keys[:hit_blocks], lease_id=answer.lease_id)
            except grpc.RpcError:
                reads = []
            get_s = time.perf_counter() - started
            intact = True
            for read in reads:
                if read.payload is None:
                    load_errors += 1
                    intact = False
                elif read.payload != expected_payload(read.key, size):
                    wrong += 1
                    intact = False
                elif intact:
                    usable += 1
            load_errors += hit_blocks - len(reads)
        elif answer is not None and answer.lease_id:
            self._release(answer.lease_id)
        # Recompute from the first block that did not load; the plan's point when all did.
        compute_from = planned if usable == hit_blocks else usable * BLOCK_TOKENS
        fresh = keys[compute_from // BLOCK_TOKENS :]
        if fresh:
            payloads = [expected_payload(key, size) for key in fresh]
            started = time.perf_counter()
            try:
                stored = self._client.put_blocks(fresh, payloads, self._config.traffic_class)
                put_failures = len(stored.failed_keys)
            except grpc.RpcError:
                put_failures = len(fresh)
            put_s = time.perf_counter() - started
        return Served(
            index=index,
            at_s=at_s,
            prompt_tokens=request.input_length,
            blocks=len(keys),
            planned_hit_tokens=planned,
            hit_tokens=compute_from,
            blocks_fetched=usable,
            blocks_put=len(fresh),
            load_errors=load_errors,
            wrong_bytes=wrong,
            put_failures=put_failures,
            query_hit_s=query_s,
            get_blocks_s=get_s,
            put_blocks_s=put_s,
        )

    def _release(self, lease_id: str) -> None:
        try:
            self._client.release_lease(lease_id)
        except grpc.RpcError:
            pass  # the lease runs out by itself


# --- many engines ----------------------------------------------------------------------------


@dataclass
class Drive:
    """What the engines did: one ``Served`` per request of the completed prefix."""

    served: list[Served]
    dispatched: int
    interrupted: bool
    seconds: float


def drive(
    requests: Sequence[TraceRequest],
    key_words: Sequence[np.ndarray],
    engines: Sequence[ReplayEngine],
    config: ReplayConfig,
    stop: threading.Event,
) -> Drive:
    """Serve the requests in timestamp order from one queue (at most one per engine in flight),
    paced by ``config.speed``. ``stop`` set (Ctrl-C): nothing more is dispatched, the requests
    in flight get ``drain_timeout_s`` to finish, and the completed prefix is returned. An
    engine that fails unexpectedly stops the run, and its error is raised."""
    slots = threading.Semaphore(len(engines))
    inbox: queue.Queue[int | None] = queue.Queue()
    results: list[Served | None] = [None] * len(requests)
    failures: list[BaseException] = []
    first_at = requests[0].at_s if requests else 0.0
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not config.progress)

    def work(engine: ReplayEngine) -> None:
        while (index := inbox.get()) is not None:
            request = requests[index]
            try:
                results[index] = engine.serve(
                    index, request.at_s - first_at, request, key_words[index]
                )
            except BaseException as error:  # raised below: a replay must not hide an error
                failures.append(error)
                stop.set()
            finally:
                slots.release()
                bar.update(1)

    threads = [
        threading.Thread(target=work, args=(engine,), name=f"replay-engine-{i}", daemon=True)
        for i, engine in enumerate(engines)
    ]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    dispatched = 0
    for index, request in enumerate(requests):
        if config.speed is not None:
            due = started + (request.at_s - first_at) / config.speed
            if stop.wait(max(0.0, due - time.perf_counter())):
                break
        if not _free_slot(slots, stop):
            break
        inbox.put(index)
        dispatched += 1
    for _ in threads:
        inbox.put(None)
    _join(threads, stop, config.drain_timeout_s)
    seconds = time.perf_counter() - started
    bar.close()
    if failures:
        raise failures[0]
    completed = next((i for i, r in enumerate(results) if r is None), len(results))
    served = [r for r in results[:completed] if r is not None]
    return Drive(served, dispatched, completed < len(requests), seconds)


def _free_slot(slots: threading.Semaphore, stop: threading.Event) -> bool:
    """Wait for an engine to be free; False once ``stop`` is set."""
    while not slots.acquire(timeout=0.2):
        if stop.is_set():
            return False
    if stop.is_set():
        slots.release()
        return False
    return True


def _join(threads: Sequence[threading.Thread], stop: threading.Event, drain_s: float) -> None:
    """Wait for the engines to finish; once ``stop`` is set, for ``drain_s`` more at most (an
    engine still in a call then is left behind: it is a daemon thread)."""
    until: float | None = None
    for thread in threads:
        while thread.is_alive():
            if stop.is_set() and until is None:
                until = time.perf_counter() + drain_s
            if until is not None and time.perf_counter() >= until:
                return
            thread.join(timeout=0.2)


# --- the tier --------------------------------------------------------------------------------


@dataclass
class Tier:
    """Where the engines' clients connect, and what the run can learn about the tier."""

    address: str
    factory: ClientFactory
    #: GC figures (embedded tier only): ``GCWorkerActor.status()``.
    gc_status: Callable[[], dict[str, Any]] | None = None
    nodes: int | None = None
    node_capacity_bytes: int | None = None
    segment_bytes: int | None = None
    #: The watermarks the GC was given (fractions of the nodes' capacity).
    gc_node_watermarks: tuple[float, float] | None = None
    #: The nodes' capacity over the run's (``node_headroom``).
    headroom: float | None = None


@contextmanager
def embedded_tier(
    config: ReplayConfig,
    block_bytes: int,
    blocks: int | None,
    data_dir: Path,
    cluster: Any = None,
    room: float = NODE_HEADROOM,
) -> Iterator[Tier]:
    """kvstore on embedded Ray (or ``cluster``), its nodes sized to hold ``blocks`` blocks of
    ``block_bytes`` times ``room`` (None: what their disk can take), the GC per the config and
    its watermarks divided by ``room``."""
    import ray

    from kvstore.runtime.service import embedded_service

    capacity = segment = None
    suffix = uuid.uuid4().hex[:8]
    # Names of its own for the block tier's and the SWA tier's actors: another deployment may
    # share the cluster (tests do).
    environ = {**os.environ, "KVSTORE_SWA_NAME": f"swa_replay_{suffix}"}
    if blocks is None:
        room = 1.0  # unbounded: the watermarks apply to what the disk can take
    else:
        capacity = node_capacity_bytes(blocks, block_bytes, config.storage_nodes, room)
        segment = segment_bytes_for(capacity)
        # ServiceConfig.from_env takes a node's segment size from the environment only.
        environ["KVSTORE_BLOCKSTORE_NODE_SEGMENT_BYTES"] = str(segment)
    gc = dataclasses.replace(
        default_gc_config(),
        high_watermark=config.gc_high / room,
        low_watermark=config.gc_low / room,
        scan_interval_s=config.gc_scan_interval_s,
    )
    with embedded_service(
        data_dir,
        cluster=cluster,
        environ=environ,
        deployment=f"replay-{suffix}",
        fsync="never",
        storage_nodes=config.storage_nodes,
        block_bytes=block_bytes,
        node_capacity_bytes=capacity,
        gc=gc,
        # No background scrub: on a small machine it spends a third of the nodes' CPU checking
        # shards this run just wrote, and every read of the run is checked anyway.
        scrub_bytes_per_s=0,
    ) as running:
        handle = running.service.gc

        def gc_status() -> dict[str, Any]:
            return dict(ray.get(handle.status.remote(), timeout=60)) if handle is not None else {}

        yield Tier(
            running.address,
            ClientFactory(running.address, timeout_s=config.call_timeout_s),
            gc_status,
            config.storage_nodes,
            capacity,
            segment,
            (round(gc.high_watermark, 4), round(gc.low_watermark, 4)),
            None if blocks is None else round(room, 3),
        )


class Occupancy:
    """Samples how many blocks the tier holds (GetStats, every ``interval_s``) while the
    engines run: a bounded tier is only comparable to its LRU oracle if it held about as many
    blocks."""

    def __init__(self, client: KVStoreClient, block_bytes: int, interval_s: float = 2.0) -> None:
        self._client = client
        self._block_bytes = block_bytes
        self._interval = interval_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._run, name="replay-occupancy", daemon=True)

    def __enter__(self) -> Occupancy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        started = time.perf_counter()
        while not self._stop.wait(self._interval):
            try:
                stored = self._client.stats().block_bytes_stored
            except grpc.RpcError:
                continue  # a sample missed is no figure wrong
            self.samples.append((time.perf_counter() - started, stored // self._block_bytes))

    def summary(self, capacity: int | None) -> dict[str, Any]:
        blocks = np.array([count for _, count in self.samples], np.float64)
        if not blocks.size:
            return {"samples": 0}
        out: dict[str, Any] = {
            "samples": int(blocks.size),
            "mean_blocks": round(float(blocks.mean())),
            "max_blocks": int(blocks.max()),
        }
        if capacity:
            # After the cache first filled: the mean over the warm-up would say nothing.
            full = blocks[int(np.argmax(blocks >= 0.9 * capacity)) :]
            if blocks.max() >= 0.9 * capacity:
                out["mean_of_capacity_once_full"] = round(float(full.mean()) / capacity, 4)
            out["max_of_capacity"] = round(float(blocks.max()) / capacity, 4)
        return out


#: How long the run's end waits for the GC to settle (``_settle``): a pass takes well under a
#: second on an idle machine, a few on a busy one.
SETTLE_TIMEOUT_S = 60.0


def _settle(gc_status: Callable[[], dict[str, Any]], timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until a GC pass begun after the engines stopped has ended (the one running then
    ends first); whether one did within ``timeout_s``. The bytes stored at the end are then
    the GC's settled state, not wherever its sawtooth between passes stood when the engines
    stopped: on a busy machine a pass takes seconds, and the writes of those seconds sit above
    the watermark until the next pass."""
    deadline = time.monotonic() + timeout_s
    first = int(gc_status()["passes"])
    while time.monotonic() < deadline:
        if int(gc_status()["passes"]) >= first + 2:
            return True
        time.sleep(0.1)
    return False


# --- the whole run ---------------------------------------------------------------------------


def run_replay(
    config: ReplayConfig,
    requests: Sequence[TraceRequest],
    *,
    trace_name: str = "trace",
    stop: threading.Event | None = None,
    cluster: Any = None,
    say: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[Served], dict[str, OracleResult | None]]:
    """Replay ``requests`` (timestamp order, as ``load_trace`` gives them). Returns the summary
    (``replay_report.summarize``), the per-request records and the oracles over the completed
    requests. ``stop``: set it (Ctrl-C) to end early with what was done."""
    stop = stop or threading.Event()
    model_bytes = model_block_bytes()
    fingerprint = GeometryConfig.from_env().fingerprint()
    words = [request.key_words(fingerprint) for request in requests]
    facts = trace_facts(list(requests), words)
    blocks = capacity_blocks(config, facts.unique_kv_blocks)
    planned = oracle_hits(requests, words, blocks, config.mode)
    work = Workload.of(facts, planned)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-replay-") as scratch:
        data_dir = config.data_dir or Path(scratch)
        with _tier(config, work, model_bytes, blocks, data_dir, cluster, say) as (tier, size):
            say(f"serving on {tier.address} (up in {time.perf_counter() - started:.1f} s)")
            clients = [tier.factory() for _ in range(config.engines + 1)]
            try:
                figures = clients[0].stats()
                tier_fingerprint = bytes.fromhex(figures.extra["model_fingerprint"])
                if tier_fingerprint != fingerprint:  # a running tier of another preset
                    words = [request.key_words(tier_fingerprint) for request in requests]
                engines = [ReplayEngine(client, config, size) for client in clients[1:]]
                gc_status = tier.gc_status  # None: no GC of ours (a running gateway's tier)
                before = None if gc_status is None else int(gc_status()["passes"])
                with Occupancy(clients[0], size) as occupancy:
                    done = drive(requests, words, engines, config, stop)
                # The GC's cadence while the engines ran: by the clock on an idle machine,
                # fewer passes than that on a busy one (each pass takes longer).
                passes = None
                if gc_status is not None and before is not None:
                    passes = int(gc_status()["passes"]) - before
                settled = _settle(tier.gc_status) if tier.gc_status is not None else None
                figures = clients[0].stats()
                gc = tier.gc_status() if tier.gc_status is not None else None
            finally:
                for client in clients:
                    client.close()
    completed = len(done.served)
    prefix = list(requests[:completed])
    oracles: dict[str, OracleResult | None] = {
        "infinite": oracle_hits(prefix, words[:completed], None, config.mode),
        "lru": None
        if blocks is None
        else oracle_hits(prefix, words[:completed], blocks, config.mode),
    }
    summary = summarize(
        done.served,
        oracles,
        {
            "trace": trace_name,
            "requests_in_slice": len(requests),
            "dispatched": done.dispatched,
            "interrupted": done.interrupted,
            "facts": dataclasses.asdict(trace_facts(prefix, words[:completed])) if prefix else None,
            "mode": config.mode,
            "traffic_class": config.traffic_class,
            "engines": config.engines,
            "speed": config.speed,
            "tier": "running gateway" if config.address else "embedded",
            "address": tier.address,
            "payload_scale": size / model_bytes,
            "block_bytes": size,
            "model_block_bytes": model_bytes,
            "capacity_blocks": blocks,
            "capacity_model_bytes": None if blocks is None else blocks * model_bytes,
            "capacity_fraction": None
            if blocks is None
            else round(blocks / max(facts.unique_kv_blocks, 1), 4),
            "storage_nodes": tier.nodes,
            "node_capacity_bytes": tier.node_capacity_bytes,
            "segment_bytes": tier.segment_bytes,
            "node_headroom": tier.headroom,
            "gc_node_watermarks": tier.gc_node_watermarks,
            "occupancy": occupancy.summary(blocks),
            "gc_watermarks": None
            if config.address
            else {"high": config.gc_high, "low": config.gc_low},
            "gc_scan_interval_s": None if config.address else config.gc_scan_interval_s,
            "stats": figures,
            "gc": gc,
            "gc_settled": settled,
            "gc_passes_in_traffic": passes,
            "traffic_seconds": round(done.seconds, 1),
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
    )
    return summary, done.served, oracles


@contextmanager
def _tier(
    config: ReplayConfig,
    work: Workload,
    model_bytes: int,
    blocks: int | None,
    data_dir: Path,
    cluster: Any,
    say: Callable[[str], None],
) -> Iterator[tuple[Tier, int]]:
    """The tier to replay against and the payload size of its blocks."""
    if config.address is not None:
        factory = ClientFactory(
            config.address,
            token=config.token,
            tls_root_cert=config.tls_root_cert,
            timeout_s=config.call_timeout_s,
        )
        with factory() as probe:
            try:
                size = int(probe.stats().extra["block_bytes"])
            except grpc.RpcError as error:
                raise InvalidArgument(
                    "--address", f"no kvstore gateway answering at {config.address}: {error}"
                ) from None
        if config.payload_scale is not None and int(model_bytes * config.payload_scale) != size:
            raise InvalidArgument(
                "--payload-scale",
                f"the tier at {config.address} takes blocks of {size:,} B "
                f"({size / model_bytes:g} of the model's); leave --payload-scale out",
            )
        say(f"replaying against {config.address}: its capacity and GC apply ({size:,} B blocks)")
        yield Tier(config.address, factory), size
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    if config.payload_scale is not None:
        scale, why = config.payload_scale, "given"
    else:
        scale, why = choose_scale(work, model_bytes, shutil.disk_usage(data_dir).free)
    size = max(1, int(model_bytes * scale))
    say(
        f"payload {size:,} B a block (scale {scale:g} of {model_bytes:,} B: {why}); "
        f"expected traffic {expected_seconds(work, size):.0f} s"
    )
    say(
        f"starting kvstore: embedded Ray, {config.storage_nodes} storage nodes under {data_dir}"
        + ("" if blocks is None else f", capacity {blocks:,} blocks")
        + " ..."
    )
    room = NODE_HEADROOM if blocks is None else node_headroom(blocks, work, size)
    with embedded_tier(config, size, blocks, data_dir, cluster, room) as tier:
        yield tier, size
