"""`kvstore demo`: the whole system on the embedded cluster, under a day of traffic and failures.

Starts kvstore (12 storage nodes, meta shards, repair, SWA tier, GC, gRPC gateway), replays a
synthetic day through the gRPC API with several simulated engines working in parallel, kills two
storage nodes half-way through and keeps serving, then prints a summary and writes
``demo-report/`` (``summary.json`` and PNG plots). Exit status 1 if any read returned wrong bytes.
"""

from __future__ import annotations

import hashlib
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvstore.api.client import KVStoreClient
from kvstore.demo.engine import RequestOutcome, SimEngine
from kvstore.demo.report import summarize, write_report
from kvstore.demo.workload import Request, WorkloadConfig, synthetic_day
from kvstore.geometry import GeometryConfig


@dataclass(frozen=True)
class DemoConfig:
    report_dir: Path = Path("demo-report")
    data_dir: Path | None = None  # None: a temporary directory, removed afterwards
    engines: int = 4
    #: 12 hold a stripe; the 2 spares give repair somewhere to rebuild the killed nodes' shards.
    storage_nodes: int = 14
    reroute_fraction: float = 0.2  # share of a session's requests that land on another engine
    kill_nodes: tuple[int, ...] = (3, 8)
    workload: WorkloadConfig = WorkloadConfig()
    progress: bool = True


def _engine_of(request: Request, engines: int, reroute_fraction: float) -> int:
    """Sticky routing with some re-routing, as a load balancer does (deterministic)."""
    digest = hashlib.blake2b(f"{request.session}:{request.at_s}".encode(), digest_size=8).digest()
    home = int.from_bytes(
        hashlib.blake2b(request.session.encode(), digest_size=8).digest(), "little"
    )
    if int.from_bytes(digest, "little") / 2**64 < reroute_fraction:
        return int.from_bytes(digest[:4], "little") % engines
    return home % engines


def drive(
    requests: list[Request],
    engines: list[SimEngine],
    reroute_fraction: float,
    halfway: Callable[[], None],
    progress: bool,
) -> list[RequestOutcome]:
    """Serve every request on its engine (engines in parallel, each in order); call ``halfway``
    once when half the requests are done."""
    queues: list[queue.Queue[tuple[int, Request] | None]] = [queue.Queue() for _ in engines]
    for index, request in enumerate(requests):
        queues[_engine_of(request, len(engines), reroute_fraction)].put((index, request))
    outcomes: list[RequestOutcome] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    half = len(requests) // 2
    failed_over = threading.Event()
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

    def work(engine: SimEngine, inbox: queue.Queue[tuple[int, Request] | None]) -> None:
        while True:
            item = inbox.get()
            if item is None:
                return
            index, request = item
            try:
                outcome = engine.serve(index, request, after_failure=failed_over.is_set())
            except BaseException as error:  # reported below: a demo must not hide an error
                failures.append(error)
                return
            with lock:
                outcomes.append(outcome)
                done = len(outcomes)
            bar.update(1)
            if done == half and not failed_over.is_set():
                halfway()
                failed_over.set()

    threads = [
        threading.Thread(target=work, args=(engine, inbox), name=f"engine-{i}")
        for i, (engine, inbox) in enumerate(zip(engines, queues, strict=True))
    ]
    for inbox in queues:
        inbox.put(None)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    if failures:
        raise failures[0]
    return sorted(outcomes, key=lambda outcome: outcome.index)


def run_demo(config: DemoConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    from kvstore.runtime.service import embedded_service

    geometry = GeometryConfig.default()
    requests = synthetic_day(config.workload)
    say(
        f"workload: {len(requests)} requests over a simulated day "
        f"({sum(r.traffic_class == 'agent' for r in requests)} agent, "
        f"{sum(r.traffic_class == 'chatbot' for r in requests)} chatbot), "
        f"{sum(r.prompt_len for r in requests):,} prompt tokens"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as scratch:
        data_dir = config.data_dir or Path(scratch)
        say(
            f"starting kvstore: embedded Ray, {config.storage_nodes} storage nodes under "
            f"{data_dir} ..."
        )
        with embedded_service(
            data_dir, deployment="demo", fsync="never", storage_nodes=config.storage_nodes
        ) as running:
            say(f"serving on {running.address} (up in {time.perf_counter() - started:.1f} s)")
            killed: list[float] = []

            def kill_two() -> None:
                for node in config.kill_nodes:
                    running.service.blocks.kill_node(node, restart=False)
                killed.append(time.perf_counter())
                tqdm.write(f"!! killed storage nodes {list(config.kill_nodes)}; still serving")

            clients = [
                KVStoreClient(running.address, timeout_s=120.0) for _ in range(config.engines)
            ]
            engines = [
                SimEngine(
                    f"engine-{i}",
                    clients[i],
                    running.tier.model_fingerprint,
                    geometry.block_bytes,
                    geometry.state_size_to_disk,
                )
                for i in range(config.engines)
            ]
            served = time.perf_counter()
            outcomes = drive(requests, engines, config.reroute_fraction, kill_two, config.progress)
            traffic_s = time.perf_counter() - served
            stats = clients[0].stats()
            for client in clients:
                client.close()
    summary = summarize(
        outcomes,
        {
            "traffic_seconds": round(traffic_s, 1),
            "total_seconds": round(time.perf_counter() - started, 1),
            "storage_nodes": stats.storage_nodes,
            "killed_storage_nodes": list(config.kill_nodes),
            "live_storage_nodes_at_end": stats.live_storage_nodes,
            "gb_stored": round(stats.block_bytes_stored / 1e9, 3),
            "swa_gb_stored": round(stats.swa_bytes_stored / 1e9, 3),
            "degraded_reads": stats.degraded_reads,
            "repairs": stats.repairs_done,
            "miss_reasons": {name: c.get("miss_reasons", {}) for name, c in stats.classes.items()},
        },
    )
    files = write_report(config.report_dir, summary, outcomes)
    summary["report_files"] = [str(path) for path in files]
    return summary
