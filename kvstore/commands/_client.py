"""Options and helpers shared by the sub-commands that talk to a running gateway over gRPC."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import grpc

from kvstore.commands import _output
from kvstore.errors import InvalidArgument, StoreError

DEFAULT_SERVER = "127.0.0.1:50051"


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        metavar="HOST:PORT",
        help=f"gateway address printed by `kvstore up` (default {DEFAULT_SERVER})",
    )
    group.add_argument("--token-file", type=Path, help="file holding the bearer token (mode 0600)")
    group.add_argument("--tls-root-cert", type=Path, help="PEM root certificate for TLS")
    group.add_argument(
        "--tls-client-cert",
        type=Path,
        help="PEM client certificate, for a gateway that requires mutual TLS (with "
        "--tls-client-key and --tls-root-cert)",
    )
    group.add_argument("--tls-client-key", type=Path, help="PEM key of --tls-client-cert")
    group.add_argument("--timeout", type=float, default=30.0, help="seconds per call (default 30)")


def connect(args: argparse.Namespace) -> Any:
    from kvstore.api.client import KVStoreClient
    from kvstore.api.server import read_token_file
    from kvstore.errors import ConfigError

    token = None
    if args.token_file is not None:
        try:
            token = read_token_file(args.token_file)  # refused if others may read it
        except ConfigError as error:
            raise InvalidArgument("--token-file", error.detail) from None
    if args.timeout <= 0:
        raise InvalidArgument("--timeout", f"must be > 0, got {args.timeout}")
    try:
        return KVStoreClient(
            args.server,
            token=token,
            tls_root_cert=args.tls_root_cert,
            timeout_s=args.timeout,
            tls_client_cert=args.tls_client_cert,
            tls_client_key=args.tls_client_key,
        )
    except InvalidArgument as error:
        raise InvalidArgument(f"--{error.argument.replace('_', '-')}", error.detail) from None
    except OSError as error:
        raise InvalidArgument("--tls-root-cert", f"cannot read a TLS file: {error}") from None


def rpc_error(error: grpc.RpcError, server: str) -> StoreError:
    """One readable line for a failed call."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        return StoreError(f"no kvstore gateway answering at {server} ({details})")
    name = code.name if code is not None else "ERROR"
    return StoreError(f"{name}: {details}")


def print_json(value: Any) -> None:
    """The command's one JSON document (see ``kvstore.commands._output``)."""
    _output.print_json(value)
