"""Block KVCache tier vs a Redis server: put/get throughput and latency, normal and degraded.

On one machine: an embedded local Ray (one Ray node on loopback) with 12 storage node actors,
each its own failure domain with its own data directory, 4 meta shards; and in the same run a
Debian ``redis-server`` on loopback (started and stopped here), driven with redis-py + hiredis
pipelines: the peer a user would pick instead.

For batches of 64 blocks of 111 KiB (113,920 B, a V4.1-Flash block) and of 1.35 MiB
(1,415,040 B): put throughput and latency (Redis: pipelined SET), get throughput and latency
(Redis: pipelined GET), then get with 2 storage nodes killed (degraded: 2 of 12 shards gone, so
most blocks need Reed-Solomon decoding). The storage nodes share this machine with the client,
so it reads their shard files directly (short-circuit local reads, ``blockstore/localread.py``);
"get over Ray" is the same read by a client with local reads off, i.e. what a client on a
machine without storage nodes pays (every shard through a node actor). Get uses the lease from
one ``lookup`` (what an engine does: lookup, then fetch); lookup latency is reported on its
own. Gets and Redis GETs are interleaved batch by batch so machine noise hits both alike, and
the normal gets are taken half before and half after the degraded phase (the killed nodes
restarted on their disks) so normal and degraded see the same stretch of noise. 1 GB = 10^9 bytes.

Also measured: zstd compression ratio and speed on realistic KV bytes (bf16 and fp8-e4m3 values
from a normal distribution), which is why blocks are stored uncompressed.

Targets (issue 4): get throughput of 111 KiB batches >= 0.5x Redis pipelined GET; degraded get
>= 0.7x normal get. Exit status 1 if one fails.

    python3 benchmarks/blockstore.py [--json] [--runs 40] [--fsync batch] [--data-root DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.geometry import GeometryConfig
from kvstore.runtime.cluster import LocalClusterConfig, connect

#: One V4.1-Flash block and one SWA state (SPEC §2, §3), from the model preset.
V41_BLOCK = GeometryConfig.default().block_bytes
V41_STATE = GeometryConfig.default().state_size_to_disk
SIZES = {"111 KiB": V41_BLOCK, "1.35 MiB": V41_STATE}
BATCH = 64
REDIS_SERVER = "/usr/bin/redis-server"
GET_TARGET = 0.5
DEGRADED_TARGET = 0.7


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


def summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    median = statistics.median(seconds)
    return {
        "gbps": nbytes / median / 1e9,
        "p50_ms": median * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "batches": len(seconds),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisPeer:
    def __init__(self) -> None:
        import redis

        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvstore-bench-redis-")
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def set_many(self, keys: list[bytes], values: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def get_many(self, keys: list[bytes]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def kv_like_bytes(size: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Bytes shaped like cached KV: bf16 or fp8-e4m3 encodings of normal values."""
    values = rng.standard_normal(size // 2 if kind == "bf16" else size).astype(np.float32)
    if kind == "bf16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)[:size]
    # fp8 e4m3: sign, 4-bit exponent (bias 7), 3-bit mantissa, by rounding the float32 fields.
    bits = values.view(np.uint32)
    sign = (bits >> 31).astype(np.uint8) << 7
    exponent = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    mantissa = ((bits >> 20) & 0x7).astype(np.uint8)
    exponent = np.clip(exponent, 0, 15).astype(np.uint8)
    return (sign | (exponent << 3) | mantissa).astype(np.uint8)


def measure_zstd(rng: np.random.Generator) -> list[dict[str, Any]]:
    import zstandard

    rows = []
    size = SIZES["1.35 MiB"]
    for kind in ("bf16", "fp8-e4m3"):
        data = kv_like_bytes(size, kind, rng).tobytes()
        for level in (1, 3):
            compressor = zstandard.ZstdCompressor(level=level)
            seconds = []
            compressed = b""
            for _ in range(5):
                start = time.perf_counter()
                compressed = compressor.compress(data)
                seconds.append(time.perf_counter() - start)
            rows.append(
                {
                    "values": kind,
                    "level": level,
                    "ratio": len(data) / len(compressed),
                    "compress_mbps": len(data) / statistics.median(seconds) / 1e6,
                }
            )
    return rows


def get_phase(
    client: Any,
    redis_peer: RedisPeer,
    keys: list[bytes],
    payloads: list[np.ndarray],
    lease: Any,
    runs: int,
) -> tuple[list[float], list[float]]:
    """``runs`` timed gets of the batch, each followed by a pipelined Redis GET of the same
    payloads; two untimed warm-ups first, the first one checked bit-exact."""
    redis_keys = [b"redis:" + key for key in keys]
    ours: list[float] = []
    peer: list[float] = []
    for run_index in range(runs + 2):
        start = time.perf_counter()
        blocks = client.get_blocks(keys, lease)
        elapsed = time.perf_counter() - start
        if run_index == 0:
            for block, payload in zip(blocks, payloads, strict=True):
                if block is None or not np.array_equal(block, payload):
                    raise RuntimeError("get returned a miss or wrong bytes")
        if run_index >= 2:
            ours.append(elapsed)
        start = time.perf_counter()
        values = redis_peer.get_many(redis_keys)
        elapsed = time.perf_counter() - start
        if run_index == 0 and values[0] != payloads[0].tobytes():
            raise RuntimeError("redis returned wrong bytes")
        if run_index >= 2:
            peer.append(elapsed)
    return ours, peer


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.runtime.deploy import deploy_blockstore

    rng = np.random.default_rng(7)
    data_root = tempfile.mkdtemp(prefix="kvstore-bench-blocks-", dir=args.data_root)
    config = BlockStoreConfig(
        data_root=data_root,
        node=StorageNodeConfig(fsync=args.fsync, read_cache_bytes=256 * 2**20),
        call_timeout_s=30.0,
        deployment="bench",
    )
    handles = None
    redis_peer = None
    try:
        connect(None, config=LocalClusterConfig(head_object_store_mib=2048))
        handles = deploy_blockstore(config, start_repair=False)
        redis_peer = RedisPeer()
        return measure(args, config, handles, redis_peer, rng)
    finally:
        if redis_peer is not None:
            redis_peer.close()
        if handles is not None:
            handles.shutdown()
        shutil.rmtree(data_root, ignore_errors=True)


def measure(
    args: argparse.Namespace,
    config: BlockStoreConfig,
    handles: Any,
    redis_peer: RedisPeer,
    rng: np.random.Generator,
) -> dict[str, Any]:
    client = handles.client()
    results: dict[str, Any] = {
        "config": {
            "storage_nodes": config.storage_nodes,
            "meta_shards": config.meta_shards,
            "code": f"{config.data_shards}+{config.parity_shards}",
            "fsync": args.fsync,
            "batch_blocks": BATCH,
            "runs": args.runs,
            "data_root": config.data_root,
            "ray": "embedded local Ray, one node, loopback",
            "cpus": os.cpu_count(),
        },
        "sizes": {},
    }
    workloads: dict[str, tuple[list[bytes], list[np.ndarray], Any]] = {}
    for label, size in SIZES.items():
        keys = [os.urandom(32) for _ in range(BATCH)]
        payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH)]
        raw = [payload.tobytes() for payload in payloads]
        nbytes = size * BATCH
        put_s, set_s = [], []
        for run_index in range(max(3, args.runs // 4) + 1):
            batch_keys = keys if run_index == 0 else [os.urandom(32) for _ in range(BATCH)]
            start = time.perf_counter()
            result = client.put_blocks(batch_keys, payloads)
            elapsed = time.perf_counter() - start
            if result.failed:
                raise RuntimeError(f"put failed for {len(result.failed)} blocks")
            if run_index:  # the first batch warms up (and stores the get workload)
                put_s.append(elapsed)
            set_keys = [b"redis:" + key for key in batch_keys]
            start = time.perf_counter()
            redis_peer.set_many(set_keys, raw)
            elapsed = time.perf_counter() - start
            if run_index:
                set_s.append(elapsed)
        lookup_s = []
        lease = None
        for _ in range(10):
            start = time.perf_counter()
            found = client.lookup(keys)
            elapsed = time.perf_counter() - start
            lookup_s.append(elapsed)
            if lease is not None:
                client.release(lease)
            lease = found.lease
            if found.hit_blocks != BATCH:
                raise RuntimeError(f"lookup found {found.hit_blocks} of {BATCH} blocks")
        workloads[label] = (keys, payloads, lease)
        results["sizes"][label] = {
            "block_bytes": size,
            "put": summary(put_s, nbytes),
            "redis_set": summary(set_s, nbytes),
            "lookup": summary(lookup_s, 0),
        }
    # Normal gets in two halves around the degraded phase (machine noise drifts over time;
    # this way normal and degraded see the same stretch of it). Redis GETs are interleaved
    # batch by batch with every phase.
    samples: dict[str, dict[str, list[float]]] = {
        label: {
            "get": [],
            "redis_get": [],
            "get_degraded": [],
            "redis_during_degraded": [],
            "get_over_ray": [],
            "redis_during_over_ray": [],
        }
        for label in SIZES
    }
    half = max(2, args.runs // 2)
    remote = handles.client(local_reads=False)
    for label, (keys, payloads, lease) in workloads.items():
        ours, peer = get_phase(client, redis_peer, keys, payloads, lease, half)
        samples[label]["get"] += ours
        samples[label]["redis_get"] += peer
        ours, peer = get_phase(remote, redis_peer, keys, payloads, lease, half)
        samples[label]["get_over_ray"] += ours
        samples[label]["redis_during_over_ray"] += peer
    # Degraded: two storage nodes die; every block loses 2 of its 12 shards.
    for node_id in (0, 1):
        handles.kill_node(node_id, restart=False)
    for label, (keys, payloads, lease) in workloads.items():
        ours, peer = get_phase(client, redis_peer, keys, payloads, lease, args.runs)
        samples[label]["get_degraded"] += ours
        samples[label]["redis_during_degraded"] += peer
    for node_id in (0, 1):  # the machines come back with their disks
        handles.start_node(node_id)
    client_stats = client.stats()
    client = handles.client()
    for label, (keys, payloads, lease) in workloads.items():
        ours, peer = get_phase(client, redis_peer, keys, payloads, lease, half)
        samples[label]["get"] += ours
        samples[label]["redis_get"] += peer
    for label in SIZES:
        entry = results["sizes"][label]
        nbytes = SIZES[label] * BATCH
        for name, values in samples[label].items():
            entry[name] = summary(values, nbytes)
        entry["get_vs_redis"] = entry["get"]["gbps"] / entry["redis_get"]["gbps"]
        entry["put_vs_redis"] = entry["put"]["gbps"] / entry["redis_set"]["gbps"]
        entry["degraded_vs_normal"] = entry["get_degraded"]["gbps"] / entry["get"]["gbps"]
    results["client_stats"] = {k: v for k, v in client_stats.items() if isinstance(v, int | float)}
    results["zstd"] = measure_zstd(rng)
    small = results["sizes"]["111 KiB"]
    results["targets"] = {
        "get_111KiB_vs_redis": {"value": small["get_vs_redis"], "target": GET_TARGET},
        "degraded_vs_normal_111KiB": {
            "value": small["degraded_vs_normal"],
            "target": DEGRADED_TARGET,
        },
        "degraded_vs_normal_1.35MiB": {
            "value": results["sizes"]["1.35 MiB"]["degraded_vs_normal"],
            "target": DEGRADED_TARGET,
        },
    }
    for target in results["targets"].values():
        target["met"] = target["value"] >= target["target"]
    return results


def table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"Block KVCache tier ({cfg['storage_nodes']} storage nodes, {cfg['code']}, "
        f"fsync={cfg['fsync']}, {cfg['ray']}) vs redis-server (loopback, pipelined, hiredis); "
        f"batches of {cfg['batch_blocks']} blocks, {cfg['runs']} runs, {cfg['cpus']} CPUs",
        "",
        "| block | operation | kvstore GB/s | p50 ms | p99 ms | Redis GB/s | Redis p50 ms "
        "| Redis p99 ms | kvstore / Redis |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in results["sizes"].items():
        pairs = (
            ("put", entry["put"], entry["redis_set"], "SET"),
            ("get", entry["get"], entry["redis_get"], "GET"),
            ("get, 2 nodes down", entry["get_degraded"], entry["redis_during_degraded"], "GET"),
            ("get over Ray", entry["get_over_ray"], entry["redis_during_over_ray"], "GET"),
        )
        for name, ours, peer, verb in pairs:
            lines.append(
                f"| {label} | {name} (Redis {verb}) | {ours['gbps']:.3f} | {ours['p50_ms']:.1f} "
                f"| {ours['p99_ms']:.1f} | {peer['gbps']:.3f} | {peer['p50_ms']:.1f} "
                f"| {peer['p99_ms']:.1f} | {ours['gbps'] / peer['gbps']:.2f}x |"
            )
        lines.append(
            f"| {label} | lookup 64 keys + lease | - | {entry['lookup']['p50_ms']:.2f} "
            f"| {entry['lookup']['p99_ms']:.2f} | - | - | - | - |"
        )
    lines.append("")
    for label, entry in results["sizes"].items():
        lines.append(
            f"{label}: degraded get / normal get = {entry['degraded_vs_normal']:.2f}x; "
            f"get / Redis GET = {entry['get_vs_redis']:.2f}x; "
            f"put / Redis SET = {entry['put_vs_redis']:.2f}x"
        )
    lines.append("")
    lines.append("zstd on KV-like bytes (1.35 MiB):")
    for row in results["zstd"]:
        lines.append(
            f"  {row['values']:9s} level {row['level']}: ratio {row['ratio']:.3f}, "
            f"compress {row['compress_mbps']:.0f} MB/s"
        )
    lines.append("")
    for name, target in results["targets"].items():
        verdict = "PASS" if target["met"] else "FAIL"
        lines.append(f"{verdict} {name}: {target['value']:.2f} (target >= {target['target']})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="write JSON to stdout")
    parser.add_argument("--runs", type=int, default=40, help="timed get batches per case")
    parser.add_argument("--fsync", choices=("always", "batch", "never"), default="batch")
    parser.add_argument("--data-root", default=None, help="parent dir of the node data dirs")
    args = parser.parse_args()
    if args.runs < 4:
        parser.error("--runs must be >= 4")
    if not os.path.exists(REDIS_SERVER):
        print(f"{REDIS_SERVER} not found (apt-get install redis-server)", file=sys.stderr)
        return 2
    # Ray prints cluster warnings to stdout; keep stdout for the table / JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        results = run(args)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(results))
    return 0 if all(t["met"] for t in results["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
