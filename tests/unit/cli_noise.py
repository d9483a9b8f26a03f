"""Output that must not reach stdout, for the ``--json`` tests (tests/unit/test_cli_json.py).

``noisy(run)`` wraps a command's ``run``: before and after the command it prints a line, writes
one to descriptor 1 and starts a process that prints one on the stdout it inherits; each line
carries ``MARK``. Run as a script (``python cli_noise.py COMMAND ...``), it runs ``kvstore
COMMAND ...`` with that command's ``run`` wrapped, and with ``KVSTORE_NOISE_RAY_ADDRESS`` set
the command first joins that Ray cluster the way a driver that forwards its workers' output
does (``log_to_driver``) and makes Ray print on the driver's stdout (``ray_noise``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

MARK = "NOT-FOR-STDOUT"
RAY_ADDRESS_ENV = "KVSTORE_NOISE_RAY_ADDRESS"

Run = Callable[[argparse.Namespace], int]


def make_noise(tag: str) -> None:
    print(f"{MARK} print {tag}", flush=True)
    os.write(1, f"{MARK} fd1 {tag}\n".encode())
    subprocess.run(["echo", f"{MARK} child {tag}"], check=True)


def noisy(run: Run, before: Callable[[], None] | None = None) -> Run:
    def wrapped(args: argparse.Namespace) -> int:
        if before is not None:
            before()
        make_noise("before")
        try:
            return run(args)
        finally:
            make_noise("after")

    return wrapped


def ray_noise(address: str) -> None:
    """Join ``address`` forwarding the workers' output; a worker prints and warns, the driver
    shows it (waited for); then a raylet warning twice: Ray prints the first at once and holds
    the repeat back until ``ray.shutdown`` (the "[repeated 2x across cluster]" line), as it
    does with its "N PYTHON worker processes have been started" warnings."""
    import ray
    from ray._private import worker as ray_worker

    ray.init(address=address, namespace="json-noise", log_to_driver=True, configure_logging=False)
    forwarded = threading.Event()

    def seen(data: dict[str, Any]) -> None:
        if any(MARK in line for line in data.get("lines", [])):
            forwarded.set()

    ray_worker.global_worker_stdstream_dispatcher.add_handler("json-noise", seen)

    @ray.remote(num_cpus=0)
    def chatty() -> None:
        import warnings

        print(f"{MARK} ray worker print", flush=True)
        warnings.warn(f"{MARK} ray worker warning", stacklevel=1)

    ray.get(chatty.remote(), timeout=60)
    if not forwarded.wait(60):
        raise RuntimeError("Ray did not forward the worker's output to the driver")
    for _ in range(2):
        ray_worker.print_to_stdstream(
            {"lines": [f"{MARK} raylet warning"], "pid": "raylet", "is_err": False},
            ignore_prefix=False,
        )


def main(argv: list[str]) -> int:
    from kvstore.cli import main as kvstore_main

    module = importlib.import_module(f"kvstore.commands.{argv[0]}")
    address = os.environ.get(RAY_ADDRESS_ENV)
    module.run = noisy(module.run, None if address is None else lambda: ray_noise(address))
    return kvstore_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
