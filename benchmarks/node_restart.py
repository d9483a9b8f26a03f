"""One storage node holding many shards: how many files its data dir has, and how long it takes
to restart and serve again.

What runs: a single ``kvstore.blockstore.node.StorageNode`` (the plain object an actor wraps; no
Ray) on a fresh data dir under ``--data-root``, filled with ``--shards`` real codec shards: for
each key a ``--block-bytes`` block is Reed-Solomon encoded 10+2 (``kvstore.ec.codec.Codec``) and
one of its 12 shards (position key mod 12) is stored, ``--batch`` shards per ``put`` followed by
a ``commit`` of the batch (what a client does). Then:

- files: every regular file under the data dir, counted recursively, and their bytes;
- restart to serving: ``close()`` the node, construct a new ``StorageNode`` on the same dir,
  and ``get`` a random sample of ``--sample`` keys; the time from the constructor call until
  that first get returned, every sampled shard there and bit-exact (the bytes written).
  Taken ``--restarts`` times warm (the files in the page cache, as after a process crash), and
  as many times cold (this run's files evicted from the page cache first, with
  ``posix_fadvise(DONTNEED)`` after an ``fsync`` of each: about what a machine reboot leaves;
  directory metadata may still be cached). The median is reported.

Target (issue 17): a node holding 100,000 shards has at most a few hundred files (here: <= 500)
in its data dir and restarts and serves again in <= 5 s. Exit status 1 if one is missed.

    python3 benchmarks/node_restart.py [--shards 100000] [--block-bytes 4096] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.blockstore import node as node_module  # noqa: E402
from kvstore.blockstore.config import StorageNodeConfig  # noqa: E402
from kvstore.blockstore.node import StorageNode  # noqa: E402
from kvstore.ec.codec import Codec  # noqa: E402

NODE_ID = 0
MAX_FILES = 500
MAX_RESTART_S = 5.0


def key_of(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


class Shards:
    """The shard stored for key ``i``: one of the 12 shards of a block whose first 8 bytes are
    ``i`` (so every block differs) and whose other bytes are random."""

    def __init__(self, block_bytes: int, seed: int = 7) -> None:
        if block_bytes < 8:
            raise ValueError("--block-bytes must be >= 8")
        self.codec = Codec(10, 2)
        self.base = np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)

    def block(self, i: int) -> np.ndarray:
        payload = self.base.copy()
        payload[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        return payload

    def shard(self, i: int, payload: np.ndarray) -> np.ndarray:
        return self.codec.encode(payload, key_of(i))[i % self.codec.total].copy()


def put_api() -> tuple[bool, Any]:
    """(True, payload_hash function) for the older ``put(token, keys, shards, payload_hashes,
    class_ids, created)``; (False, None) for ``put(token, keys, shards, class_ids, created)``."""
    if "payload_hashes" not in inspect.signature(StorageNode.put).parameters:
        return False, None
    from kvstore.blockstore.shardfile import payload_hash  # the older tree only

    return True, payload_hash


def splitter() -> Any:
    """``split_shards`` (one codec shard per key), or the older ``split_files`` (a node header
    before each shard)."""
    split = getattr(node_module, "split_shards", None)
    return split if split is not None else node_module.split_files


def fill(node: StorageNode, shards: Shards, args: argparse.Namespace) -> tuple[int, float]:
    """Put + commit ``args.shards`` shards in batches; returns (shards committed, seconds).
    Stops early (and says so) after ``--fill-seconds``."""
    with_hashes, payload_hash = put_api()
    start = time.perf_counter()
    committed = 0
    for first in range(0, args.shards, args.batch):
        ids = range(first, min(args.shards, first + args.batch))
        keys = [key_of(i) for i in ids]
        payloads = [shards.block(i) for i in ids]
        pieces = [shards.shard(i, p) for i, p in zip(ids, payloads, strict=True)]
        token = secrets.randbits(63)
        now = time.time()
        extra: list[Any] = [[0] * len(keys), [now] * len(keys)]
        if with_hashes:
            extra.insert(0, [payload_hash(p) for p in payloads])
        stored = node.put(token, keys, pieces, *extra)
        if not all(stored):
            raise RuntimeError(f"put refused {stored.count(False)} of {len(keys)} shards")
        done = node.commit(token, keys)
        if not all(done):
            raise RuntimeError(f"commit failed for {done.count(False)} of {len(keys)} shards")
        committed += len(keys)
        if time.perf_counter() - start > args.fill_seconds:
            print(
                f"fill stopped after {args.fill_seconds:.0f} s at {committed} shards",
                file=sys.stderr,
            )
            break
    return committed, time.perf_counter() - start


def files_in(root: str) -> tuple[int, int, int, int]:
    """(regular files, directories, bytes, allocated bytes) under ``root``, recursively."""
    files = dirs = size = blocks = 0
    for directory, dirnames, filenames in os.walk(root):
        dirs += len(dirnames)
        for name in filenames:
            status = os.lstat(os.path.join(directory, name))
            files += 1
            size += status.st_size
            blocks += status.st_blocks * 512
    return files, dirs, size, blocks


def evict(root: str) -> None:
    """Drop this data dir's file pages from the page cache (written back first)."""
    for directory, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def serve(
    data_dir: str, config: StorageNodeConfig, sample: dict[bytes, np.ndarray]
) -> tuple[StorageNode, float, float]:
    """Open a node on ``data_dir`` and read ``sample`` back; (node, open s, open-to-served s).
    Raises if a sampled shard is missing or differs from what was written."""
    split = splitter()
    keys = list(sample)
    start = time.perf_counter()
    node = StorageNode(NODE_ID, data_dir, config)
    opened = time.perf_counter()
    pieces = split(node.get(keys))
    served = time.perf_counter()
    for key, piece in zip(keys, pieces, strict=True):
        want = sample[key]
        if piece is None:
            raise RuntimeError(f"shard {key.hex()[:16]} missing after restart")
        # The older node returned its own header before the codec shard: compare the shard.
        got = piece if piece.size == want.size else piece[-want.size :]
        if piece.size < want.size or not np.array_equal(got, want):
            raise RuntimeError(f"shard {key.hex()[:16]} differs after restart")
    return node, opened - start, served - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = StorageNodeConfig(fsync=args.fsync)
    parent = tempfile.mkdtemp(prefix="kvstore-bench-restart-", dir=args.data_root)
    data_dir = os.path.join(parent, f"node-{NODE_ID}")
    try:
        shards = Shards(args.block_bytes)
        node = StorageNode(NODE_ID, data_dir, config)
        committed, fill_s = fill(node, shards, args)
        rng = np.random.default_rng(11)
        chosen = rng.choice(committed, size=min(args.sample, committed), replace=False)
        sample = {key_of(int(i)): shards.shard(int(i), shards.block(int(i))) for i in chosen}
        stats_before = {k: v for k, v in node.stats().items() if isinstance(v, int | float)}
        node.close()
        files, dirs, size, allocated = files_in(data_dir)
        runs: dict[str, list[tuple[float, float]]] = {"warm": [], "cold": []}
        for mode in ("warm", "cold"):
            for _ in range(args.restarts):
                if mode == "cold":
                    evict(data_dir)
                node, open_s, serve_s = serve(data_dir, config, sample)
                node.close()
                runs[mode].append((open_s, serve_s))
        node, _, _ = serve(data_dir, config, sample)
        held = node.stats().get("shards")
        node.close()
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    restarts = {
        mode: {
            "open_s": statistics.median(o for o, _ in values),
            "serving_s": statistics.median(s for _, s in values),
            "max_serving_s": max(s for _, s in values),
            "runs": len(values),
        }
        for mode, values in runs.items()
    }
    worst = max(r["serving_s"] for r in restarts.values())
    return {
        "config": {
            "shards_asked": args.shards,
            "block_bytes": args.block_bytes,
            "code": "10+2",
            "batch": args.batch,
            "sample": len(sample),
            "fsync": args.fsync,
            "put_api": "with payload_hashes" if put_api()[0] else "put(token, keys, shards, ...)",
            "cpus": os.cpu_count(),
        },
        "shards": committed,
        "shards_held_after_restart": held,
        "shard_bytes": int(sum(a.size for a in sample.values()) / max(1, len(sample))),
        "fill_s": fill_s,
        "fill_shards_per_s": committed / fill_s if fill_s else None,
        "files": files,
        "dirs": dirs,
        "bytes": size,
        "allocated_bytes": allocated,
        "node_stats": stats_before,
        "restart": restarts,
        "targets": {
            "files": {"value": files, "max": MAX_FILES, "met": files <= MAX_FILES},
            "restart_to_serving_s": {
                "value": worst,
                "max": MAX_RESTART_S,
                "met": worst <= MAX_RESTART_S and held == committed,
            },
        },
    }


