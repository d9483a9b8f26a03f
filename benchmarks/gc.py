"""Block index memory and GC decision rate: kvstore's columnar BlockIndex vs a Python dict.

The meta index is what grows with the cache (1 PB of 111 KiB blocks is ~9 billion entries), so
its bytes per block decide how many meta machines the tier needs, and a GC pass must decide over
millions of entries per shard in well under a scan interval.

Measured here, in one run:
- index memory per block: ``BlockIndex.memory_bytes() / len`` (every numpy column with its spare
  capacity, the key -> row hash table, the free stack) at 1M and 10M entries, built the way a
  live shard grows (inserts in batches of 100k);
- insert rate (those batched upserts), find rate (1M random present keys, one call);
- GC decision rate, entries/s scanned: ``expired_rows`` (TTL per class, ~54 % expiring) and
  ``lru_rows`` (oldest blocks summing to 5 % of the bytes) over the whole 10M index;
- the naive alternative a user might write: a dict of key -> slotted dataclass, at 1M entries:
  its memory (tracemalloc of everything built) and the same two scans as Python loops.

Each rate is the median of ``--runs`` timed runs. Targets (issue 5): memory <= 128 B/block and
scan rate >= 10M entries/s; exit status 1 if one fails.

    python3 benchmarks/gc.py [--json] [--runs 3] [--sizes 1000000,10000000] [--naive 1000000]
"""

from __future__ import annotations

import argparse
import gc as python_gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.blockstore.index import BlockIndex
from kvstore.geometry import GeometryConfig

T0 = 1_700_000_000.0
DAY = 86400.0
WIDTH = 12
BLOCK_BYTES = GeometryConfig.default().block_bytes  # one V4.1-Flash block
TTL = np.array([1 * DAY, 3 * DAY, 7 * DAY])
BATCH = 100_000
TARGET_BYTES_PER_BLOCK = 128.0
TARGET_SCAN_RATE = 10_000_000.0


