"""Direct reads vs the client's ``get_blocks``, same run, same deployed block tier.

What runs: an embedded local Ray with the block tier deployed as in production (12 storage
node actors, 10+2, each its own data dir; every shard crosses a node's socket to this process).
The same blocks (default 774 of 128 KiB: 99 MiB, a ~100k-token prompt's worth) are read, run by
run, in alternating order:

- direct: what an engine's fetcher would do with its lease's read capability: each node's
  engine read socket asked for its shards, received straight into one staging buffer
  (``DirectReader.read_into``; the capability minted from the lease, as the tier would at
  grant: minting is timed apart);
- direct, by layer: the same read into a layer-major staging region (``--layers`` equal
  slices of each block, as the engine's staging lays a load out: ``Spread``) with the data
  shards asked stripe position by position and the progress handed on (``on_prefix``), as the
  fetcher does to publish each layer as it arrives; it also reports when layer 0 was in place;
- direct, into the KV rows: the same read cut per layer into the rows of a CPU engine's KV cache
  (one array per layer, the request's block ids as rows: ``loads_in_place``, what the fetcher
  does with ``kvstore.engine.sharedkv``), nothing after the socket;
- direct + copy into the KV rows: the read into a layer-major staging region, then each
  layer's span copied into those rows (what a CPU engine did before loads landed in place,
  ``loads_in_place`` false);
- direct, a node down: the plain direct read by a reader for which one storage node's read
  socket refuses (a node that died: nothing listens at its address): the blocks with a data
  shard there come from parity (the data shards that landed kept, the parity asked for in
  the same round once the node rests, the lost rows rebuilt where they lie:
  ``kvstore.blockstore.inplace``);
- get_blocks: the existing client read with the lease, as the gateway does before it streams
  the blocks back (arrays in the client's arena);
- get_blocks + copy: the same, then each block copied into a staging buffer (what an engine
  needs in the end; the gateway's gRPC relay adds its own copies on top).

Each run takes a fresh lookup (its lease; not timed) and checks every block bit-exact (not
timed). GB/s is payload bytes (10^9) over wall seconds; medians over ``--runs`` (after one
warm-up each). The issue's target: >= 1 GB/s into staging by the direct path. The machine is
shared: compare the rows of one run.

    python3 benchmarks/direct_reads.py [--blocks 774] [--block-kib 128] [--layers 8] [--runs 5]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from kvstore.blockstore.capability import mint_for_lease  # noqa: E402
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig  # noqa: E402
from kvstore.blockstore.direct import DirectReader  # noqa: E402
from kvstore.blockstore.readblocks import Spread  # noqa: E402
from kvstore.runtime.cluster import LocalClusterConfig, connect  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=774)
    parser.add_argument("--block-kib", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8, help="slices of a block (by layer)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per path (>= 3)")
    parser.add_argument("--data-root", default=None, help="where the nodes' data dirs go")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    if args.runs < 3:
        parser.error("--runs: at least 3 (medians)")
    if args.layers < 1 or (args.block_kib * 1024) % args.layers:
        parser.error("--layers: at least 1, and a divisor of the block's bytes")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstore.runtime.deploy import deploy_blockstore

    size = args.block_kib * 1024
    data_root = tempfile.mkdtemp(prefix="kvstore-bench-direct-", dir=args.data_root)
    config = BlockStoreConfig(
        data_root=data_root,
        node=StorageNodeConfig(fsync="never"),
        deployment="bench-direct",
        call_timeout_s=30.0,
    )
    handles = None
    try:
        connect(None, config=LocalClusterConfig(head_object_store_mib=2048))
        handles = deploy_blockstore(config, start_repair=False)
        client = handles.client()
        rng = np.random.default_rng(11)
        keys = [os.urandom(32) for _ in range(args.blocks)]
        payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in keys]
        for start in range(0, len(keys), 64):
            put = client.put_blocks(keys[start : start + 64], payloads[start : start + 64])
            assert put.ok and not put.busy, put
        expected = np.concatenate(payloads)
        read_key = handles.read_key()  # this process is the tier here: it mints
        endpoints = handles.read_endpoints()
        reader = DirectReader(endpoints, config.data_shards, config.parity_shards)
        # A dead node's address: a socket bound on loopback and never listening refuses.
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        down_node = min(endpoints)
        degraded = DirectReader(
            {**endpoints, down_node: dead.getsockname()}, config.data_shards, config.parity_shards
        )
        staging = np.zeros(args.blocks * size, np.uint8)
        names = (
            "direct",
            "direct, by layer",
            "direct, into the KV rows",
            "direct + copy into the KV rows",
            "direct, a node down",
            "get_blocks",
            "get_blocks + copy",
        )
        seconds: dict[str, list[float]] = {name: [] for name in names}
        mint_s: list[float] = []
        first_layer_s: list[float] = []
        # Layer-major: layer i's slice of every block, block after block (the engine's staging).
        slice_bytes = size // args.layers
        spread = Spread(
            tuple(
                (i * slice_bytes, slice_bytes, i * slice_bytes * args.blocks)
                for i in range(args.layers)
            ),
            tuple(range(args.blocks)),
        )
        layer_major = expected.reshape(args.blocks, args.layers, slice_bytes).transpose(1, 0, 2)
        layer_major = np.ascontiguousarray(layer_major).reshape(-1)
        # A CPU engine's KV cache: per layer, rows of one block's slice; the request's rows are
        # consecutive ids past the start (a fresh request's), as vLLM allocates them.
        first_row, num_rows = 8, args.blocks + 16
        kv_rows = np.zeros((args.layers, num_rows, slice_bytes), np.uint8)
        ids = range(first_row, first_row + args.blocks)
        into_rows = Spread(
            tuple(
                (i * slice_bytes, slice_bytes, i * num_rows * slice_bytes)
                for i in range(args.layers)
            ),
            tuple(ids),
        )
        rows_want = layer_major.reshape(args.layers, args.blocks, slice_bytes)

        def into_kv(copy: bool) -> float:
            kv_rows[:] = 0
            staging[:] = 0
            found = client.lookup(keys)
            assert found.lease is not None and found.hit_blocks == len(keys)
            capability = mint_for_lease(read_key, found.lease, "bench")
            blocks = list(found.lease.blocks)
            began = time.perf_counter()
            if copy:
                ok = reader.read_into(capability, blocks, staging, spread=spread)
                staged = staging.reshape(args.layers, args.blocks, slice_bytes)
                for layer in range(args.layers):
                    kv_rows[layer, first_row : first_row + args.blocks] = staged[layer]
            else:
                ok = reader.read_into(capability, blocks, kv_rows.reshape(-1), spread=into_rows)
            took = time.perf_counter() - began
            client.release(found.lease)
            landed = kv_rows[:, first_row : first_row + args.blocks]
            assert all(ok) and np.array_equal(landed, rows_want), "KV rows: not bit-exact"
            return took

        def direct_down() -> float:
            staging[:] = 0
            found = client.lookup(keys)
            assert found.lease is not None and found.hit_blocks == len(keys)
            capability = mint_for_lease(read_key, found.lease, "bench")
            began = time.perf_counter()
            ok = degraded.read_into(capability, list(found.lease.blocks), staging)
            took = time.perf_counter() - began
            client.release(found.lease)
            assert all(ok) and np.array_equal(staging, expected), "a node down: not bit-exact"
            return took

        def direct(by_layer: bool) -> float:
            staging[:] = 0
            found = client.lookup(keys)
            assert found.lease is not None and found.hit_blocks == len(keys)
            began = time.perf_counter()
            capability = mint_for_lease(read_key, found.lease, "bench")
            mint_s.append(time.perf_counter() - began)
            blocks = list(found.lease.blocks)
            first: list[float] = []

            def on_prefix(nbytes: int, whole: np.ndarray) -> bool:
                if not first and nbytes >= slice_bytes and whole.all():
                    first.append(time.perf_counter() - began)
                return True

            began = time.perf_counter()
            if by_layer:
                ok = reader.read_into(
                    capability, blocks, staging, spread=spread, on_prefix=on_prefix
                )
            else:
                ok = reader.read_into(capability, blocks, staging)
            took = time.perf_counter() - began
            client.release(found.lease)
            want = layer_major if by_layer else expected
            assert all(ok) and np.array_equal(staging, want), "direct: not bit-exact"
            first_layer_s.extend(first)
            return took

        def gateway(copy: bool) -> float:
            staging[:] = 0
            found = client.lookup(keys)
            assert found.lease is not None
            began = time.perf_counter()
            got = client.get_blocks(keys, found.lease)
            if copy:
                at = 0
                for block in got:
                    assert block is not None
                    staging[at : at + block.size] = block
                    at += block.size
            took = time.perf_counter() - began
            client.release(found.lease)
            assert all(g is not None for g in got)
            if copy:
                assert np.array_equal(staging, expected), "get_blocks: not bit-exact"
            else:
                assert all(np.array_equal(g, p) for g, p in zip(got, payloads, strict=True))
            return took

        paths = {
            "direct": lambda: direct(False),
            "direct, by layer": lambda: direct(True),
            "direct, into the KV rows": lambda: into_kv(False),
            "direct + copy into the KV rows": lambda: into_kv(True),
            "direct, a node down": direct_down,
            "get_blocks": lambda: gateway(False),
            "get_blocks + copy": lambda: gateway(True),
        }
        for measure in paths.values():  # warm-up: connections, pages, caches
            measure()
        mint_s.clear()
        first_layer_s.clear()
        order = list(paths)
        for turn in range(args.runs):
            for name in order if turn % 2 == 0 else reversed(order):
                seconds[name].append(paths[name]())
        total = args.blocks * size
        rows = {
            name: {
                "median_gbps": total / statistics.median(times) / 1e9,
                "best_gbps": total / min(times) / 1e9,
                "median_ms": 1000 * statistics.median(times),
                "runs": len(times),
            }
            for name, times in seconds.items()
        }
        return {
            "config": {
                "blocks": args.blocks,
                "block_bytes": size,
                "payload_bytes": total,
                "storage_nodes": config.storage_nodes,
                "k": config.data_shards,
                "m": config.parity_shards,
                "cpus": os.cpu_count(),
            },
            "rows": rows,
            "mint_ms_median": 1000 * statistics.median(mint_s),
            "first_layer_ms_median": 1000 * statistics.median(first_layer_s),
            "layers": args.layers,
            "reader": dict(reader.counters),
            "reader_a_node_down": dict(degraded.counters),
            "reads_a_node_down": len(seconds["direct, a node down"]) + 1,  # with the warm-up
        }
    finally:
        dead.close()
        if handles is not None:
            handles.shutdown()
        shutil.rmtree(data_root, ignore_errors=True)


def table(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = [
        f"{config['blocks']} blocks x {config['block_bytes'] // 1024} KiB = "
        f"{config['payload_bytes'] / 1e6:.1f} MB, {config['storage_nodes']} storage nodes "
        f"({config['k']}+{config['m']}), {config['cpus']} CPUs, same run",
        f"{'path':<31} {'GB/s (median)':>14} {'GB/s (best)':>12} {'ms (median)':>12} {'runs':>5}",
    ]
    for name, row in results["rows"].items():
        lines.append(
            f"{name:<31} {row['median_gbps']:>14.3f} {row['best_gbps']:>12.3f} "
            f"{row['median_ms']:>12.1f} {row['runs']:>5}"
        )
    direct = results["rows"]["direct"]["median_gbps"]
    relayed = results["rows"]["get_blocks"]["median_gbps"]
    lines.append(
        f"direct / get_blocks: {direct / relayed:.2f}x; minting the capability: "
        f"{results['mint_ms_median']:.1f} ms (median); target >= 1 GB/s direct: "
        f"{'met' if direct >= 1.0 else 'missed'}"
    )
    by_layer = results["rows"]["direct, by layer"]
    lines.append(
        f"direct, by layer: layer 0 of {results['layers']} in place after "
        f"{results['first_layer_ms_median']:.1f} ms of {by_layer['median_ms']:.1f} ms (medians)"
    )
    in_place = results["rows"]["direct, into the KV rows"]["median_ms"]
    copied = results["rows"]["direct + copy into the KV rows"]["median_ms"]
    lines.append(
        f"into a CPU engine's KV rows: in place {in_place:.1f} ms, read into staging and copied "
        f"{copied:.1f} ms ({copied - in_place:+.1f} ms, medians)"
    )
    down = results["rows"]["direct, a node down"]["median_ms"]
    counted, healthy = results["reader_a_node_down"], results["reader"]

    def per_block_kb(counters: dict[str, int]) -> float:
        return counters.get("bytes_received", 0) / max(1, counters.get("blocks", 0)) / 1e3

    lines.append(
        f"a node down: {down:.1f} ms, {down / results['rows']['direct']['median_ms']:.2f}x the "
        f"healthy read; {counted.get('decoded_blocks', 0)} of {counted.get('blocks', 0)} blocks "
        f"decoded from parity ({counted.get('rebuilt_in_place', 0)} rebuilt where they lie, "
        f"{counted.get('second_rounds', 0)} of {results['reads_a_node_down']} reads in two "
        "rounds), "
        f"{counted.get('shards_kept', 0)} data shards kept for them; "
        f"{per_block_kb(counted):.0f} KB received a block ({per_block_kb(healthy):.0f} healthy)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(table(results))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
