"""M concurrent gRPC clients against a kvstore gateway for a bounded time.

Each client thread has its own channel (``KVStoreClient``) and its own blocks: it puts a few,
then loops over a mix of QueryHit, GetBlocks (checked bit-exact), PutBlocks, GetSWAState (a
miss) and GetStats until the deadline or its request budget. Every ``grpc.RpcError`` is counted
by status code; every latency is kept per RPC so the report gives p50 / p99. Loopback only:
the address must be a 127.0.0.0/8 one.
"""

from __future__ import annotations

import ipaddress
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvstore.api.client import KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.keys import BLOCK_TOKENS, BlockKey
from kvstore.tier.records import HitRequest


@dataclass(frozen=True)
class GrpcLoadConfig:
    clients: int = 8
    seconds: float = 5.0
    max_requests_per_client: int = 5_000
    #: The served model's block size (the gateway refuses any other payload size).
    block_bytes: int = GeometryConfig.default().block_bytes
    blocks_per_client: int = 8
    token: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("clients", "max_requests_per_client", "block_bytes", "blocks_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")
        if not 0 < self.seconds <= 600:
            raise InvalidArgument("seconds", f"must be in (0, 600], got {self.seconds}")


@dataclass
class GrpcLoadReport:
    clients: int
    seconds: float = 0.0
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_messages: list[str] = field(default_factory=list)
    wrong_bytes: int = 0
    block_misses: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def percentile_ms(self, q: float, rpc: str | None = None) -> float:
        samples = (
            self.latencies.get(rpc, [])
            if rpc is not None
            else [s for values in self.latencies.values() for s in values]
        )
        return float(np.percentile(samples, q) * 1e3) if samples else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "seconds": round(self.seconds, 3),
            "requests": self.requests,
            "qps": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "errors": dict(self.errors),
            "wrong_bytes": self.wrong_bytes,
            "block_misses": self.block_misses,
            "p50_ms": round(self.percentile_ms(50), 3),
            "p99_ms": round(self.percentile_ms(99), 3),
            "per_rpc": {
                rpc: {
                    "requests": len(values),
                    "p50_ms": round(self.percentile_ms(50, rpc), 3),
                    "p99_ms": round(self.percentile_ms(99, rpc), 3),
                }
                for rpc, values in sorted(self.latencies.items())
            },
        }


def _check_loopback(address: str) -> None:
    host = address.rpartition(":")[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise InvalidArgument("address", f"load is sent to loopback addresses only, got {address}")


def _payload(key: bytes, size: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


class _Client:
    def __init__(
        self,
        address: str,
        config: GrpcLoadConfig,
        report: GrpcLoadReport,
        lock: threading.Lock,
        seed: int,
    ) -> None:
        self._client = KVStoreClient(address, token=config.token, timeout_s=config.timeout_s)
        self._config = config
        self._report = report
        self._lock = lock
        self._rng = random.Random(seed)
        self._keys: list[BlockKey] = []

    def _timed(self, rpc: str, call: Any) -> Any:
        started = time.perf_counter()
        try:
            answer = call()
        except grpc.RpcError as error:
            code = error.code().name if error.code() is not None else "UNKNOWN"
            with self._lock:
                self._report.requests += 1
                self._report.errors[code] = self._report.errors.get(code, 0) + 1
                if len(self._report.error_messages) < 10:
                    self._report.error_messages.append(f"{rpc}: {code}: {error.details()}")
            return None
        seconds = time.perf_counter() - started
        with self._lock:
            self._report.requests += 1
            self._report.latencies[rpc].append(seconds)
        return answer

    def _new_keys(self, count: int) -> list[BlockKey]:
        return [BlockKey(self._rng.randbytes(32)) for _ in range(count)]

    def _put(self, keys: list[BlockKey]) -> None:
        payloads = [_payload(key, self._config.block_bytes) for key in keys]
        answer = self._timed("PutBlocks", lambda: self._client.put_blocks(keys, payloads))
        if answer is not None:
            failed = set(answer.failed_keys)
            self._keys.extend(key for key in keys if key not in failed)

    def _get(self) -> None:
        keys = self._rng.sample(self._keys, min(4, len(self._keys)))
        reads = self._timed("GetBlocks", lambda: self._client.get_blocks(keys))
        if reads is None:
            return
        wrong = misses = 0
        for key, read in zip(keys, reads, strict=True):
            if read.payload is None:
                misses += 1
            elif read.payload != _payload(key, self._config.block_bytes):
                wrong += 1
        with self._lock:
            self._report.wrong_bytes += wrong
            self._report.block_misses += misses

    def run(self, deadline: float) -> None:
        try:
            self._put(self._new_keys(self._config.blocks_per_client))
            for _ in range(self._config.max_requests_per_client):
                if time.monotonic() >= deadline:
                    break
                choice = self._rng.random()
                if choice < 0.45 and self._keys:
                    self._get()
                elif choice < 0.75 and self._keys:
                    prefix = self._keys[: self._rng.randint(1, len(self._keys))]
                    length = len(prefix) * BLOCK_TOKENS + 300
                    self._timed(
                        "QueryHit",
                        lambda p=prefix, n=length: self._client.query_hit(
                            HitRequest(block_keys=p, prompt_len=n, take_lease=False)
                        ),
                    )
                elif choice < 0.85:
                    self._put(self._new_keys(1))
                elif choice < 0.97:
                    key = BlockKey(self._rng.randbytes(32))
                    self._timed(
                        "GetSWAState", lambda k=key: self._client.get_swa_state(k, BLOCK_TOKENS)
                    )
                else:
                    self._timed("GetStats", self._client.stats)
        finally:
            self._client.close()


def run_grpc_load(address: str, config: GrpcLoadConfig, seed: int = 0) -> GrpcLoadReport:
    """Drive ``config.clients`` concurrent clients at ``address``; returns what they saw."""
    _check_loopback(address)
    report = GrpcLoadReport(clients=config.clients)
    lock = threading.Lock()
    clients = [
        _Client(address, config, report, lock, seed * 1000 + i) for i in range(config.clients)
    ]
    started = time.monotonic()
    deadline = started + config.seconds
    threads = [
        threading.Thread(target=c.run, args=(deadline,), name=f"grpc-load-{i}", daemon=True)
        for i, c in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=config.seconds + 4 * config.timeout_s)
    report.seconds = time.monotonic() - started
    stuck = sum(thread.is_alive() for thread in threads)
    if stuck:
        report.errors["CLIENT_STUCK"] = stuck
    return report
