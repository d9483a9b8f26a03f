"""An engine's saves into a deployed block store: the puts they took and their CPU per GB.

A ``PagedWorker`` (the connector's worker side) over a CPU cache of 8 layers of 112 KiB blocks
saves what an engine's steps hand it into a block store deployed on the local Ray cluster (12
storage nodes, 10+2, fsync=batch): each step ``--requests`` requests save ``--chunk`` blocks
each (a chunked prefill; a decode step saves one block a request that crosses a block's end),
and a step starts every ``--step-ms`` (the engine's compute). The worker's put thread puts
off the engine's thread, so what queues behind a put depends on how long the put takes.

Prints the blocks saved, the puts they took, the wall time to the last put, and the CPU
seconds per GB of payload of the tier's processes and of the engine's (its put and gather
threads; its fetcher process, which only loads, is left out). It imports the kvstore of the
checkout it lives in: to compare two versions, run each checkout's copy.

    python3 benchmarks/engine_saves.py [--steps 150] [--requests 4] [--chunk 4] [--step-ms 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.blockstore_cpu import CpuGroups, client_cpu  # noqa: E402
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig  # noqa: E402
from kvstore.engine.plan import PagedSave, StepPlan  # noqa: E402
from kvstore.engine.worker import PagedWorker  # noqa: E402
from kvstore.geometry import GeometryConfig  # noqa: E402
from kvstore.runtime.cluster import LocalClusterConfig, connect  # noqa: E402
from kvstore.runtime.deploy import deploy_blockstore  # noqa: E402
from kvstore.runtime.tiers import ClusterReaderFactory, cluster_tier  # noqa: E402
from kvstore.tier.records import PutAnswer  # noqa: E402

LAYERS, ROW_SHAPE = 8, (2, 128, 28)  # fp16: 14,336 bytes a layer, 112 KiB a block
WARMUP_STEPS = 20


class CountedWriter:
    """The tier as the worker's writer, counting the puts it is asked for."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.puts = 0

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        self.puts += 1
        return self.tier.put_blocks(keys, payloads, traffic_class)

    def put_swa_state(self, *args, **kwargs) -> str:
        return self.tier.put_swa_state(*args, **kwargs)


def run_steps(worker: PagedWorker, rng: np.random.Generator, args, steps: int) -> None:
    """``steps`` engine steps, one every ``--step-ms``, each saving fresh blocks."""
    started = time.monotonic()
    for step in range(steps):
        time.sleep(max(0.0, started + step * args.step_ms / 1e3 - time.monotonic()))
        saves = [
            PagedSave(
                f"r{step}-{r}",
                tuple(range(r * args.chunk, (r + 1) * args.chunk)),
                tuple(rng.bytes(32) for _ in range(args.chunk)),
            )
            for r in range(args.requests)
        ]
        worker.start(StepPlan(saves=saves))
        for layer in range(LAYERS):
            worker.save_layer(layer)
        worker.finish_step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="engine steps that save")
    parser.add_argument("--requests", type=int, default=4, help="requests saving each step")
    parser.add_argument("--chunk", type=int, default=4, help="blocks each of them saves a step")
    parser.add_argument("--step-ms", type=float, default=10.0, help="one step's compute")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    for name in ("steps", "requests", "chunk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.step_ms < 0:
        parser.error("--step-ms must not be negative")

    per_step = args.requests * args.chunk
    geometry = GeometryConfig()
    root = tempfile.mkdtemp(prefix="engine-saves-", dir="/tmp")
    config = BlockStoreConfig(
        data_root=root, deployment="enginesaves", node=StorageNodeConfig(fsync="batch")
    )
    connect(None, config=LocalClusterConfig(head_object_store_mib=1024))
    handles = deploy_blockstore(config, start_repair=False)
    worker = None
    try:
        cache = [torch.randn((per_step, *ROW_SHAPE)).half() for _ in range(LAYERS)]
        block_bytes = sum(int(t[0].numel()) * t.element_size() for t in cache)
        tier = cluster_tier(handles, None, geometry, block_bytes=block_bytes)
        writer = CountedWriter(tier)
        address = ray.get_runtime_context().gcs_address  # the fetcher joins it (no loads here)
        factory = ClusterReaderFactory(address, config, geometry)
        worker = PagedWorker(cache, factory, writer, staging_bytes=1 << 20)
        # The fetcher process only loads (none here); its start-up is not a save's cost.
        groups = CpuGroups(handles, exclude={worker.fetcher.pid})
        rng = np.random.default_rng(11)
        run_steps(worker, rng, args, WARMUP_STEPS)  # connections made, the fetcher up
        if not worker.flush(600):
            raise SystemExit("the warm-up saves did not finish within 600 s")
        warm = worker.stats.blocks_saved, writer.puts
        before, own, started = groups.sample(), client_cpu(), time.monotonic()
        run_steps(worker, rng, args, args.steps)
        if not worker.flush(600):
            raise SystemExit("the saves did not finish within 600 s")
        wall = time.monotonic() - started
        after, engine_cpu = groups.sample(), client_cpu() - own
        tier_cpu = {
            role: sum(v - before[role][p] for p, v in values.items() if p in before[role])
            for role, values in after.items()
        }
        stats = worker.stats
        saved, puts = stats.blocks_saved - warm[0], writer.puts - warm[1]
        gb = saved * block_bytes / 1e9
        figures = {
            "blocks_saved": saved,
            "saves_failed": stats.saves_failed,
            "saves_dropped": stats.saves_dropped,
            "puts": puts,
            "blocks_a_put": saved / max(1, puts),
            "wall_s": wall,
            "gb_per_s": gb / wall,
            "cpu_s_per_gb": {
                **{role: cpu / gb for role, cpu in tier_cpu.items()},
                "engine": engine_cpu / gb,
                "total": (sum(tier_cpu.values()) + engine_cpu) / gb,
            },
        }
    finally:
        if worker is not None:
            worker.close()
        handles.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    cpu = figures["cpu_s_per_gb"]
    print(
        f"{args.steps} steps every {args.step_ms:g} ms, {args.requests} requests x "
        f"{args.chunk} blocks of {block_bytes} bytes a step\n"
    )
    print(
        "| blocks saved | puts | blocks a put | wall s | GB/s | CPU-s/GB: nodes | meta | "
        "other Ray | engine | total |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {figures['blocks_saved']} | {figures['puts']} | {figures['blocks_a_put']:.1f} | "
        f"{wall:.2f} | {figures['gb_per_s']:.3f} | {cpu['nodes']:.2f} | {cpu['meta']:.2f} | "
        f"{cpu['ray']:.2f} | {cpu['engine']:.2f} | {cpu['total']:.2f} |"
    )
    if figures["saves_failed"] or figures["saves_dropped"]:
        print(f"saves failed {figures['saves_failed']}, dropped {figures['saves_dropped']}")
    if args.json:
        print(json.dumps(figures))
    return 0 if figures["saves_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
