"""Run a benchmark across hosts: a ``kvstore.testbed`` (hosts in network namespaces on a bridge,
Ray across them with token auth), a Redis server on a storage host, and the benchmark itself on
the client host, which holds no storage node, so every byte it moves to kvstore or to Redis
crosses a veth pair and the bridge. Root only.

    with cross_host_testbed() as (bed, redis_address):
        results = run_on_client(bed, ["benchmarks/blockstore.py", "--join", bed.ray.address, ...])

The hosts share this machine's two cores, memory and disk: the network path is real (its own
interfaces, addresses, MTU 1500, the kernel's TCP), the hardware under it is not more than one
machine's.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.testbed.testbed import (  # noqa: E402
    CLIENT,
    Testbed,
    TestbedConfig,
    teardown_on_signals,
)

#: The host Redis runs on (a storage host: the client reaches it over the network).
REDIS_HOST = "s1"
REDIS_PORT = 6380
#: The benchmark on the client host finds Redis's password here (never on a command line).
REDIS_PASSWORD_ENV = "KVSTORE_BENCH_REDIS_PASSWORD"


def _say(message: str) -> None:
    print(f"testbed: {message}", file=sys.stderr, flush=True)


@contextmanager
def cross_host_testbed(
    progress: Callable[[str], None] = _say,
) -> Iterator[tuple[Testbed, str]]:
    """A testbed with redis-server on ``REDIS_HOST`` (no persistence; beyond loopback Redis
    wants a password: a random one, in ``bed.env()`` as ``REDIS_PASSWORD_ENV``); (testbed, Redis
    HOST:PORT). Everything is taken down on exit, Ctrl-C and failure; what was left behind
    (nothing, when clean) is said on stderr."""
    bed = Testbed.up(TestbedConfig(), progress=progress)
    try:
        with teardown_on_signals(bed):
            address = bed.network.address(REDIS_HOST)
            scratch = bed.run_dir / "redis"
            scratch.mkdir(mode=0o700)
            config = scratch / "redis.conf"  # the password in a 0600 file, not in argv
            password = secrets.token_hex(16)
            config.touch(mode=0o600)
            config.write_text(f"requirepass {password}\n")
            with (scratch / "redis.log").open("wb") as log:  # not this process's stdout
                bed.network.popen(
                    REDIS_HOST,
                    ["redis-server", str(config), "--bind", address, "--port", str(REDIS_PORT),
                     "--save", "", "--appendonly", "no", "--dir", str(scratch)],
                    env=bed.env(), stdout=log, stderr=log,
                )  # fmt: skip
            bed.extra_env[REDIS_PASSWORD_ENV] = password
            _wait_reachable(bed, address, REDIS_PORT)
            progress(f"redis-server on {REDIS_HOST} ({address}:{REDIS_PORT})")
            yield bed, f"{address}:{REDIS_PORT}"
    finally:
        left = bed.down()
        progress(f"testbed down; left behind: {', '.join(left) or 'nothing'}")


def _wait_reachable(bed: Testbed, address: str, port: int, timeout_s: float = 60.0) -> None:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), 2).close()"
    deadline = time.monotonic() + timeout_s
    while bed.run(CLIENT, [sys.executable, "-c", probe]).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{address}:{port} not reachable from the client host")
        time.sleep(0.5)


def run_on_client(bed: Testbed, argv: list[str], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run ``python3 ARGV... --json`` on the client host; its JSON result (stderr passed on)."""
    done = bed.run(CLIENT, [sys.executable, *argv, "--json"], timeout_s=timeout_s)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode not in (0, 1):  # 1: ran, a target missed
        raise RuntimeError(f"{argv[0]} on the client host exited {done.returncode}")
    start = done.stdout.find("{")
    if start < 0:
        raise RuntimeError(f"{argv[0]} on the client host printed no JSON")
    result: dict[str, Any] = json.loads(done.stdout[start:])
    return result
