#!/usr/bin/env python3
"""Start a local multi-machine Ray cluster on this host and keep it up until Ctrl-C.

Each simulated machine is its own Ray node (raylet, object store, workers) carrying a custom
resource named after its machine id (``kvstore_machine_m0`` ...), so storage nodes can be pinned
one per machine. Everything listens on 127.0.0.1 only, with Ray's token authentication on (the
token: ``RAY_AUTH_TOKEN_PATH`` if set, else kvstore's own ``~/.kvstore/ray_auth_token``, 0600).
Other kvstore processes of the same user join with the printed address and find that token
themselves; Ray's own CLI and other drivers need the two variables it prints, e.g.:

    python3 cluster/local_cluster.py --machines 13
    kvstore gc --dry-run --address 127.0.0.1:PORT

Thin over ``kvstore.runtime.cluster.LocalCluster`` (the class the tests and ``kvstore chaos``
use).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from kvstore.errors import ConfigError
from kvstore.runtime.cluster import LocalCluster, LocalClusterConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=13, help="machines to start (>= 1)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs each machine advertises")
    parser.add_argument(
        "--object-store-mib", type=int, default=256, help="object store per machine, MiB"
    )
    args = parser.parse_args(argv)
    if args.machines < 1:
        parser.error(f"--machines must be >= 1, got {args.machines}")
    try:
        config = LocalClusterConfig(
            machine_cpus=args.cpus, machine_object_store_mib=args.object_store_mib
        )
    except ConfigError as error:
        parser.error(str(error))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting {args.machines} machines on 127.0.0.1 ...", file=sys.stderr, flush=True)
    cluster = LocalCluster.start(num_machines=args.machines, config=config)
    try:
        print(f"address: {cluster.address}", flush=True)
        print(f"machines: {' '.join(cluster.machines)}", flush=True)
        if cluster.token_path is not None:  # None: the token came as RAY_AUTH_TOKEN
            print(
                f"ray auth: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.token_path}",
                flush=True,
            )
        print("Ctrl-C stops every process of the cluster.", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
