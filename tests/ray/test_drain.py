"""Planned drain on a real deployment (13 storage nodes, so one can go) behind a real gateway on
the session Ray cluster: ``drain_node`` moves every shard off a node with each stripe whole
throughout, every block still reads bit-exact, new writes avoid the node, ``undrain`` puts it
back; the same through `kvstore drain` / `undrain`; and `kvstore status --watch` follows the
gateway's figures."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from kvstore.api.server import ServerOptions
from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.placement import meta_shard_of
from kvstore.cli import main
from kvstore.runtime import drain
from kvstore.runtime.service import RunningService, embedded_service

DEPLOYMENT = "drain-test"
NODES = 13
WIDTH = 12
TOKEN = "drain-token-0123456789"
#: A drain is done only after a rescan 2 x call_timeout_s after it began: keep that short.
CALL_TIMEOUT_S = 3.0
DRAIN_TIMEOUT_S = 240.0


class Deployment:
    def __init__(self, running: RunningService, token_file: Path) -> None:
        self.running = running
        self.token_file = token_file
        self.handles = running.service.blocks
        self.client: BlockStoreClient = self.handles.client()
        self.block_bytes = running.tier.block_bytes
        self.stored: dict[bytes, bytes] = {}
        self._seed = 0

    def put(self, count: int) -> list[bytes]:
        keys = [os.urandom(32) for _ in range(count)]
        rng = np.random.default_rng(self._seed)
        self._seed += 1
        payloads = [rng.integers(0, 256, self.block_bytes, dtype=np.uint8) for _ in keys]
        result = self.client.put_blocks(keys, payloads, "default")
        assert sorted(result.stored) == sorted(keys), result
        self.stored.update({k: p.tobytes() for k, p in zip(keys, payloads, strict=True)})
        return keys

    def placements(self, keys: list[bytes]) -> dict[bytes, list[int]]:
        """Each key's placement as its meta shard answers ``locate`` (-1: a lost shard)."""
        owners = meta_shard_of(keys, len(self.handles.metas))
        out: dict[bytes, list[int]] = {}
        for shard, meta in enumerate(self.handles.metas):
            mine = [k for k, owner in zip(keys, owners, strict=True) if owner == shard]
            if not mine:
                continue
            reply = ray.get(meta.locate.remote(mine), timeout=30)
            assert reply.found.all(), "a committed block is not in its meta shard"
            for key, row in zip(mine, reply.placements.tolist(), strict=True):
                out[key] = [int(node) for node in row]
        return out

    def assert_all_exact(self) -> None:
        keys = list(self.stored)
        got = self.client.get_blocks(keys)
        wrong = [
            k for k, g in zip(keys, got, strict=True) if g is None or g.tobytes() != self.stored[k]
        ]
        assert wrong == [], f"{len(wrong)} of {len(keys)} blocks not served bit-exact"


@pytest.fixture(scope="module")
def deployment(ray_cluster, tmp_path_factory) -> Iterator[Deployment]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("drain")
    token_file = root / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    with embedded_service(
        root / "data",
        cluster=ray_cluster,
        deployment=DEPLOYMENT,
        storage_nodes=NODES,
        meta_shards=2,
        call_timeout_s=CALL_TIMEOUT_S,
        health_interval_s=0.3,
        node_retry_s=1.0,
        fsync="never",
        run_gc=False,
        options=ServerOptions(token=TOKEN),
    ) as running:
        yield Deployment(running, token_file)


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def whole_without(placements: dict[bytes, list[int]], node: int) -> list[bytes]:
    """The keys whose stripe is not 12 shards on 12 distinct nodes other than ``node``."""
    return [
        key
        for key, row in placements.items()
        if node in row or min(row) < 0 or len(set(row)) != WIDTH
    ]


def test_drain_moves_every_shard_off_the_node_and_undrain_puts_it_back(
    deployment: Deployment,
) -> None:
    keys = deployment.put(32)
    node = 5
    before = deployment.placements(keys)
    assert sum(node in row for row in before.values()) > 0  # the node holds shards to move

    live = drain.attach("auto", DEPLOYMENT)
    assert live.node_ids == tuple(range(NODES))
    seen: list[dict[str, Any]] = []
    status = drain.drain_node(
        live.actor, node, timeout_s=DRAIN_TIMEOUT_S, on_progress=lambda s: seen.append(dict(s))
    )
    assert status["done"] and status["stripes_left"] == 0, status
    assert seen and seen[-1]["done"]
    assert drain.drain_status(live.actor)[node]["done"]

    after = deployment.placements(keys)
    assert whole_without(after, node) == []
    deployment.assert_all_exact()

    # While draining (done, not undrained) the node takes no new writes: new blocks end up
    # whole on the other 12 (a first put may leave its shard out; repair restores it).
    fresh = deployment.put(8)
    _wait_for(
        lambda: whole_without(deployment.placements(fresh), node) == [],
        60,
        "new blocks whole on the nodes in service",
    )
    deployment.assert_all_exact()

    back = drain.undrain_node(live.actor, node)
    assert back["node"] == node and back["draining"] is False
    assert node not in drain.drain_status(live.actor)

    def writes_reach_it_again() -> bool:
        return any(node in row for row in deployment.placements(deployment.put(4)).values())

    _wait_for(writes_reach_it_again, 60, f"new writes on node {node} after undrain")
    deployment.assert_all_exact()


def test_kvstore_drain_and_undrain_commands(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = deployment.put(16)
    node = 7
    common = ["--deployment", DEPLOYMENT]
    assert main(["drain", str(node), *common, "--json", "--timeout", str(DRAIN_TIMEOUT_S)]) == 0
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    assert status["node"] == node and status["done"], captured
    assert whole_without(deployment.placements(keys), node) == []
    # Again: already drained, it answers at once.
    assert main(["drain", str(node), *common, "--no-progress"]) == 0
    assert f"node {node} drained" in capsys.readouterr().out

    assert main(["undrain", str(node), *common]) == 0
    assert f"node {node} back in service" in capsys.readouterr().out
    deployment.assert_all_exact()

    assert main(["drain", str(NODES), *common]) == 2
    assert f"no storage node {NODES} in deployment {DEPLOYMENT!r}" in capsys.readouterr().err
    assert main(["drain", "1", "--deployment", "no-such-deployment"]) == 1
    err = capsys.readouterr().err
    assert "no deployment 'no-such-deployment'" in err and DEPLOYMENT in err


def test_status_watch_follows_the_gateway(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "status",
        "--server",
        deployment.running.address,
        "--token-file",
        str(deployment.token_file),
        "--watch",
        "--interval",
        "0.2",
        "--count",
        "2",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert f"{NODES}/{NODES} storage nodes live" in line and "SERVING" in line
        assert "repair" in line and "repair n/a" not in line  # the repair actor's figures

    assert main([*argv, "--json"]) == 0
    updates = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(updates) == 2 and all(u["healthy"] for u in updates)
    assert all(isinstance(u["repair"], dict) and "stripes_left" in u["repair"] for u in updates)
