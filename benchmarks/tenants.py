"""Two tenants on one tier: does bob's abuse change what alice's engines get?

    python3 benchmarks/tenants.py                 # ~1 min: quiet phase, then bob abuses
    python3 benchmarks/tenants.py --seconds 20 --json

Starts `kvstore up` (its own process) with a tokens file of two tenants. alice caches 40 prompts
of 8 blocks, then her 4 engines loop (bounded in time and count): QueryHit with a lease,
GetBlocks of the hit with that lease, bytes checked. Phase 1: alice alone. Phase 2, the same
while bob, in parallel, does everything issue 15 found an attacker could:
- hoards leases: QueryHits that take a lease and never give it back, as fast as he can;
- repeats one key 1,000 times in a QueryHit (the old way to pin a block at 65,535 leases);
- opens 40 GetBlocks streams of 300 blocks (34 MB each) and never reads them;
- sends 1M-token QueryHits (hashing them used to stall the gateway's event loop);
- queries and reads alice's prompts by their public keys (probing, reading, poisoning).

The table compares alice's figures in the two phases — hit rate (blocks hit / blocks asked),
wrong bytes, errors, QueryHit and GetBlocks p50/p99 — and shows what bob's calls were answered.
The target (issue 15): alice's hit rate and errors are the same with bob abusing; her latency
is shown (two shared cores: bob's load costs CPU that alice's engines share). The gateway
shares this machine with the storage nodes and reads their shards through the local
short-circuit, so GetBlocks latency is lower than across machines; the headline (hit rate,
isolation) is the same either way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/grpc.py is named like the grpc package: drop this folder from the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from benchmarks.peers import kvstore_up  # noqa: E402
from kvstore.api.client import KVStoreClient  # noqa: E402
from kvstore.api.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc  # noqa: E402
from kvstore.keys import block_keys  # noqa: E402
from kvstore.tier.records import HitRequest  # noqa: E402

ALICE, BOB = "alice-benchmark-token-0001", "bob-benchmark-token-000001"
PROMPTS, BLOCKS, ENGINES = 40, 8, 4
MAX_STEPS = 20_000  # per engine per phase: every loop is bounded in count and in time


def _tokens_file(path: Path) -> Path:
    path.write_text(f'[tenants.alice]\ntokens = ["{ALICE}"]\n\n[tenants.bob]\ntokens = ["{BOB}"]\n')
    os.chmod(path, 0o600)
    return path


def _payload(key: bytes, size: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


class Engines:
    """alice's engines: QueryHit + GetBlocks with the lease, bytes checked."""

    def __init__(self, address: str, prompts: list[np.ndarray], size: int) -> None:
        self._address = address
        self._prompts = prompts
        self._size = size

    def run(self, seconds: float) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "asked": 0,
            "hit": 0,
            "wrong_bytes": 0,
            "errors": Counter(),
            "query_ms": [],
            "read_ms": [],
        }
        lock = threading.Lock()
        deadline = time.monotonic() + seconds

        def engine(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with KVStoreClient(self._address, token=ALICE, timeout_s=30) as client:
                for _ in range(MAX_STEPS):
                    if time.monotonic() > deadline:
                        return
                    tokens = self._prompts[int(rng.integers(len(self._prompts)))]
                    try:
                        started = time.perf_counter()
                        answer = client.query_hit(HitRequest(token_ids=tokens))
                        queried = time.perf_counter()
                        keys = list(answer.hit_block_keys)
                        reads = client.get_blocks(keys, answer.lease_id) if keys else []
                        done = time.perf_counter()
                    except grpc.RpcError as error:
                        with lock:
                            figures["errors"][error.code().name] += 1
                        continue
                    wrong = sum(r.payload != _payload(r.key, self._size) for r in reads)
                    with lock:
                        figures["asked"] += BLOCKS
                        figures["hit"] += answer.plan.block_hit_tokens // 128
                        figures["wrong_bytes"] += wrong
                        figures["query_ms"].append((queried - started) * 1e3)
                        if keys:
                            figures["read_ms"].append((done - queried) * 1e3)

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(ENGINES)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return figures


class Bob:
    """Every abuse issue 15 found, in parallel, bounded in time."""

    def __init__(self, address: str, alice_prompts: list[np.ndarray], fingerprint: bytes) -> None:
        self._address = address
        self._alice = alice_prompts
        self._fingerprint = fingerprint
        self.answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: list[Any] = []

    def _count(self, what: str, call: Any) -> Any:
        try:
            result = call()
            code = "OK"
        except grpc.RpcError as error:
            result, code = None, error.code().name
        with self._lock:
            self.answers[f"{what}: {code}"] += 1
        return result

    def start(self, size: int) -> None:
        channel = grpc.insecure_channel(
            self._address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        stub = pb_grpc.KVStoreStub(channel)
        auth = (("authorization", f"Bearer {BOB}"),)
        rng = np.random.default_rng(99)
        own = rng.integers(0, 128_000, 300 * 128 + 200)
        keys = block_keys(self._fingerprint, own)[:300]
        with KVStoreClient(self._address, token=BOB, timeout_s=120) as bob:
            bob.put_blocks(keys, [bytes(size)] * len(keys), "chatbot")
        # 40 streams of 300 blocks, never read.
        for _ in range(40):
            self._streams.append(
                stub.GetBlocks(pb.GetBlocksRequest(keys=keys), metadata=auth, timeout=600)
            )
        hoard = pb.QueryHitRequest(token_ids=own[: 8 * 128 + 200].tolist(), take_lease=True)
        repeated = pb.QueryHitRequest(
            block_keys_packed=keys[0] * 1000, prompt_len=1000 * 128 + 200, take_lease=True
        )
        huge = pb.QueryHitRequest(
            token_ids=rng.integers(0, 128_000, 1 << 20).tolist(), take_lease=False
        )

        def loop(name: str, step: Any, pause: float = 0.0) -> None:
            while not self._stop.is_set():
                self._count(name, step)
                if pause:
                    self._stop.wait(pause)

        def probe() -> None:
            prompt = self._alice[int(rng.integers(len(self._alice)))]
            keys = block_keys(self._fingerprint, prompt)[:BLOCKS]
            answer = stub.QueryHit(
                pb.QueryHitRequest(token_ids=prompt.tolist(), take_lease=False),
                metadata=auth,
                timeout=30,
            )
            with self._lock:
                self.answers["alice's prompt: blocks bob saw cached"] += (
                    answer.plan.block_hit_tokens // 128
                )
            reads = list(stub.GetBlocks(pb.GetBlocksRequest(keys=keys), metadata=auth, timeout=30))
            with self._lock:
                self.answers["alice's blocks: bob read"] += sum(r.found for r in reads)
            stub.PutBlocks(
                iter(
                    [
                        pb.PutBlocksRequest(
                            blocks=[pb.Block(key=k, payload=bytes(size)) for k in keys]
                        )
                    ]
                ),
                metadata=auth,
                timeout=30,
            )

        work = [
            ("hoard leases", lambda: stub.QueryHit(hoard, metadata=auth, timeout=30), 0.0),
            ("repeat one key", lambda: stub.QueryHit(repeated, metadata=auth, timeout=30), 0.0),
            ("1M-token QueryHit", lambda: stub.QueryHit(huge, metadata=auth, timeout=60), 0.0),
            ("probe/read/poison alice", probe, 0.05),
        ]
        for name, step, pause in work:
            thread = threading.Thread(target=loop, args=(name, step, pause), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        for stream in self._streams:
            stream.cancel()


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(figures: dict[str, Any]) -> dict[str, Any]:
    asked = figures["asked"]
    return {
        "requests": len(figures["query_ms"]),
        "hit_rate": figures["hit"] / asked if asked else float("nan"),
        "wrong_bytes": figures["wrong_bytes"],
        "errors": dict(figures["errors"]),
        "query_p50_ms": _pct(figures["query_ms"], 50),
        "query_p99_ms": _pct(figures["query_ms"], 99),
        "read_p50_ms": _pct(figures["read_ms"], 50),
        "read_p99_ms": _pct(figures["read_ms"], 99),
    }


def measure(seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        tokens_file = _tokens_file(Path(scratch) / "tokens.toml")
        with kvstore_up(Path(scratch) / "data", "--tokens-file", str(tokens_file)) as address:
            with KVStoreClient(address, token=ALICE, timeout_s=120) as alice:
                served = alice.stats().extra
                fingerprint = bytes.fromhex(served["model_fingerprint"])
                size = int(served["block_bytes"])
                rng = np.random.default_rng(1)
                prompts = [rng.integers(0, 128_000, BLOCKS * 128 + 200) for _ in range(PROMPTS)]
                for prompt in prompts:
                    keys = block_keys(fingerprint, prompt)[:BLOCKS]
                    alice.put_blocks(keys, [_payload(k, size) for k in keys], "chatbot")
            engines = Engines(address, prompts, size)
            print(f"phase 1: alice alone, {seconds:g} s ...", file=sys.stderr)
            quiet = summarize(engines.run(seconds))
            bob = Bob(address, prompts, fingerprint)
            bob.start(size)
            print(f"phase 2: alice while bob abuses, {seconds:g} s ...", file=sys.stderr)
            try:
                abused = summarize(engines.run(seconds))
            finally:
                bob.stop()
            return {"quiet": quiet, "bob_abusing": abused, "bob": dict(bob.answers)}


def print_table(results: dict[str, Any]) -> None:
    quiet, abused = results["quiet"], results["bob_abusing"]
    print(f"{'alice':<22}{'alone':>14}{'bob abusing':>14}{'ratio':>8}")
    for name in (
        "requests",
        "hit_rate",
        "wrong_bytes",
        "query_p50_ms",
        "query_p99_ms",
        "read_p50_ms",
        "read_p99_ms",
    ):
        a, b = quiet[name], abused[name]
        ratio = f"{b / a:.2f}" if isinstance(a, float | int) and a else ""
        print(f"{name:<22}{a:>14.3f}{b:>14.3f}{ratio:>8}")
    print(f"{'errors':<22}{str(quiet['errors']):>14}{str(abused['errors']):>14}")
    print("\nbob's calls, by answer:")
    for what, count in sorted(results["bob"].items()):
        print(f"  {what:<52}{count:>8}")
    same = quiet["hit_rate"] == abused["hit_rate"] and not abused["errors"]
    print(
        f"\nalice's hit rate unaffected and no errors: {'yes' if same else 'NO'} "
        f"(wrong bytes {quiet['wrong_bytes'] + abused['wrong_bytes']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 300:
        parser.error("--seconds: must be in [1, 300]")
    results = measure(args.seconds)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
