"""Scenario 20, ``head-loss``: the Ray head host is lost; what survives, and how it is restored.

Run from outside the testbed (a driver cannot outlive the GCS it is connected to): ``kvstore up
--address`` on the head host serves the gateway and the control plane, storage nodes run on the
storage hosts. A probe on the client host puts blocks through the gateway and reads them back.
Then every process of the head host is killed: Ray's GCS, the gateway, the meta shards, the
repair loop, the SWA entrypoints.

What the scenario shows, and docs/operations/testbed.md says:
- the client sees a clean gRPC error (UNAVAILABLE) at once: no wrong bytes, no hang;
- the storage hosts keep their data directories; their raylets, with no GCS to talk to, give
  up after about a minute ("GCS has been unavailable for more than 60 seconds ... The program
  will terminate"), taking the storage-node processes with them (Ray's log monitor and agents
  linger until the host's Ray is restarted): Ray without GCS fault tolerance does not survive
  its head, so the tier is down until the head is back;
- the restore is the cold start an operator runs: Ray's head started again, every other host's
  Ray started again (joining the new GCS), ``kvstore up --address`` again on the same data
  directories. The meta shards rebuild their index from the storage nodes' logs, and every
  block committed before the loss reads back bit-exact.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvstore.chaos.table import ScenarioResult
from kvstore.testbed.testbed import CLIENT, HEAD, Gateway, Testbed

PROBE_BLOCKS = 48
#: How long the storage hosts' raylets and storage nodes may take to notice the GCS is gone.
EXIT_TIMEOUT_S = 150.0
#: What must be gone from a storage host once Ray gave up (process names in argv[0]).
_MUST_EXIT = ("raylet", "ray::StorageNodeActor")


def _probe(bed: Testbed, action: str, gateway: Gateway, *extra: str) -> dict[str, Any]:
    keys = bed.run_dir / "head-loss-keys.json"
    argv = [sys.executable, "-m", "kvstore.testbed.probe", action, "--keys", str(keys)]
    done = bed.run(CLIENT, [*argv, *gateway.flags(), *extra], timeout_s=300)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            answer: dict[str, Any] = json.loads(line)
            return answer
    return {"error": f"probe exited {done.returncode}: {(done.stdout + done.stderr)[-800:]}"}


def _running(bed: Testbed, hosts: list[str]) -> list[str]:
    """``host: name`` for each raylet or storage node still running on ``hosts``."""
    found = []
    for host in hosts:
        for pid in bed.network.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    first = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            found += [f"{host}: {name}" for name in _MUST_EXIT if name in first]
    return found


def head_loss(bed: Testbed, progress: Callable[[str], None]) -> ScenarioResult:
    result = ScenarioResult("head-loss", "the Ray head host lost, then restored")
    started = time.monotonic()
    gateway = bed.kvstore_up("--no-gc")
    put = _probe(bed, "put", gateway, "--count", str(PROBE_BLOCKS))
    before = _probe(bed, "check", gateway)
    result.operations += PROBE_BLOCKS + int(before.get("blocks", 0))
    result.details.update(put=put, before=before)
    if not result.require(put.get("stored") == PROBE_BLOCKS, f"the healthy put: {put}"):
        return result
    result.require(before.get("ok") == PROBE_BLOCKS, f"the healthy read: {before}")

    progress("head host killed: GCS, gateway, meta shards, repair, SWA entrypoints")
    lost_at = time.monotonic()
    bed.network.kill_host(HEAD)
    result.faults = 1
    during = _probe(bed, "check", gateway, "--timeout", "5")
    result.details["client_while_head_down"] = during
    result.require("error" in during, f"a read with the head down did not fail: {during}")
    result.wrong_bytes += int(during.get("wrong", 0))

    storage = bed.config.storage_names()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while _running(bed, storage) and time.monotonic() < deadline:
        time.sleep(1.0)
    exited = time.monotonic() - lost_at
    left = _running(bed, storage)
    segments = sorted((bed.run_dir / "kvstore-data").glob("node-*/segments/*.seg"))
    result.details["storage_hosts"] = {
        "raylets_and_storage_nodes_exited_after_s": round(exited, 1) if not left else None,
        "still_running_on": left,
        "segment_files_kept": len(segments),
    }
    result.detect_s = exited
    result.require(bool(segments), "the storage nodes' segment files are gone")
    result.require(not left, f"still running {EXIT_TIMEOUT_S:.0f} s after: {left[:4]}")

    progress("restore: Ray head again, every host rejoins, kvstore up on the same data dirs")
    restore_at = time.monotonic()
    bed.tiers.clear()  # its process died with the head host
    bed.ray.restart_all()
    gateway = bed.kvstore_up("--no-gc")
    after = _probe(bed, "check", gateway)
    result.repair_s = time.monotonic() - restore_at
    result.details["after_restore"] = after
    result.operations += int(after.get("blocks", 0))
    result.reads_ok += int(after.get("ok", 0))
    result.wrong_bytes += int(after.get("wrong", 0))
    result.blocks_lost = int(after.get("misses", 0))
    result.require("error" not in after, f"the restored tier did not answer: {after}")
    result.seconds = time.monotonic() - started
    return result
