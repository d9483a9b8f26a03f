"""Security review of ``kvstore up`` (issue 15), finding 9 (exposure) and identities.

Reproduced: ``--host 0.0.0.0`` needed neither TLS nor a token and said nothing; the metrics
endpoint fanned out to every meta shard on every scrape; two ``authorization`` headers — the
last one won; the token file's mode was not checked; one static token, no rotation; packed keys
skipped the ``prompt_len`` check; GetSWAState ignored ``position``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from certs import LOOPBACK_SAN, ca_signed
from conftest import TOKENS_FILE, Tenants, write_private
from prometheus_client import generate_latest
from test_tenants import payloads, prompt

from kvstore.api.client import KVStoreClient
from kvstore.api.gateway import Gateway
from kvstore.api.metrics import ApiMetrics
from kvstore.api.server import ServerOptions, read_token_file
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import ConfigError
from kvstore.tier.records import HitRequest, Stats


def test_serving_beyond_loopback_needs_tls_and_an_identity(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    for options in (
        {},
        {"token": "t" * 20},
        {"tls_cert": cert, "tls_key": key},
    ):
        with pytest.raises(ConfigError) as error:
            ServerOptions(host="0.0.0.0", **options)  # type: ignore[arg-type]
        assert error.value.field == "host" and "--insecure" in str(error.value)
    ServerOptions(host="0.0.0.0", token="t" * 20, tls_cert=cert, tls_key=key)
    ServerOptions(host="0.0.0.0", insecure=True)  # the operator said so
    ServerOptions(host="127.0.0.1")  # loopback needs neither
    # The command refuses before any cluster starts, in one line naming the flag.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore.cli",
            "up",
            "--host",
            "0.0.0.0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--host" in done.stderr and "TLS" in done.stderr and "Traceback" not in done.stderr


def test_metrics_serve_cached_figures_on_loopback() -> None:
    calls = []

    def stats() -> Stats:
        calls.append(time.monotonic())
        return Stats(storage_nodes=12)

    metrics = ApiMetrics(stats)
    for _ in range(16):  # 16 scrapers: one fan-out, not 16
        assert b"kvstore_storage_nodes" in generate_latest(metrics.registry)
    assert len(calls) == 1
    import argparse

    from kvstore.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--metrics-port", "9464"])
    assert args.metrics_host == "127.0.0.1"  # wherever the gateway binds


def test_two_authorization_headers_are_refused(stub: pb_grpc.KVStoreStub, tenants: Tenants) -> None:
    both = tenants.auth("bob") + tenants.auth("alice")
    with pytest.raises(grpc.RpcError) as error:
        stub.GetStats(pb.GetStatsRequest(), metadata=both, timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization headers" in (error.value.details() or "")


def test_token_files_readable_by_others_are_refused(tmp_path: Path) -> None:
    loose = tmp_path / "token"
    loose.write_text("a-token-of-twenty-chars\n")
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="group or others"):
        read_token_file(loose)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS_FILE)
    os.chmod(tokens, 0o640)
    with pytest.raises(ConfigError, match="group or others"):
        ServerOptions(tokens_file=tokens).tenant_directory()
    os.chmod(loose, 0o600)
    assert read_token_file(loose) == "a-token-of-twenty-chars"


def test_tokens_rotate_without_a_restart(tenants: Tenants, tmp_path: Path) -> None:
    assert tenants.tokens_file is not None
    tokens_file = write_private(tmp_path / "tokens.toml", TOKENS_FILE)
    secret = tmp_path / "tenant.secret"
    shutil.copy(tenants.tokens_file.parent / "tenant.secret", secret)
    os.chmod(secret, 0o600)
    gateway = Gateway(
        tenants.running.tier, ServerOptions(tokens_file=tokens_file, tenant_secret_file=secret)
    )
    old, new = tenants.tokens["alice"], "alice-token-rotated-000002"
    try:
        _, keys = prompt(tenants, 401, 2)
        with KVStoreClient(gateway.address, token=old) as alice:
            alice.put_blocks(keys, payloads(keys), "chatbot")
        # Deploy the new token next to the old one, then drop the old one.
        time.sleep(1.1)  # a new modification time
        write_private(tokens_file, TOKENS_FILE.replace(f'"{old}"', f'"{old}", "{new}"'))
        _eventually(lambda: _answers(gateway.address, new))
        time.sleep(1.1)
        write_private(tokens_file, TOKENS_FILE.replace(f'"{old}"', f'"{new}"'))
        _eventually(lambda: not _answers(gateway.address, old))
        with KVStoreClient(gateway.address, token=new) as alice:  # the same tenant, same data
            assert [r.payload for r in alice.get_blocks(keys)] == payloads(keys)
    finally:
        gateway.stop()


def _answers(address: str, token: str) -> bool:
    with KVStoreClient(address, token=token, timeout_s=10) as client:
        try:
            client.stats()
            return True
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            return False


def _eventually(check, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "the tokens file was not reloaded"
        time.sleep(0.2)


def test_packed_keys_are_checked_against_prompt_len(
    stub: pb_grpc.KVStoreStub, tenants: Tenants
) -> None:
    request = pb.QueryHitRequest(block_keys_packed=bytes(range(96)), prompt_len=200)
    with pytest.raises(grpc.RpcError) as error:
        stub.QueryHit(request, metadata=tenants.auth("alice"), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith("prompt_len:")


def test_a_state_is_found_only_at_its_own_position(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 402, 3)
    size = tenants.running.tier.state_size
    state = (bytes(range(256)) * (size // 256 + 1))[:size]
    with tenants.client("alice") as alice:
        alice.put_swa_state(keys[2], 384, state)
        assert alice.get_swa_state(keys[2], 384).state == state
        for elsewhere in (256, 512, 128 * 1000):
            assert alice.get_swa_state(keys[2], elsewhere).state is None


def test_a_client_certificate_is_an_identity(tenants: Tenants, tmp_path: Path) -> None:
    assert tenants.tokens_file is not None
    pki = ca_signed(
        tmp_path,
        {
            "server": ("localhost", LOOPBACK_SAN),
            "alice": ("alice-engine", "extendedKeyUsage=clientAuth"),
            "stranger": ("stranger", "extendedKeyUsage=clientAuth"),
        },
    )
    gateway = Gateway(
        tenants.running.tier,
        ServerOptions(
            tokens_file=tenants.tokens_file,
            tenant_secret_file=tenants.tokens_file.parent / "tenant.secret",
            tls_cert=pki["server.pem"],
            tls_key=pki["server.key"],
            tls_client_ca=pki["ca.pem"],
        ),
    )
    tokens, keys = prompt(tenants, 403, 2)
    try:
        with tenants.client("alice") as alice:  # by token, on the plain gateway
            alice.put_blocks(keys, payloads(keys), "chatbot")

        def client(name: str | None) -> KVStoreClient:
            return KVStoreClient(
                gateway.address.replace("127.0.0.1", "localhost"),
                tls_root_cert=pki["ca.pem"],
                tls_client_cert=None if name is None else pki[f"{name}.pem"],
                tls_client_key=None if name is None else pki[f"{name}.key"],
                timeout_s=10,
            )

        with client("alice") as alice:  # by certificate: the same tenant, the same namespace
            answer = alice.query_hit(HitRequest(token_ids=tokens, take_lease=False))
            assert answer.plan.block_hit_tokens == 256
        with client("stranger") as stranger:
            with pytest.raises(grpc.RpcError) as error:
                stranger.stats()
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with client(None) as anonymous:  # no certificate: the TLS handshake itself fails
            with pytest.raises(grpc.RpcError) as error:
                anonymous.stats()
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gateway.stop()
