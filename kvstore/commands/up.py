"""`kvstore up`: start (or join) a Ray cluster, deploy kvstore, serve gRPC until Ctrl-C."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from kvstore.api.server import ServerOptions, is_loopback, read_token_file
from kvstore.config import ServiceConfig
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.fastcall.tls import INSECURE_ENV, FastcallConfig, check_plaintext
from kvstore.geometry import PRESET_NAMES
from kvstore.tenants import TenantDirectory

NAME = "up"
HELP = "start or join a Ray cluster, deploy kvstore and serve its gRPC API (Ctrl-C stops)"
DESCRIPTION = """Deploy kvstore on Ray and serve the kvstore.v1 gRPC API until Ctrl-C:
12+ storage nodes (10+2 erasure coding, shard files under --data-dir), meta shards, repair,
the SWA tier (a state store per machine + the entrypoint directory) and the GC worker.

Without --address an embedded local Ray cluster is started (loopback only, Ray token auth
on); --address HOST:PORT (or "auto") joins an existing one. The gateway binds 127.0.0.1 unless
--host says otherwise, and beyond loopback it refuses to start without TLS and an identity
(--tokens-file, --token-file or --tls-client-ca) unless --insecure is given. The data plane
(the direct sockets of storage nodes, meta shards and the SWA tier) listens on each Ray node's
address: beyond loopback it refuses to start without TLS (KVSTORE_FASTCALL_TLS_CERT, _KEY and
_CA in the environment, the same files on every machine) unless --insecure is given too.

Tenants: with --tokens-file every token maps to a tenant whose keys live in a namespace of its
own (derived from the secret in --tenant-secret-file), with the quotas and traffic classes the
file gives it; the file is reread when it changes (rotate tokens without a restart). See
docs/security.md.

  kvstore up                                   # embedded cluster, 127.0.0.1:50051
  kvstore up --port 0 --metrics-port 9464      # any free port; Prometheus on 127.0.0.1:9464
  kvstore up --address auto --host 0.0.0.0 --tokens-file /etc/kvstore/tokens.toml \\
             --tls-cert server.pem --tls-key server.key

Restarting on the same --data-dir serves every committed block again.

Every setting without a flag comes from the environment: KVSTORE_BLOCKSTORE_<FIELD> (block tier,
e.g. KVSTORE_BLOCKSTORE_CALL_TIMEOUT_S=5, KVSTORE_BLOCKSTORE_NODE_CAPACITY_BYTES=...),
KVSTORE_SWA_<FIELD> (SWA tier), KVSTORE_<FIELD> (model geometry, e.g. KVSTORE_PRESET) and
KVSTORE_GC_FILE (a gc.toml: traffic classes, TTLs, lease length). A flag given wins over the
environment."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster to join (default: embedded local cluster)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=50051, help="gateway port (0 = any free)")
    parser.add_argument(
        "--data-dir", type=Path, default=Path("kvstore-data"), help="root of the shard files"
    )
    parser.add_argument("--deployment", help="name of this deployment (default kvstore)")
    parser.add_argument("--storage-nodes", type=int, help="storage nodes (≥ 12; default 12)")
    parser.add_argument(
        "--meta-shards",
        type=int,
        metavar="N",
        help="meta shards (default: one per 2 CPUs of the Ray cluster, 1 to 8: each is a "
        "single-threaded actor, and more than the cores can run only adds per-call work)",
    )
    parser.add_argument("--preset", choices=PRESET_NAMES, help="model (default v4.1-flash)")
    parser.add_argument(
        "--block-bytes",
        type=int,
        metavar="N",
        help="exact size of one block payload of the tier's own layout, for requests that "
        "name none (default: the preset's). Not needed for vLLM engines: each connector names "
        "its model's layout, and one tier serves many models",
    )
    parser.add_argument(
        "--fsync", choices=["always", "batch", "never"], help="shard fsync policy (default batch)"
    )
    parser.add_argument(
        "--tokens-file",
        type=Path,
        help="tenants: a TOML file of tokens, quotas and classes per tenant (mode 0600; "
        "reread when it changes)",
    )
    parser.add_argument(
        "--token-file", type=Path, help="one bearer token (mode 0600) for a single tenant"
    )
    parser.add_argument(
        "--tenant-secret-file",
        type=Path,
        help="secret the tenants' namespaces come from (made 0600 if absent; default "
        "DATA_DIR/tenant.secret): keep it, or every cached block is unreachable",
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain (with --tls-key)")
    parser.add_argument("--tls-key", type=Path, help="PEM private key (with --tls-cert)")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        help="require client certificates signed by this CA (mutual TLS); a certificate's "
        "common name is an identity (subjects in the tokens file)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without TLS or without an identity (not advised): the "
        "gateway, and the data plane's sockets on other machines without "
        "KVSTORE_FASTCALL_TLS_* (sets KVSTORE_FASTCALL_INSECURE=1 for the actors)",
    )
    parser.add_argument(
        "--capacity-bytes",
        type=int,
        help="block bytes each storage node may hold (default: from its filesystem's size, "
        "less a reserve, shared filesystems counted once)",
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="metrics bind address (default loopback: the figures describe every tenant)",
    )
    parser.add_argument("--no-gc", action="store_true", help="do not start the GC worker")


def _options(args: argparse.Namespace) -> ServerOptions:
    for flag in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            raise InvalidArgument(f"--{flag.replace('_', '-')}", f"{path} is not a file")
    try:
        token = read_token_file(args.token_file) if args.token_file is not None else None
        return ServerOptions(
            host=args.host,
            port=args.port,
            token=token,
            tokens_file=args.tokens_file,
            tenant_secret_file=args.tenant_secret_file or args.data_dir / "tenant.secret",
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            insecure=args.insecure,
        )
    except ConfigError as error:
        raise InvalidArgument(f"--{error.field.replace('_', '-')}", error.detail) from None


