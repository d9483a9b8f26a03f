"""Servers the benchmarks start: a throw-away Redis on loopback (the peer measured in the same
run), or another host's (``peer_redis``), with a pipelining client; and `kvstore up` in its own
process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[tuple[int, Any] | None]:
    """(port, redis-py client) of a redis-server started on 127.0.0.1 without persistence and
    stopped on exit; None when Debian's redis-server is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                scratch,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            else:
                raise RuntimeError("redis-server did not start")
            yield port, client
        finally:
            process.terminate()
            process.wait(timeout=10)


class Redis:
    def __init__(self, client: Any) -> None:
        self.client = client
        self.pid = int(client.info("server")["process_id"])
        parser = client.connection_pool.connection_kwargs.get("parser_class")
        self.hiredis = "Hiredis" in getattr(parser, "__name__", "") or _hiredis_default()

    def set_many(self, keys: list[bytes], values: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, value in zip(keys, values, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def get_many(self, keys: list[bytes]) -> list[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    def delete(self, keys: list[bytes]) -> None:
        self.client.delete(*keys)


def _hiredis_default() -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return False
    return bool(HIREDIS_AVAILABLE)


@contextmanager
def peer_redis(address: str | None) -> Iterator[Redis]:
    """The Redis to compare with: ``--redis HOST:PORT`` (another testbed host's), else one
    started here on loopback."""
    if address:
        import redis

        host, port = address.rsplit(":", 1)
        password = os.environ.get("KVSTORE_BENCH_REDIS_PASSWORD")  # set by benchmarks/hosts.py
        yield Redis(redis.Redis(host=host, port=int(port), password=password))
        return
    with redis_server() as peer:
        if peer is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        yield Redis(peer[1])


@contextmanager
def kvstore_up(data_dir: Path, *flags: str) -> Any:
    """`kvstore up` in its own process (the server must not share this process's GIL with
    the load generator), with ``flags`` added; yields its address, stops it with SIGINT."""
    from kvstore.runtime.upprocess import TierProcess

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with TierProcess.start(data_dir, "--no-gc", "--fsync", "never", *flags, env=env) as tier:
        yield tier.address
