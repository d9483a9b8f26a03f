"""Block KVCache tier vs Redis, same run, same machine: put/get GB/s, normal and 2 nodes killed,
and the CPU seconds each side spends per GB moved.

What runs: an embedded local Ray (one Ray node on 127.0.0.1) with the tier deployed as in
production: 12 storage-node actors (10+2 Reed-Solomon, one failure domain each, each its own data
dir under ``--data-root``) and 4 meta shards; in the same run a throw-away ``redis-server`` on
loopback (no persistence), driven from this process with redis-py + hiredis pipelines: the peer
a user would pick instead. The client is the ordinary ``BlockStoreClient`` of the deployment
(``handles.client()``); it holds no storage node in its own process, so every byte it puts or
gets crosses a process boundary, like a client on a machine without storage nodes.

Rows (1 GB = 10^9 bytes of block payload; median over the timed batches):
- put: ``put_blocks`` of a batch of fresh keys vs one pipelined Redis SET of the same batch,
  into a tier that already holds data: before the put rows the tier is filled, untimed, past
  every node's page-cache bound (``StorageNodeConfig.cached_log_bytes``), as a deployed tier
  is, and the disk line's file likewise (``--fill-gb``; its figures are printed). A put into
  an empty tier on a fresh VM writes into memory the machine never touched, which costs its
  nodes several times the CPU (``kvstore/blockstore/segmentlog.py``); ``--fill-gb 0`` shows it;
- get: ``lookup`` once (the lease an engine would hold, not timed), then ``read`` of the batch
  (``get_blocks`` plus which blocks were degraded) vs one pipelined Redis GET of the same
  batch; half the batches before and half after the degraded phase (the killed nodes started
  again on their disks), so normal and degraded see the same stretch of machine noise;
- get, direct: the same batch read as an engine reads its lease: straight from the storage
  nodes' engine read sockets with the lease's read capability (``DirectReader.read_into``,
  into one reused buffer; one lookup and one capability minted in this process, as the tier
  does in QueryHit, not timed; ``blockstore_paths.DirectPath``), vs Redis GET of the batch;
- get, gateway (111 KiB only: the gateway's tier takes blocks of the preset's size): GetBlocks
  through a real gRPC gateway in its own process (a Ray actor serving the deployed tier), the
  batch put through it first (its tenant's namespace); per batch one QueryHit for the lease
  (not timed; its CPU counts) then GetBlocks with it (timed), vs Redis GET of the batch;
- get, 2 nodes killed: storage nodes 0 and 1 killed for good (``kill_nodes``): every block has
  lost 2 of its 12 shards, most need Reed-Solomon decoding;
- put, 2 nodes killed: what a put does then (today a block needs all 12 nodes: it fails).
kvstore and Redis batches alternate batch by batch, so noise hits both alike (``--turn N``: N
of kvstore's in a row, then the peers' same N, so that only the first of a turn starts cold).
The first two batches of every case are warm-ups (checked bit-exact, not timed). Batches are 64
blocks of either size by default (a 1.35 MiB batch is 90.6 MB; redis-py pipelines that large run
slower per GB than 16-deep ones on some runs here: ``--batch-large 16`` checks that the 2x get
target does not rest on it).

CPU seconds per GB of payload moved, over the timed batches of each case: the client process
by ``getrusage`` around each batch (kvstore's and Redis' apart); server processes by utime+stime
(``/proc/<pid>/stat``) read when the case's timed batches start and end (work a node does
after a call returned still counts), less what the storage side's processes spend at rest
(watched for 3 s before the fill and after the restart: Ray's ~100 wake-ups a second an actor)
over the time the case spent outside kvstore's batches (in Redis', the disk line's):
storage-node actor processes (pids from ``StorageNode.stats()['pid']``, else by their
``ray::StorageNodeActor`` process title), meta-shard actors, the other Ray processes of this run
(raylet, GCS, workers: Ray's object transfers; the gateway's process too), and redis-server.

Targets, exit status 1 if one is missed (each printed with its issue, met / NOT met). Issue 17:
put 111 KiB and 1.35 MiB >= 1.0x Redis SET; get 111 KiB >= 1.0x Redis GET, get 1.35 MiB >= 2.0x
Redis GET; get with 2 nodes killed >= 0.8x normal get (both sizes). Issue 32: put 111 KiB >= 0.8x
the disk ceiling, in GB/s on this machine and per core, and <= 4 CPU-s per GB over all processes
(kvstore total). Per core is the pace if every process of the run (the client, each storage
node, each meta shard, Ray's own) had a core of its own, 1 / the busiest one's CPU-s per GB: a
bound set by CPU alone, as one writer on its own also waits for each put's replies. Get, direct
111 KiB >= 1.0x Redis GET, in GB/s on this machine and per client core (the Redis client's CPU-s
per GB over the direct reader's): the second is what a deployment sees, with the 12 nodes on
machines of their own instead of sharing this machine's cores with the reader (Redis is one
process beside its client here). The shared 2-core machine is noisy: compare ratios from one run.

    python3 benchmarks/blockstore.py [--runs 30] [--batch 64] [--batch-large 64] [--turn 1] \\
        [--case-seconds 20] [--fsync batch] [--data-root DIR] [--json] [--zstd]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Not this folder first: its grpc.py would stand in for the grpc package (Ray's auth probe).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from benchmarks.blockstore_cpu import Case, CpuGroups, PhaseCpu, timed  # noqa: E402
from benchmarks.blockstore_disk import DiskLine  # noqa: E402
from benchmarks.blockstore_paths import DirectPath, Gateway, GatewayPath  # noqa: E402
from benchmarks.blockstore_zstd import measure_zstd  # noqa: E402
from benchmarks.peers import Redis, peer_redis  # noqa: E402
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig  # noqa: E402
from kvstore.blockstore.direct import DirectReader  # noqa: E402
from kvstore.ec.codec import Codec  # noqa: E402
from kvstore.geometry import GeometryConfig  # noqa: E402
from kvstore.runtime.cluster import LocalClusterConfig, connect  # noqa: E402

#: One V4 block and one SWA state (docs/rules.md §2, §3), from the model preset.
BLOCK = GeometryConfig.default().block_bytes
STATE = GeometryConfig.default().state_size_to_disk
SMALL, LARGE = "111 KiB", "1.35 MiB"
SIZES = {SMALL: BLOCK, LARGE: STATE}
KILLED = (0, 1)
WARMUPS = 2
#: Seconds the tier's processes are watched at rest (``CpuGroups.at_rest``).
REST_S = 3.0
DIRECT, GATEWAY = "get, direct", "get, gateway"
TABLED = ("Redis SET", "Redis GET", "normal get")
#: A target on what one client core takes (1 / the client process's CPU-s per GB), the bound
#: where the storage nodes or redis-server run on machines of their own.
CLIENT_CORE = "Redis GET client, per client core"
#: A target on the pace where every process of the tier and its client has a core of its own
#: (1 / the busiest process's CPU-s per GB: the client, one storage node, one meta shard, one
#: of Ray's own), as on a deployment's machines, against the disk line's GB/s.
DISK_PER_CORE = "disk ceiling, per core"
#: (row, size) -> [(what is compared, minimum ratio, issue)]; "CPU-s/GB" is a maximum instead,
#: over every process of the run (kvstore total).
TARGETS: dict[tuple[str, str], list[tuple[str, float, int]]] = {
    ("put", SMALL): [
        ("Redis SET", 1.0, 17),
        ("disk ceiling", 0.8, 32),
        (DISK_PER_CORE, 0.8, 32),
        ("CPU-s/GB", 4.0, 32),
    ],
    ("put", LARGE): [("Redis SET", 1.0, 17)],
    ("get", SMALL): [("Redis GET", 1.0, 17)],
    ("get", LARGE): [("Redis GET", 2.0, 17)],
    ("get, 2 nodes killed", SMALL): [("normal get", 0.8, 17)],
    ("get, 2 nodes killed", LARGE): [("normal get", 0.8, 17)],
    (DIRECT, SMALL): [("Redis GET", 1.0, 32), (CLIENT_CORE, 1.0, 32)],
}


# --- the run -----------------------------------------------------------------------------------


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        handles: Any,
        redis: Redis,
        data_root: str,
        gateway: Gateway | None = None,
    ) -> None:
        self.args = args
        self.gateway = gateway
        self.data_root = data_root
        config = handles.config
        cached = config.node.cached_log_bytes
        self.disk_line = DiskLine(
            os.path.join(data_root, "disk-ceiling.bin"),
            args.fsync,
            None if cached is None else cached * config.storage_nodes,
        )
        #: What ``fill`` put before the put rows (``summary`` of its batches, CPU included).
        self.filled: dict[str, Any] = {}
        self.handles = handles
        self.redis = redis
        self.client = handles.client()
        self.groups = CpuGroups(handles, exclude={redis.pid})
        #: What the tier's processes spend at rest (cores a pid), taken off each phase's CPU
        #: for the time it is not in one of kvstore's batches (``PhaseCpu``).
        self.rest: dict[str, dict[int, float]] = {}
        self.rng = np.random.default_rng(7)
        self.batch = {SMALL: args.batch, LARGE: args.batch_large}
        self.cases: dict[tuple[str, str, str], Case] = {}
        self.lookup_s: dict[str, list[float]] = {label: [] for label in SIZES}
        self.degraded_blocks: dict[str, list[int]] = {label: [0, 0] for label in SIZES}
        #: Per size: the get batch (keys, payloads), stored in both kvstore and Redis.
        self.workload: dict[str, tuple[list[bytes], list[np.ndarray]]] = {}
        #: Per size: how many timed normal gets came before the degraded phase.
        self.first_half: dict[str, int] = {}
        self.reader: DirectReader | None = None
        self.read_key = b""

    def case(self, row: str, label: str, side: str) -> Case:
        key = (row, label, side)
        if key not in self.cases:
            self.cases[key] = Case(SIZES[label] * self.batch[label])
        return self.cases[key]

    def loop(
        self,
        ours_step: Callable[[int, bool], None],
        peer_step: Callable[[int, bool], None],
        runs: int,
        ours: Case,
        peer: Case | None,
    ) -> None:
        """``WARMUPS`` untimed then up to ``runs`` timed batches, each ``ours_step(index,
        timed)`` then ``peer_step(index, timed)``; the timed ones in turns of ``--turn``
        batches (that many of ours, then the peer's of the same batches). Stops early once
        ``--case-seconds`` have passed and 3 timed batches were taken. The servers' CPU over
        the timed batches goes to ``ours`` (storage side) and ``peer`` (redis-server)."""
        deadline = time.monotonic() + self.args.case_seconds
        phase = PhaseCpu(self.groups, self.redis.pid, self.rest)
        try:
            for index in range(WARMUPS):
                ours_step(index, False)
                peer_step(index, False)
            phase.start(ours)
            index, end = WARMUPS, WARMUPS + runs
            while index < end:
                turn = range(index, min(end, index + self.args.turn))
                for each in turn:
                    ours_step(each, True)
                for each in turn:
                    peer_step(each, True)
                index = turn.stop
                if index - WARMUPS >= 3 and time.monotonic() > deadline:
                    return
        finally:
            phase.stop(ours, peer)

    def payloads(self, label: str) -> list[np.ndarray]:
        size = SIZES[label]
        return [self.rng.integers(0, 256, size, dtype=np.uint8) for _ in range(self.batch[label])]

    def stripe_bytes(self, label: str) -> np.ndarray:
        """As many bytes as the 12 nodes write for a batch of ``label`` blocks (every shard,
        headers included): what the disk line appends for it."""
        config = self.handles.config
        shard = Codec(config.data_shards, config.parity_shards).shard_length(SIZES[label])
        return np.frombuffer(os.urandom(self.batch[label] * config.stripe_width * shard), np.uint8)

    def put_phase(self, label: str) -> None:
        payloads = self.payloads(label)
        raw = [p.tobytes() for p in payloads]
        ours, peer = self.case("put", label, "kvstore"), self.case("put", label, "redis")
        disk = self.case("put", label, "disk")
        # Appended by one process to one file with one flush: the disk's own ceiling for the put.
        stripe_bytes = self.stripe_bytes(label)

        batch_keys: dict[int, list[bytes]] = {}

        def put(index: int, timed_run: bool) -> None:
            keys = batch_keys[index] = [os.urandom(32) for _ in payloads]
            with self.measure(ours, timed_run):
                result = self.client.put_blocks(keys, payloads)
            if result.failed or result.busy or result.existing:
                raise RuntimeError(
                    f"put of {len(keys)} blocks: {len(result.failed)} failed, "
                    f"{len(result.busy)} busy, {len(result.existing)} existing"
                )
            if index == 0:  # the get workload, in both stores
                self.workload[label] = (keys, payloads)

        def peer_put(index: int, timed_run: bool) -> None:
            redis_keys = [b"redis:" + key for key in batch_keys.pop(index)]
            with self.measure(peer, timed_run):
                self.redis.set_many(redis_keys, raw)
            with self.measure(disk, timed_run):
                self.disk_line.append(stripe_bytes)
            if index:
                self.redis.delete(redis_keys)  # bounds Redis' memory

        self.loop(put, peer_put, self.args.runs, ours, peer)

    def fill(self) -> None:
        """Before the put rows, untimed: put batches of 111 KiB blocks until the tier holds
        ``--fill-gb`` (by default enough to take every node past its page-cache bound,
        ``cached_log_bytes``, with a quarter to spare), and append as much to the disk line.
        The put rows then measure a tier as a deployment runs it, holding data, its nodes
        writing into memory they gave back, instead of an empty tier on a machine whose memory
        was never touched. Its own batches are summarised (``filled``), CPU included."""
        config = self.handles.config
        cached = config.node.cached_log_bytes
        goal = self.args.fill_gb * 1e9
        if self.args.fill_gb < 0:  # the default: past every node's bound
            goal = 0 if cached is None else 1.25 * cached * config.storage_nodes
        batch = Case(SIZES[SMALL] * self.batch[SMALL])
        count = int(-(-goal // batch.nbytes))
        if not count:
            return
        payloads = self.payloads(SMALL)
        stripes = self.stripe_bytes(SMALL)
        gb = count * batch.nbytes / 1e9
        print(f"filling the tier first: {count} batches, {gb:.1f} GB", file=sys.stderr)
        phase = PhaseCpu(self.groups, self.redis.pid, self.rest)
        phase.start(batch)
        for _ in range(count):
            keys = [os.urandom(32) for _ in payloads]
            with timed(batch):
                result = self.client.put_blocks(keys, payloads)
            if not result.ok:
                raise RuntimeError(f"fill: {len(result.failed)} of {len(keys)} blocks failed")
        phase.stop(batch, None)
        for _ in range(count):
            self.disk_line.append(stripes)
        self.filled = batch.summary()

    def get_phase(self, label: str, row: str, runs: int) -> None:
        keys, payloads = self.workload[label]
        redis_keys = [b"redis:" + key for key in keys]
        ours, peer = self.case(row, label, "kvstore"), self.case(row, label, "redis")
        start = time.perf_counter()
        found = self.client.lookup(keys)
        self.lookup_s[label].append(time.perf_counter() - start)
        if found.hit_blocks != len(keys):
            raise RuntimeError(f"lookup found {found.hit_blocks} of {len(keys)} blocks")
        lease = found.lease
        counts = self.degraded_blocks[label] if row != "get" else None

        def get(index: int, timed_run: bool) -> None:
            with self.measure(ours, timed_run):
                blocks, degraded = self.read(keys, lease)
            if index == 0:
                for block, payload in zip(blocks, payloads, strict=True):
                    if block is None or not np.array_equal(block, payload):
                        raise RuntimeError(f"{row} {label}: a miss or wrong bytes")
            if counts is not None and timed_run:
                counts[0] += sum(degraded) if degraded is not None else 0
                counts[1] += len(degraded) if degraded is not None else 0

        def peer_get(index: int, timed_run: bool) -> None:
            with self.measure(peer, timed_run):
                values = self.redis.get_many(redis_keys)
            if index == 0 and any(v != p.tobytes() for v, p in zip(values, payloads, strict=True)):
                raise RuntimeError("redis returned wrong bytes")

        try:
            self.loop(get, peer_get, runs, ours, peer)
        finally:
            self.client.release(lease)

    def read(self, keys: list[bytes], lease: Any) -> tuple[list[Any], list[bool] | None]:
        """``client.read`` (payloads + which blocks were degraded), or ``get_blocks``."""
        read = getattr(self.client, "read", None)
        if read is None:
            return self.client.get_blocks(keys, lease), None
        outcome = read(keys, lease)
        return outcome.payloads, outcome.degraded

    def path_phase(self, label: str, row: str) -> None:
        """The get batch by an engine's own read path (``row``: DIRECT or GATEWAY, see
        ``blockstore_paths``), each batch next to a Redis GET of the same batch."""
        keys, payloads = self.workload[label]
        redis_keys = [b"redis:" + key for key in keys]
        ours, peer = self.case(row, label, "kvstore"), self.case(row, label, "redis")
        path: DirectPath | GatewayPath
        if row == DIRECT:
            if self.reader is None:  # this process is the tier here: it mints (direct_reads.py)
                config = self.handles.config
                endpoints = self.handles.read_endpoints()
                self.reader = DirectReader(endpoints, config.data_shards, config.parity_shards)
                self.read_key = self.handles.read_key()
            path = DirectPath(self.client, keys, self.reader, self.read_key)
        else:
            assert self.gateway is not None
            path = self.gateway.path(keys, payloads)

        def read(index: int, timed_run: bool) -> None:
            path.prepare()
            with self.measure(ours, timed_run):
                path.read()
            if index == 0:
                path.check(payloads)

        def peer_get(index: int, timed_run: bool) -> None:
            with self.measure(peer, timed_run):
                self.redis.get_many(redis_keys)

        try:
            self.loop(read, peer_get, self.args.runs, ours, peer)
        finally:
            path.close()

    def degraded_put(self, label: str) -> None:
        """What a put does with 2 nodes killed: up to 3 batches (each bounded by the client's
        call timeout). Timed like a normal put if every block is stored; else one note saying
        what happened."""
        payloads = self.payloads(label)
        ours = self.case("put, 2 nodes killed", label, "kvstore")
        trial = Case(ours.nbytes)
        outcomes: list[str] = []
        deadline = time.monotonic() + self.args.case_seconds
        phase = PhaseCpu(self.groups, self.redis.pid, self.rest)
        phase.start(trial)
        for _ in range(3):
            keys = [os.urandom(32) for _ in payloads]
            try:
                with self.measure(trial, True):
                    result = self.client.put_blocks(keys, payloads)
            except Exception as error:  # what it does, whatever it is, is the measurement
                outcomes.append(f"raised {type(error).__name__}: {error}"[:160])
                break
            stored = len(result.stored)
            outcomes.append(f"{stored}/{len(keys)} stored")
            if time.monotonic() > deadline:
                break
        phase.stop(trial, None)
        if trial.seconds and all(o == f"{len(payloads)}/{len(payloads)} stored" for o in outcomes):
            ours.seconds, ours.cpu = trial.seconds, trial.cpu
            return
        times = ", ".join(f"{t * 1e3:.0f}" for t in trial.seconds)
        ours.notes.append(f"{'; '.join(sorted(set(outcomes)))} ({len(outcomes)} tries, {times} ms)")

    @contextlib.contextmanager
    def measure(self, case: Case, timed_run: bool) -> Iterator[None]:
        if not timed_run:
            yield
            return
        with timed(case):
            yield

    def run(self) -> None:
        half = max(2, self.args.runs // 2)
        self.rest = self.groups.at_rest(REST_S)
        self.fill()
        for label in SIZES:
            self.put_phase(label)
        for label in SIZES:
            self.get_phase(label, "get", half)
            self.first_half[label] = len(self.case("get", label, "kvstore").seconds)
        for label in SIZES:
            self.path_phase(label, DIRECT)
        if self.gateway is not None:  # the gateway's tier takes blocks of the preset's size only
            self.path_phase(SMALL, GATEWAY)
        self.handles.kill_nodes(list(KILLED), restart=False)
        for label in SIZES:
            self.get_phase(label, "get, 2 nodes killed", self.args.runs)
        if not self.args.no_degraded_put:
            for label in SIZES:
                self.degraded_put(label)
        start_node = getattr(self.handles, "start_node", None)
        if start_node is None:
            return
        for node_id in KILLED:  # the machines come back with their disks
            start_node(node_id)
        self.client = self.handles.client()
        self.groups = CpuGroups(self.handles, exclude={self.redis.pid})
        self.rest = self.groups.at_rest(REST_S)  # the restarted nodes are new processes
        for label in SIZES:
            self.get_phase(label, "get", self.args.runs - half)


def store_config(args: argparse.Namespace, data_root: str) -> BlockStoreConfig:
    cached: dict[str, int | None] = {}  # the nodes' own default unless --cached-log-mib
    if args.cached_log_mib == "none":
        cached["cached_log_bytes"] = None
    elif args.cached_log_mib:
        cached["cached_log_bytes"] = int(args.cached_log_mib) * 2**20
    return BlockStoreConfig(
        data_root=data_root,
        node=StorageNodeConfig(fsync=args.fsync, **cached),
        call_timeout_s=args.call_timeout,
        deployment="bench",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.runtime.deploy import deploy_blockstore

    started = time.monotonic()
    data_root = tempfile.mkdtemp(prefix="kvstore-bench-blocks-", dir=args.data_root)
    config = store_config(args, data_root)
    handles = gateway = None
    try:
        with peer_redis(args.redis) as redis:
            # --join: a testbed's Ray (this process on its client host); else embedded.
            connect(args.join, config=LocalClusterConfig(head_object_store_mib=2048))
            handles = deploy_blockstore(config, start_repair=False)
            gateway = Gateway(config)  # before Bench: its process counts with the Ray ones
            deployed = time.monotonic()
            bench = Bench(args, handles, redis, data_root, gateway)
            bench.run()
            bench.disk_line.close()
            results = report(args, config, bench)
            results["config"]["hiredis"] = redis.hiredis
            results["config"]["deploy_s"] = deployed - started
    finally:
        if gateway is not None:
            gateway.close()
        if handles is not None:
            handles.shutdown()
        shutil.rmtree(data_root, ignore_errors=True)
    if args.join:
        results["config"]["ray"] = f"Ray across testbed hosts, joined at {args.join}"
        results["config"]["client"] = "handles.client() on the client host (no storage node)"
        results["config"]["redis"] = f"redis-server on another host ({args.redis}"
    if args.zstd:
        results["zstd"] = measure_zstd(np.random.default_rng(7), STATE)
    results["config"]["wall_s"] = time.monotonic() - started
    return results


def target_result(
    bench: Bench, entry: dict[str, Any], versus: str, limit: float, issue: int
) -> dict[str, Any]:
    """One target of a row: its value and whether it is met (a ratio at least ``limit``, or
    for "CPU-s/GB" the kvstore total at most ``limit``; for ``CLIENT_CORE`` the ratio of the
    Redis client's CPU per GB to kvstore's client's; for ``DISK_PER_CORE`` the pace its
    busiest process allows over the disk line's GB/s)."""
    ours = entry["kvstore"]
    if versus == "CPU-s/GB":
        cpu = ours.get("cpu_s_per_gb")
        total = sum(cpu.values()) if cpu else None
        met = total is not None and total <= limit
        return {"versus": versus, "value": total, "max": limit, "met": met, "issue": issue}
    value: float | None
    if versus == DISK_PER_CORE:
        pace = per_core_gbps(ours)
        disk = (entry.get("disk") or {}).get("gbps")
        value = pace / disk if pace and disk else None
    elif versus == CLIENT_CORE:
        mine = (ours.get("cpu_s_per_gb") or {}).get("client")
        theirs = ((entry["redis"] or {}).get("cpu_s_per_gb") or {}).get("client")
        value = theirs / mine if mine and theirs else None
    else:
        if versus == "normal get":
            base = bench.cases[("get", entry["block"], "kvstore")].summary()
        else:
            base = entry.get("disk") if versus == "disk ceiling" else entry["redis"]
        gbps = ours.get("gbps")
        value = gbps / base["gbps"] if gbps and base and base.get("gbps") else None
    met = value is not None and value >= limit
    return {"versus": versus, "ratio": value, "min": limit, "met": met, "issue": issue}


def per_core_gbps(summary: dict[str, Any]) -> float | None:
    """GB/s where each process has a core of its own: what its busiest process's CPU per GB
    allows (a storage node writes one shard of every block, so the nodes share a put evenly)."""
    busiest = summary.get("busiest_cpu_s_per_gb") or {}
    most = max(busiest.values(), default=0.0)
    return 1.0 / most if most > 0 else None


def report(args: argparse.Namespace, config: BlockStoreConfig, bench: Bench) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    order = ("put", "get", DIRECT, GATEWAY, "get, 2 nodes killed", "put, 2 nodes killed")
    for label in SIZES:
        for row in order:
            ours = bench.cases.get((row, label, "kvstore"))
            if ours is None:
                continue
            peer = bench.cases.get((row, label, "redis"))
            entry: dict[str, Any] = {
                "row": row,
                "block": label,
                "block_bytes": SIZES[label],
                "batch_blocks": bench.batch[label],
                "kvstore": ours.summary(),
                "redis": peer.summary() if peer is not None else None,
            }
            disk = bench.cases.get((row, label, "disk"))
            if disk is not None:
                entry["disk"] = disk.summary()
            if row == "get" and label in bench.first_half:
                cut = bench.first_half[label]
                before, after = ours.seconds[:cut], ours.seconds[cut:]
                entry["kvstore"]["p50_ms_halves"] = [
                    statistics.median(half) * 1e3 if half else None for half in (before, after)
                ]
            if row.endswith("killed") and row.startswith("get"):
                degraded, total = bench.degraded_blocks[label]
                entry["blocks_read_degraded"] = f"{degraded}/{total}"
            entry["targets"] = [
                target_result(bench, entry, versus, limit, issue)
                for versus, limit, issue in TARGETS.get((row, label), [])
            ]
            rows.append(entry)
    return {
        "config": {
            "storage_nodes": config.storage_nodes,
            "meta_shards": config.meta_shards,
            "code": f"{config.data_shards}+{config.parity_shards}",
            "fsync": args.fsync,
            "batch_blocks": dict(bench.batch),
            "turn": args.turn,
            "runs": args.runs,
            "case_seconds": args.case_seconds,
            "killed_nodes": list(KILLED),
            "write_quorum": config.write_quorum,
            "ray": "embedded local Ray, one node, 127.0.0.1",
            "client": "handles.client(), no storage node in the client process",
            "node_pids_from": bench.groups.pid_source,
            "cpus": os.cpu_count(),
            "cached_log_bytes": config.node.cached_log_bytes,
            "fill": bench.filled,
            "at_rest_cores": {role: sum(cores.values()) for role, cores in bench.rest.items()},
        },
        "rows": rows,
        "lookup_p50_ms": {
            label: statistics.median(values) * 1e3
            for label, values in bench.lookup_s.items()
            if values
        },
    }


# --- output ------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    batches = ", ".join(f"{n} x {label}" for label, n in cfg["batch_blocks"].items())
    lines = [
        f"Block KVCache tier ({cfg['storage_nodes']} storage nodes, {cfg['code']}, "
        f"{cfg['meta_shards']} meta shards, fsync={cfg['fsync']}, {cfg['ray']}; client: "
        f"{cfg['client']}) vs {cfg.get('redis', 'redis-server (loopback')}, pipelined, "
        f"hiredis={cfg['hiredis']}), "
        f"same run; batches of {batches} blocks, {cfg['turn']} of kvstore's in a row then the "
        f"peers'; up to {cfg['runs']} timed batches per case (median); {cfg['cpus']} CPUs; "
        f"wall {cfg['wall_s']:.0f} s",
        "",
        "| op | block | kvstore GB/s | p50 ms/batch | Redis GB/s | Redis p50 ms | ratio "
        "| target | met? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["rows"]:
        ours, peer = entry["kvstore"], entry["redis"] or {}
        # In the table: the row's target against Redis or the normal get (the others below).
        target = next((t for t in entry["targets"] if t["versus"] in TABLED), None)
        if not ours.get("batches"):
            why = "; ".join(ours.get("notes") or []) or "not measured"
            cell = why
            if "killed" in entry["row"]:  # fewer live nodes than a put needs: it fails cleanly
                live = cfg["storage_nodes"] - len(cfg["killed_nodes"])
                cell = f"n/a ({live} live nodes < min_write_shards {cfg['write_quorum']}): {why}"
            lines.append(f"| {entry['row']} | {entry['block']} | {cell} | | | | | | |")
            continue
        # The table's ratio: to Redis, or for a degraded row to the normal get (its target's).
        ratio, versus = None, ""
        if target is not None:
            ratio = target["ratio"]
            versus = "normal" if target["versus"] == "normal get" else "Redis"
        elif ours.get("gbps") and peer.get("gbps"):
            ratio, versus = ours["gbps"] / peer["gbps"], "Redis"
        goal = f">= {target['min']:.1f}x {target['versus']}" if target else "-"
        row = entry["row"]
        if "blocks_read_degraded" in entry:
            row += f" ({entry['blocks_read_degraded']} blocks decoded)"
        lines.append(
            f"| {row} | {entry['block']} | {ours['gbps']:.3f} | {ours['p50_ms']:.1f} "
            f"| {_fmt(peer.get('gbps'), '.3f')} | {_fmt(peer.get('p50_ms'), '.1f')} "
            f"| {_fmt(ratio, '.2f')}x {versus if ratio is not None else ''} "
            f"| {goal} "
            f"| {('yes' if target['met'] else 'NO') if target else '-'} |"
        )
    lines += [
        "",
        "CPU seconds per GB of block payload moved (timed batches only):",
        "",
        "| op | block | storage nodes | meta shards | other Ray procs | client | kvstore total "
        "| redis-server | Redis client | Redis total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["rows"]:
        ours, peer = entry["kvstore"], entry["redis"] or {}
        if not ours.get("batches"):
            continue
        cpu = ours["cpu_s_per_gb"]
        theirs = peer.get("cpu_s_per_gb", {})
        lines.append(
            f"| {entry['row']} | {entry['block']} | {cpu.get('nodes', 0):.2f} "
            f"| {cpu.get('meta', 0):.2f} | {cpu.get('ray', 0):.2f} | {cpu.get('client', 0):.2f} "
            f"| {sum(cpu.values()):.2f} | {_fmt(theirs.get('redis-server'), '.2f')} "
            f"| {_fmt(theirs.get('client'), '.2f')} "
            f"| {_fmt(sum(theirs.values()) if theirs else None, '.2f')} |"
        )
    ceilings = [
        f"{e['block']} {e['disk']['gbps']:.3f} GB/s of payload (kvstore put "
        f"{e['kvstore']['gbps'] / e['disk']['gbps']:.2f}x of it)"
        for e in results["rows"]
        if e.get("disk", {}).get("gbps") and e["kvstore"].get("gbps")
    ]
    if ceilings:
        lines += [
            "",
            "disk ceiling, same run: one process appending the bytes the 12 nodes write for a "
            f"put batch (every shard), one flush per batch (fsync={cfg['fsync']}), keeping "
            "the nodes' page-cache bound (benchmarks/blockstore_disk.py): " + "; ".join(ceilings),
        ]
    paces = [
        f"{e['block']} {pace:.3f} GB/s (the busiest process of each kind, CPU-s/GB: "
        + ", ".join(f"{role} {s:.2f}" for role, s in e["kvstore"]["busiest_cpu_s_per_gb"].items())
        + ")"
        for e in results["rows"]
        if e["row"] == "put" and (pace := per_core_gbps(e["kvstore"]))
    ]
    if paces:
        lines += [
            "",
            "put per core: the pace where every process of the run (the client, each storage "
            "node, each meta shard, Ray's own) has a core of its own, as on a deployment's "
            "machines: 1 / the busiest one's CPU-s/GB (here they all share the cores): "
            + "; ".join(paces),
        ]
    rest = cfg.get("at_rest_cores") or {}
    if rest:
        parts = ", ".join(f"{role} {cores:.3f}" for role, cores in rest.items())
        lines += [
            "",
            f"the tier's processes at rest ({REST_S:.0f} s, no request): "
            f"{sum(rest.values()):.3f} cores ({parts}); each case is charged their CPU over "
            "its phase less that rest over the time the phase spent outside kvstore's "
            "batches (Redis', the disk line's)",
        ]
    fill = cfg.get("fill") or {}
    if fill.get("batches"):
        bound = cfg["cached_log_bytes"]
        lines += [
            "",
            f"before the put rows, untimed: the tier filled with {fill['gb_moved']:.1f} GB of "
            f"111 KiB blocks at {fill['gbps']:.3f} GB/s, "
            f"{sum(fill['cpu_s_per_gb'].values()):.2f} CPU-s/GB over all processes, past each "
            f"node's page-cache bound ({_fmt(bound and bound / 2**20, '.0f')} MiB), as a "
            "deployed tier is; the disk line's file likewise (--fill-gb 0: an empty tier)",
        ]
    halves = [
        f"{e['block']} {_fmt(h[0], '.1f')} / {_fmt(h[1], '.1f')} ms"
        for e in results["rows"]
        if (h := e["kvstore"].get("p50_ms_halves"))
    ]
    lines.append("")
    if halves:
        lines.append(f"normal get p50, before killing / after restarting: {', '.join(halves)}")
    lookups = ", ".join(f"{k} {v:.2f} ms" for k, v in results["lookup_p50_ms"].items())
    lines += [
        f"lookup of one batch (+ lease), p50: {lookups}; node pids from {cfg['node_pids_from']}",
    ]
    for row in results.get("zstd", []):
        lines.append(
            f"zstd on KV-like {row['values']} (1.35 MiB), level {row['level']}: ratio "
            f"{row['ratio']:.3f}, {row['compress_mbps']:.0f} MB/s"
        )
    lines += ["", "targets (the issue that set each):"]
    missed = []
    for entry in results["rows"]:
        for t in entry["targets"]:
            what = f"{entry['row']} {entry['block']}"
            if t["versus"] == "CPU-s/GB":
                goal = f"<= {t['max']:.1f} CPU-s/GB over all processes"
                got = f"{_fmt(t['value'], '.2f')} CPU-s/GB"
            else:
                goal = f">= {t['min']:.1f}x {t['versus']}"
                got = f"{_fmt(t['ratio'], '.2f')}x"
            lines.append(
                f"- {what} {goal} (issue {t['issue']}): {got}, {'met' if t['met'] else 'NOT met'}"
            )
            if not t["met"]:
                missed.append(f"{what} ({t['versus']})")
    lines.append("")
    lines.append("all targets met" if not missed else f"targets missed: {', '.join(missed)}")
    return "\n".join(lines)


def across_hosts(args: argparse.Namespace) -> dict[str, Any]:
    """This benchmark on a testbed's client host (see ``benchmarks/hosts.py``)."""
    from benchmarks.hosts import cross_host_testbed, run_on_client

    passed = ["--runs", str(args.runs), "--case-seconds", str(args.case_seconds)]
    passed += ["--batch", str(args.batch), "--batch-large", str(args.batch_large)]
    passed += ["--turn", str(args.turn)]
    passed += ["--fsync", args.fsync, "--call-timeout", str(args.call_timeout)]
    passed += ["--fill-gb", str(args.fill_gb), "--cached-log-mib", args.cached_log_mib]
    passed += ["--no-degraded-put"] if args.no_degraded_put else []
    with cross_host_testbed() as (bed, redis):
        argv = [str(Path(__file__).resolve()), "--join", bed.ray.address, "--redis", redis]
        argv += ["--data-root", str(bed.run_dir), *passed]
        return run_on_client(bed, argv)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--runs",
        type=int,
        default=30,
        help="timed batches per case, after 2 warm-ups (>= 4; the CPU figures come from "
        "/proc's 10 ms ticks of ~20 processes: a dozen batches leave them coarse)",
    )
    parser.add_argument(
        "--case-seconds",
        type=float,
        default=20.0,
        help="a case stops after this long once it has 3 timed batches",
    )
    parser.add_argument("--batch", type=int, default=64, help="blocks per 111 KiB batch")
    parser.add_argument("--batch-large", type=int, default=64, help="blocks per 1.35 MiB batch")
    parser.add_argument(
        "--turn",
        type=int,
        default=1,
        help="timed batches of kvstore's in a row before the peers' same batches (1: they "
        "alternate batch by batch)",
    )
    parser.add_argument(
        "--fsync",
        choices=("always", "batch", "never"),
        default="batch",
        help="the storage nodes' durability policy (StorageNodeConfig.fsync)",
    )
    parser.add_argument("--call-timeout", type=float, default=30.0, help="client call timeout, s")
    parser.add_argument(
        "--no-degraded-put", action="store_true", help="skip the put with 2 nodes killed"
    )
    parser.add_argument(
        "--fill-gb",
        type=float,
        default=-1.0,
        help="GB of 111 KiB blocks put (untimed) before the put rows, so they measure a tier "
        "holding data; default: enough to pass every node's page-cache bound; 0: an empty tier",
    )
    parser.add_argument(
        "--cached-log-mib",
        default="",
        help="each node's page-cache bound (StorageNodeConfig.cached_log_bytes) in MiB, or "
        "'none' (no bound: the kernel decides, as before 2026-12-05); default: the nodes' own",
    )
    parser.add_argument("--zstd", action="store_true", help="also measure zstd on KV-like bytes")
    parser.add_argument("--data-root", default=None, help="parent dir of the node data dirs")
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="across hosts (root): a testbed of network namespaces, this benchmark on its "
        "client host, Redis on a storage host (benchmarks/hosts.py)",
    )
    parser.add_argument("--join", help=argparse.SUPPRESS)  # set by --hosts: the testbed's Ray
    parser.add_argument("--redis", help=argparse.SUPPRESS)  # set by --hosts: HOST:PORT
    args = parser.parse_args()
    if args.runs < 4:
        parser.error("--runs must be >= 4")
    if args.batch < 1 or args.batch_large < 1:
        parser.error("batches must hold at least one block")
    if args.turn < 1:
        parser.error("--turn must be >= 1")
    if args.cached_log_mib not in ("", "none") and not args.cached_log_mib.isdigit():
        parser.error("--cached-log-mib must be a number of MiB or 'none'")
    # Ray prints cluster warnings to stdout; keep stdout for the table / JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        results = across_hosts(args) if args.hosts else run(args)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(results))
    met = [t["met"] for e in results["rows"] for t in e["targets"]]
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