def _tenants(options: ServerOptions, data_dir: Path, classes: tuple[str, ...]) -> TenantDirectory:
    """The tenants, read before Ray starts (a bad tokens file costs no cluster); every class
    a tenant is given must be one the GC policy knows."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        directory = options.tenant_directory()
    except ConfigError as error:
        raise InvalidArgument(f"--{error.field.replace('_', '-')}", error.detail) from None
    for tenant in directory.tenants().values():
        unknown = sorted(set(tenant.classes or ()) - set(classes))
        if unknown:
            raise InvalidArgument(
                "--tokens-file",
                f"tenant {tenant.name!r} is given class {unknown[0]!r}, which the GC policy "
                f"does not know ({', '.join(classes)})",
            )
    return directory


def _data_plane(insecure: bool) -> FastcallConfig:
    """The data plane's setting, checked before Ray starts (a bad TLS variable costs no
    cluster). ``--insecure`` covers it too: put in this process's environment, deploy hands it
    on to every actor it starts (``tls_env_options``)."""
    if insecure:
        os.environ[INSECURE_ENV] = "1"
    config = FastcallConfig.from_env()
    config.tls.sides(serving=True)
    return config


def _check_data_plane(config: FastcallConfig) -> list[str]:
    """Each actor's sockets listen on its Ray node's address, and refuse plaintext beyond
    loopback as they start; asked here of the nodes there are, before anything is deployed,
    so the operator gets one line instead of actors dying on every machine. Answers the
    addresses served in plaintext beyond loopback because of ``--insecure`` (to warn of)."""
    from kvstore.runtime.cluster import node_addresses

    tls = bool(config.tls.cert)  # a whole setting (``TLSConfig``): a certificate serves TLS
    addresses = sorted(set(node_addresses().values()))
    return [a for a in addresses if check_plaintext(a, tls, config.insecure)]


def meta_shards_for(cpus: int) -> int:
    """One meta shard per 2 CPUs of the cluster, 1 to 8. Measured on 2 cores: QueryHit at
    concurrency 16 went from 337 QPS with 4 shards to 401 with 1."""
    return max(1, min(8, cpus // 2))


def run(args: argparse.Namespace) -> int:
    options = _options(args)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise InvalidArgument("--metrics-port", f"must be in [0, 65535], got {args.metrics_port}")
    from kvstore.api.gateway import Gateway
    from kvstore.runtime.cluster import cluster_cpus, connect
    from kvstore.runtime.service import Service

    try:  # checked before Ray starts: a bad flag or variable costs no cluster
        config = ServiceConfig.from_env(
            data_root=args.data_dir.resolve(),
            deployment=args.deployment,
            storage_nodes=args.storage_nodes,
            meta_shards=1 if args.meta_shards is None else args.meta_shards,
            fsync=args.fsync,
            preset=args.preset,
            run_gc=not args.no_gc,
            node_capacity_bytes=args.capacity_bytes,
            block_bytes=args.block_bytes,
        )
    except ConfigError as error:
        field = "capacity_bytes" if error.field == "node_capacity_bytes" else error.field
        flag = f"--{field.replace('_', '-')}"
        name = flag if hasattr(args, field) else error.field
        raise InvalidArgument(name, error.detail) from None
    tenants = _tenants(options, args.data_dir, config.blockstore.traffic_classes)
    data_plane = _data_plane(args.insecure)
    connect(args.address)
    plaintext = _check_data_plane(data_plane)
    if args.meta_shards is None:
        blocks = config.blockstore.with_overrides(meta_shards=meta_shards_for(cluster_cpus()))
        config = dataclasses.replace(config, blockstore=blocks)
    print(
        f"kvstore: deploying {config.blockstore.storage_nodes} storage nodes and "
        f"{config.blockstore.meta_shards} meta shard(s) under {config.data_root} ..."
    )
    service = Service.start(config, address=args.address)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        gateway = Gateway(
            service.tier, options, args.metrics_port, args.metrics_host, tenants=tenants
        )
        try:
            scheme = (
                "mutual TLS"
                if options.tls_client_ca
                else "TLS"
                if options.tls_cert
                else ("plaintext")
            )
            who = (
                f"{len(tenants.tenants())} tenant(s) from {options.tokens_file}"
                if options.tokens_file
                else "one bearer token"
                if options.token
                else "no identity: every caller is the default tenant"
            )
            print(f"kvstore: serving kvstore.v1.KVStore on {gateway.address} ({scheme}; {who})")
            if not is_loopback(options.host) and options.insecure:
                print(
                    "kvstore: WARNING --insecure: reachable beyond loopback without TLS or "
                    "without an identity",
                    file=sys.stderr,
                )
            if plaintext:
                print(
                    "kvstore: WARNING --insecure: the data plane serves every tenant's KV in "
                    f"plaintext on {', '.join(plaintext)} (no KVSTORE_FASTCALL_TLS_*)",
                    file=sys.stderr,
                )
            if gateway.metrics_port is not None:
                print(
                    f"kvstore: metrics on http://{args.metrics_host}:{gateway.metrics_port}/metrics"
                )
            print("kvstore: Ctrl-C to stop", flush=True)
            stop.wait()
            print("kvstore: stopping ...", file=sys.stderr)
        finally:
            gateway.stop()
    finally:
        service.stop()
    print("kvstore: stopped", file=sys.stderr)
    return 0