def median_seconds(run: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def synthetic(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "keys": rng.integers(0, 2**64, size=(n, 4), dtype=np.uint64),
        "classes": rng.integers(0, 3, size=n).astype(np.uint8),
        # Last access spread over the past 8 days: ~54 % of blocks past their class TTL.
        "access": T0 - rng.uniform(0, 8 * DAY, size=n),
        "sizes": np.full(n, BLOCK_BYTES, dtype=np.int64),
    }


def build_index(data: dict[str, np.ndarray]) -> tuple[BlockIndex, float]:
    n = data["keys"].shape[0]
    index = BlockIndex(stripe_width=WIDTH)
    placement = np.tile(np.arange(WIDTH, dtype=np.int32), (BATCH, 1))
    start = time.perf_counter()
    for offset in range(0, n, BATCH):
        end = min(n, offset + BATCH)
        index.upsert(
            data["keys"][offset:end],
            placement[: end - offset],
            data["sizes"][offset:end],
            data["classes"][offset:end],
            now=T0 - 8 * DAY,
        )
    elapsed = time.perf_counter() - start
    # Give every block its own last-access time (as replaying an access log would).
    index.touch(index.find(data["keys"]), data["access"])
    return index, elapsed


def measure_index(n: int, runs: int, scans: bool) -> dict[str, float]:
    data = synthetic(n, seed=n)
    index, insert_s = build_index(data)
    result: dict[str, float] = {
        "entries": float(n),
        "bytes_per_block": index.memory_bytes() / len(index),
        "insert_per_s": n / insert_s,
    }
    if scans:
        probe = data["keys"][np.random.default_rng(1).integers(0, n, size=min(n, 1_000_000))]
        result["find_per_s"] = probe.shape[0] / median_seconds(lambda: index.find(probe), runs)
        expired = index.expired_rows(T0, TTL)
        result["expired_fraction"] = expired.size / n
        result["expire_scan_per_s"] = n / median_seconds(lambda: index.expired_rows(T0, TTL), runs)
        needed = int(index.total_bytes() * 0.05)
        result["lru_scan_per_s"] = n / median_seconds(lambda: index.lru_rows(T0, needed), runs)
    return result


@dataclass(slots=True)
class NaiveEntry:
    placement: list[int]
    size: int
    traffic_class: int
    created: float
    last_access: float
    lease_until: float
    lease_count: int


def measure_naive(n: int, runs: int) -> dict[str, float]:
    data = synthetic(n, seed=n)
    keys = [bytes(row) for row in data["keys"].view(np.uint8).reshape(n, 32)]
    classes = data["classes"].tolist()
    access = data["access"].tolist()
    python_gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = {
        key: NaiveEntry(list(range(WIDTH)), BLOCK_BYTES, cls, T0 - 8 * DAY, last, 0.0, 0)
        for key, cls, last in zip(keys, classes, access, strict=True)
    }
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # The keys (bytes objects, ~65 B each) are part of what the dict holds too.
    key_bytes = sum(sys.getsizeof(key) for key in keys[:1000]) / 1000 * n
    ttl = TTL.tolist()

    def expire() -> list[bytes]:
        return [
            key
            for key, entry in table.items()
            if T0 - entry.last_access > ttl[entry.traffic_class]
            and not (entry.lease_count and entry.lease_until > T0)
        ]

    needed = int(n * BLOCK_BYTES * 0.05)

    def lru() -> list[bytes]:
        chosen, total = [], 0
        for key, entry in sorted(table.items(), key=lambda item: item[1].last_access):
            if entry.lease_count and entry.lease_until > T0:
                continue
            chosen.append(key)
            total += entry.size
            if total >= needed:
                break
        return chosen

    result = {
        "entries": float(n),
        "bytes_per_block": (after - before + key_bytes) / n,
        "expire_scan_per_s": n / median_seconds(expire, runs),
        "lru_scan_per_s": n / median_seconds(lru, runs),
    }
    return result


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="write JSON to stdout")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="1000000,10000000", help="index sizes to measure")
    parser.add_argument("--naive", type=int, default=1_000_000, help="entries for the dict peer")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    largest = max(sizes)
    measured = {}
    for n in sizes:
        measured[n] = measure_index(n, args.runs, scans=(n == largest))
        python_gc.collect()  # the previous index is garbage now: free it before the next
    naive = measure_naive(args.naive, args.runs) if args.naive else None

    rows: list[tuple[str, str, str, str]] = []
    checks: list[bool] = []
    for n, result in measured.items():
        ok = result["bytes_per_block"] <= TARGET_BYTES_PER_BLOCK
        checks.append(ok)
        rows.append(
            (
                f"index memory, {n:,} entries",
                f"{result['bytes_per_block']:.1f} B/block",
                f"<= {TARGET_BYTES_PER_BLOCK:.0f}",
                verdict(ok),
            )
        )
    for n, result in measured.items():
        rows.append(
            (f"insert, batches of {BATCH:,}, to {n:,}", f"{result['insert_per_s']:,.0f}/s", "", "")
        )
    big = measured[largest]
    rows.append((f"find, 1M keys in {largest:,}", f"{big['find_per_s']:,.0f}/s", "", ""))
    for name, key in (
        ("expire scan (TTL by class)", "expire_scan_per_s"),
        ("LRU scan (5 % of bytes)", "lru_scan_per_s"),
    ):
        ok = big[key] >= TARGET_SCAN_RATE
        checks.append(ok)
        rows.append(
            (
                f"{name}, {largest:,}",
                f"{big[key]:,.0f} entries/s",
                f">= {TARGET_SCAN_RATE:,.0f}",
                verdict(ok),
            )
        )
    if naive:
        n = int(naive["entries"])
        rows.append(
            (
                f"dict of dataclass: memory, {n:,}",
                f"{naive['bytes_per_block']:.1f} B/block",
                "peer",
                "",
            )
        )
        rows.append(
            (
                f"dict of dataclass: expire scan, {n:,}",
                f"{naive['expire_scan_per_s']:,.0f} entries/s",
                "peer",
                "",
            )
        )
        rows.append(
            (
                f"dict of dataclass: LRU scan, {n:,}",
                f"{naive['lru_scan_per_s']:,.0f} entries/s",
                "peer",
                "",
            )
        )
        smallest = measured[min(sizes)]
        rows.append(
            (
                "memory ratio dict / BlockIndex",
                f"{naive['bytes_per_block'] / smallest['bytes_per_block']:.1f}x",
                "",
                "",
            )
        )
        rows.append(
            (
                "expire scan ratio BlockIndex / dict",
                f"{big['expire_scan_per_s'] / naive['expire_scan_per_s']:.0f}x",
                "",
                "",
            )
        )

    if args.json:
        json.dump(
            {
                "index": {str(n): r for n, r in measured.items()},
                "naive_dict": naive,
                "targets": {
                    "bytes_per_block_max": TARGET_BYTES_PER_BLOCK,
                    "scan_entries_per_s_min": TARGET_SCAN_RATE,
                },
                "pass": all(checks),
            },
            sys.stdout,
            indent=2,
        )
        print()
    else:
        header = ("measure", "value", "target", "result")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
        for row in [header, tuple("-" * w for w in widths), *rows]:
            print(" | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
