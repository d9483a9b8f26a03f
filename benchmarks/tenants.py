"""Two tenants on one tier: does bob's abuse change what alice's engines get?

    python3 benchmarks/tenants.py                 # ~2 min: alice alone, then under each abuse
    python3 benchmarks/tenants.py --seconds 20 --json

Starts `kvstore up` (its own process) with a tokens file of two tenants. alice caches 40 prompts
of 8 blocks, then her 4 engines loop (bounded in time and count): QueryHit with a lease,
GetBlocks of the hit with that lease, bytes checked. Phase 1: alice alone. Then one phase per
abuse, bob doing only that one while alice's engines run, and a last phase with every abuse at
once. bob runs in a process of his own, as he would on another machine: his client's work
shares the cores with alice's engines, not their process's GIL. The abuses are what two
security reviews (issues 15 and 31) found an attacker could do:
- hoards leases: QueryHits that take a lease and never give it back, as fast as he can;
- repeats one key 1,000 times in a QueryHit (the old way to pin a block at 65,535 leases);
- opens 40 GetBlocks streams of 300 blocks (34 MB each) and never reads them;
- sends 1M-token QueryHits (hashing them used to stall the gateway's event loop);
- sends the largest QueryHits by keys (8,192 packed keys, 8 at a time);
- opens 300 PutBlocks streams and sends nothing (they used to hold every in-flight slot);
- opens 40 PutBlocks streams of 14.9 MiB messages (they used to fill the gateway's memory);
- queries and reads alice's prompts by their public keys (probing, reading, poisoning).

The table gives, per phase, alice's hit rate, errors, and QueryHit and GetBlocks p50/p99 with
the p50's ratio to the quiet phase, and shows what bob's calls were answered. Targets (issues
15 and 31): alice's hit rate and errors are the same under every abuse, and her p50s stay
within 3x of the quiet phase's (two shared cores: bob's load costs CPU that alice's engines
share). The gateway reads shards from the storage nodes over their sockets, as across machines,
but on one machine those are loopback, so GetBlocks latency is lower than across machines; the
headline (hit rate, isolation, the ratios to the quiet phase) is what a deployment sees.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
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
from kvstore.keys import BLOCK_TOKENS, block_keys  # noqa: E402
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
                        figures["hit"] += answer.plan.block_hit_tokens // BLOCK_TOKENS
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


#: The abuses, one phase each (``Bob.start`` runs those named).
ABUSES = (
    "hoard leases",
    "repeat one key",
    "unread GetBlocks streams",
    "1M-token QueryHits",
    "8,192-key QueryHits",
    "idle PutBlocks streams",
    "fat PutBlocks streams",
    "probe/read/poison alice",
)


class Bob:
    """The abuses the reviews found, in parallel (those ``start`` is given), bounded in time."""

    def __init__(self, address: str, alice_prompts: list[np.ndarray], fingerprint: bytes) -> None:
        self._address = address
        self._alice = alice_prompts
        self._fingerprint = fingerprint
        self.answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: list[Any] = []
        self._channels: list[grpc.Channel] = []
        self._auth = (("authorization", f"Bearer {BOB}"),)
        self._size = 0
        self._keys: list[bytes] = []

    def _count(self, what: str, call: Any) -> Any:
        try:
            result = call()
            code = "OK"
        except grpc.RpcError as error:
            result, code = None, error.code().name
        with self._lock:
            self.answers[f"{what}: {code}"] += 1
        return result

    def _stub(self) -> pb_grpc.KVStoreStub:
        """A stub on a connection of its own (channels to one address share one by default,
        and a connection carries 64 streams at most)."""
        channel = grpc.insecure_channel(
            self._address,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        self._channels.append(channel)
        return pb_grpc.KVStoreStub(channel)

    def prepare(self, size: int) -> None:
        """bob's own 300 blocks, for the streams he leaves unread."""
        self._size = size
        own = np.random.default_rng(99).integers(0, 128_000, 300 * BLOCK_TOKENS + 200)
        self._keys = list(block_keys(self._fingerprint, own))[:300]
        with KVStoreClient(self._address, token=BOB, timeout_s=120) as bob:
            bob.put_blocks(self._keys, [bytes(size)] * len(self._keys), "chatbot")

    def start(self, abuses: tuple[str, ...]) -> None:
        self._stop.clear()
        stub, auth, size, keys = self._stub(), self._auth, self._size, self._keys
        rng = np.random.default_rng(99)
        own = rng.integers(0, 128_000, 8 * BLOCK_TOKENS + 200)
        hoard = pb.QueryHitRequest(token_ids=own.tolist(), take_lease=True)
        repeated = pb.QueryHitRequest(
            block_keys_packed=keys[0] * 1000, prompt_len=1000 * BLOCK_TOKENS + 200, take_lease=True
        )
        huge = pb.QueryHitRequest(
            token_ids=rng.integers(0, 128_000, 1 << 20).tolist(), take_lease=False
        )
        widest = pb.QueryHitRequest(
            block_keys_packed=os.urandom(32 * 8192),
            prompt_len=8192 * BLOCK_TOKENS,
            take_lease=False,
        )

        def loop(name: str, step: Any, pause: float = 0.0) -> None:
            for _ in range(1_000_000):  # bounded; stops with the phase
                if self._stop.is_set():
                    return
                self._count(name, step)
                if pause:
                    self._stop.wait(pause)

        poisoned: set[int] = set()  # alice's prompts bob has written his own blocks for

        def probe() -> None:
            index = int(rng.integers(len(self._alice)))
            prompt = self._alice[index]
            alice_keys = block_keys(self._fingerprint, prompt)[:BLOCKS]
            answer = stub.QueryHit(
                pb.QueryHitRequest(token_ids=prompt.tolist(), take_lease=False),
                metadata=auth,
                timeout=30,
            )
            reads = list(
                stub.GetBlocks(pb.GetBlocksRequest(keys=alice_keys), metadata=auth, timeout=30)
            )
            with self._lock:
                if index not in poisoned:  # afterwards bob finds the blocks he wrote himself
                    self.answers["alice's prompt, before bob wrote it: blocks he saw cached"] += (
                        answer.plan.block_hit_tokens // BLOCK_TOKENS
                    )
                    self.answers["alice's prompt, before bob wrote it: blocks he read"] += sum(
                        r.found for r in reads
                    )
                self.answers["alice's blocks: bob read her bytes"] += sum(
                    r.found and r.payload == _payload(r.key, size) for r in reads
                )
            blocks = [pb.Block(key=k, payload=bytes(size)) for k in alice_keys]
            stub.PutBlocks(iter([pb.PutBlocksRequest(blocks=blocks)]), metadata=auth, timeout=30)
            with self._lock:
                poisoned.add(index)

        def idle_stream() -> Any:
            self._stop.wait(600)  # sends nothing until the phase ends
            yield from ()

        per_message = (15 << 20) // size

        def fat_stream(stream: int) -> Any:
            blocks = [
                pb.Block(
                    key=(0xFA7 << 200 | stream << 16 | i).to_bytes(32, "big"), payload=bytes(size)
                )
                for i in range(per_message)
            ]
            yield pb.PutBlocksRequest(blocks=blocks, traffic_class="chatbot")
            self._stop.wait(600)  # then holds the stream open

        def open_streams(name: str, count: int, connections: int, open_one: Any) -> None:
            stubs = [self._stub() for _ in range(connections)]
            for i in range(count):
                call = open_one(stubs[i % connections], i)
                self._streams.append(call)
                call.add_done_callback(lambda done, name=name: self._record(name, done))

        loops = {
            "hoard leases": lambda: stub.QueryHit(hoard, metadata=auth, timeout=30),
            "repeat one key": lambda: stub.QueryHit(repeated, metadata=auth, timeout=30),
            "1M-token QueryHits": lambda: stub.QueryHit(huge, metadata=auth, timeout=60),
        }
        for name in abuses:
            if name in loops:
                self._spawn(loop, name, loops[name])
            elif name == "8,192-key QueryHits":
                for _ in range(8):
                    self._spawn(
                        loop, name, lambda: stub.QueryHit(widest, metadata=auth, timeout=60)
                    )
            elif name == "probe/read/poison alice":
                self._spawn(loop, name, probe, 0.05)
            elif name == "unread GetBlocks streams":
                for _ in range(40):
                    self._streams.append(
                        stub.GetBlocks(pb.GetBlocksRequest(keys=keys), metadata=auth, timeout=600)
                    )
            elif name == "idle PutBlocks streams":
                open_streams(
                    name,
                    300,
                    6,
                    lambda s, i: s.PutBlocks.future(idle_stream(), metadata=auth, timeout=600),
                )
            elif name == "fat PutBlocks streams":
                open_streams(
                    name,
                    40,
                    4,
                    lambda s, i: s.PutBlocks.future(fat_stream(i), metadata=auth, timeout=600),
                )

    def _spawn(self, loop: Any, name: str, step: Any, pause: float = 0.0) -> None:
        thread = threading.Thread(target=loop, args=(name, step, pause), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _record(self, name: str, done: Any) -> None:
        error = done.exception()
        code = "OK" if error is None else error.code().name
        with self._lock:
            self.answers[f"{name}: {code}"] += 1

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        for stream in self._streams:
            stream.cancel()
        for channel in self._channels:
            channel.close()
        self._threads, self._streams, self._channels = [], [], []


def _serve_bob(commands: Any, address: str, alice: list[np.ndarray], fingerprint: bytes) -> None:
    """bob's own process: runs the commands ``BobProcess`` sends until told to stop."""
    bob = Bob(address, alice, fingerprint)
    while True:
        command, argument = commands.recv()
        if command == "prepare":
            bob.prepare(argument)
        elif command == "start":
            bob.start(argument)
        elif command == "stop":
            bob.stop()
        else:  # "exit"
            commands.send(dict(bob.answers))
            return
        commands.send(None)


class BobProcess:
    """bob in a process of his own, as on another machine: his client's work (serializing a
    million token ids, his streams' threads) does not share the GIL of alice's engines, only
    the cores."""

    def __init__(self, address: str, alice: list[np.ndarray], fingerprint: bytes) -> None:
        context = multiprocessing.get_context("spawn")
        self._commands, theirs = context.Pipe()
        self._process = context.Process(
            target=_serve_bob, args=(theirs, address, alice, fingerprint), daemon=True
        )
        self._process.start()
        self.answers: dict[str, int] = {}

    def _do(self, command: str, argument: Any = None) -> Any:
        self._commands.send((command, argument))
        if not self._commands.poll(300):
            raise RuntimeError(f"bob's process did not finish {command!r} within 300 s")
        return self._commands.recv()

    def prepare(self, size: int) -> None:
        self._do("prepare", size)

    def start(self, abuses: tuple[str, ...]) -> None:
        self._do("start", abuses)

    def stop(self) -> None:
        self._do("stop")

    def close(self) -> None:
        self.answers = self._do("exit")
        self._process.join(30)


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


def measure(seconds: float, abuses: tuple[str, ...] = ABUSES) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        tokens_file = _tokens_file(Path(scratch) / "tokens.toml")
        with kvstore_up(Path(scratch) / "data", "--tokens-file", str(tokens_file)) as address:
            with KVStoreClient(address, token=ALICE, timeout_s=120) as alice:
                served = alice.stats().extra
                fingerprint = bytes.fromhex(served["model_fingerprint"])
                size = int(served["block_bytes"])
                rng = np.random.default_rng(1)
                prompts = [
                    rng.integers(0, 128_000, BLOCKS * BLOCK_TOKENS + 200) for _ in range(PROMPTS)
                ]
                for prompt in prompts:
                    keys = block_keys(fingerprint, prompt)[:BLOCKS]
                    alice.put_blocks(keys, [_payload(k, size) for k in keys], "chatbot")
            engines = Engines(address, prompts, size)
            print(f"alice alone, {seconds:g} s ...", file=sys.stderr)
            phases = {"alone": summarize(engines.run(seconds))}
            bob = BobProcess(address, prompts, fingerprint)
            bob.prepare(size)
            phases_of_bob = [(a, (a,)) for a in abuses]
            if len(abuses) > 1:
                phases_of_bob.append(("every abuse at once", abuses))
            for name, doing in phases_of_bob:
                print(f"alice while bob: {name}, {seconds:g} s ...", file=sys.stderr)
                bob.start(doing)
                try:
                    phases[name] = summarize(engines.run(seconds))
                finally:
                    bob.stop()
                time.sleep(2.0)  # what the phase left behind drains before the next
            bob.close()
            return {"phases": phases, "bob": bob.answers}


def print_table(results: dict[str, Any]) -> None:
    phases = results["phases"]
    alone = phases["alone"]
    print(
        f"{'alice, while bob does':<28}{'hit rate':>9}{'errors':>8}"
        f"{'QueryHit p50/p99 ms':>22}{'x':>6}{'GetBlocks p50/p99 ms':>23}{'x':>6}"
    )
    worst = 0.0
    same = True
    for name, figures in phases.items():
        ratios = []
        for part in ("query", "read"):
            base = alone[f"{part}_p50_ms"]
            ratios.append(figures[f"{part}_p50_ms"] / base if base else float("nan"))
        if name != "alone":
            worst = max(worst, *ratios)
            same = same and figures["hit_rate"] == alone["hit_rate"] and not figures["errors"]
        errors = sum(figures["errors"].values())
        print(
            f"{name:<28}{figures['hit_rate']:>9.3f}{errors:>8}"
            f"{figures['query_p50_ms']:>12.1f} / {figures['query_p99_ms']:<7.1f}{ratios[0]:>6.2f}"
            f"{figures['read_p50_ms']:>13.1f} / {figures['read_p99_ms']:<7.1f}{ratios[1]:>6.2f}"
        )
    print("\nbob's calls, by answer:")
    for what, count in sorted(results["bob"].items()):
        print(f"  {what:<52}{count:>8}")
    wrong = sum(figures["wrong_bytes"] for figures in phases.values())
    print(
        f"\nalice's hit rate unaffected and no errors: {'yes' if same else 'NO'} "
        f"(wrong bytes {wrong}); worst p50 ratio {worst:.2f} (target <= 3)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--abuse",
        action="append",
        choices=ABUSES,
        metavar="NAME",
        help="run only this abuse's phase (repeatable; default: each, then all at once). "
        f"One of: {'; '.join(ABUSES)}",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 300:
        parser.error("--seconds: must be in [1, 300]")
    results = measure(args.seconds, tuple(args.abuse or ABUSES))
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