def table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    lines = [
        f"One StorageNode (no Ray), {r['shards']:,} shards of {cfg['block_bytes']:,} B blocks "
        f"(10+2, {r['shard_bytes']:,} B per shard), put+commit in batches of {cfg['batch']}, "
        f"fsync={cfg['fsync']}; filled in {r['fill_s']:.1f} s "
        f"({r['fill_shards_per_s']:,.0f} shards/s); serving = first get of {cfg['sample']:,} "
        f"sampled keys, bit-exact; median of {r['restart']['warm']['runs']} restarts",
        "",
        "| shards | files in dir | bytes | page cache | open s | restart-to-serving s "
        "| target | met? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, entry in r["restart"].items():
        met = entry["serving_s"] <= MAX_RESTART_S
        lines.append(
            f"| {r['shards']:,} | {r['files']:,} | {r['bytes']:,} | {mode} "
            f"| {entry['open_s']:.3f} | {entry['serving_s']:.3f} (max {entry['max_serving_s']:.3f})"
            f" | <= {MAX_RESTART_S:.0f} s | {'yes' if met else 'NO'} |"
        )
    held = r["shards_held_after_restart"]
    files = r["targets"]["files"]
    lines += [
        "",
        f"files in the data dir (recursive): {r['files']:,} in {r['dirs']} dirs, "
        f"{r['allocated_bytes']:,} B allocated; target <= {MAX_FILES} (a few hundred): "
        f"{'yes' if files['met'] else 'NO'}",
        f"shards held after restart: {held:,} of {r['shards']:,}",
    ]
    missed = [name for name, t in r["targets"].items() if not t["met"]]
    lines.append("all targets met" if not missed else f"targets missed: {', '.join(missed)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shards", type=int, default=100_000, help="shards to store")
    parser.add_argument("--block-bytes", type=int, default=4096, help="bytes of each block")
    parser.add_argument("--batch", type=int, default=1000, help="shards per put + commit")
    parser.add_argument("--sample", type=int, default=1000, help="keys read back per restart")
    parser.add_argument("--restarts", type=int, default=3, help="restarts per mode (median)")
    parser.add_argument(
        "--fill-seconds", type=float, default=300.0, help="stop filling after this long"
    )
    parser.add_argument("--fsync", choices=("always", "batch", "never"), default="batch")
    parser.add_argument("--data-root", default=None, help="parent of the temporary data dir")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.shards < 1 or args.batch < 1 or args.sample < 1 or args.restarts < 1:
        parser.error("--shards, --batch, --sample and --restarts must be >= 1")
    results = run(args)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(results))
    return 0 if all(t["met"] for t in results["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
