"""A real deployment (on the session Ray cluster) behind a real gateway on port 0 with a tokens
file of five tenants, for the adversarial tests of issue 15.

The tenants: ``alice`` (reads the shared namespace), ``bob`` (the attacker: no shared access, a
cap of 8 leases), ``publisher`` (the trusted writer of the shared namespace), ``carol`` (only
the "agent" class, at most 3 blocks stored, 5 requests a second) and ``ops`` (admin figures).
With a quota in the file every tenant names its classes (no one else may fill carol's).

Reproducing a finding on the code before the fix: that code has no tokens file, only one
bearer token, so ``Tenants`` falls back to giving every tenant that one token — exactly what an
attacker holding any valid token had. Each test then fails there for the reason it guards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvstore.api.client import KVStoreClient
from kvstore.api.server import ServerOptions
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.geometry import GeometryConfig
from kvstore.runtime.service import RunningService, embedded_service

BLOCK = GeometryConfig.default().block_bytes
TOKENS = {
    "alice": "alice-token-00000000000001",
    "bob": "bob-token-000000000000000001",
    "publisher": "publisher-token-0000000001",
    "carol": "carol-token-00000000000001",
    "ops": "ops-token-0000000000000001",
}
TOKENS_FILE = f"""
[tenants.alice]
tokens = ["{TOKENS["alice"]}"]
subjects = ["alice-engine"]
classes = ["chatbot", "default"]
shared = "read"

[tenants.bob]
tokens = ["{TOKENS["bob"]}"]
classes = ["chatbot", "default"]
max_leases = 8

[tenants.publisher]
tokens = ["{TOKENS["publisher"]}"]
classes = ["chatbot"]
shared = "write"

[tenants.carol]
tokens = ["{TOKENS["carol"]}"]
classes = ["agent"]
max_bytes = {3 * BLOCK}
max_requests_per_s = 5

[tenants.ops]
tokens = ["{TOKENS["ops"]}"]
classes = ["default"]
admin = true
"""


def write_private(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@dataclass
class Tenants:
    running: RunningService
    tokens: dict[str, str]
    tokens_file: Path | None

    @property
    def address(self) -> str:
        return self.running.address

    def client(self, name: str, **options: object) -> KVStoreClient:
        return KVStoreClient(self.address, token=self.tokens[name], **options)  # type: ignore[arg-type]

    def auth(self, name: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[name]}"),)


def tenant_options(tmp: Path, **extra: object) -> tuple[ServerOptions, dict[str, str], Path | None]:
    tokens_file = write_private(tmp / "tokens.toml", TOKENS_FILE)
    try:
        options = ServerOptions(
            tokens_file=tokens_file, tenant_secret_file=tmp / "tenant.secret", **extra
        )  # type: ignore[arg-type]
    except TypeError:  # the code before issue 15: one token, shared by everyone
        shared = "one-token-for-every-tenant-0001"
        return ServerOptions(token=shared), dict.fromkeys(TOKENS, shared), None
    return options, dict(TOKENS), tokens_file


@pytest.fixture(scope="package")
def tenants(ray_cluster, tmp_path_factory) -> Iterator[Tenants]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("tenants")
    options, tokens, tokens_file = tenant_options(tmp)
    with embedded_service(
        tmp / "data",
        cluster=ray_cluster,
        deployment="security-tenants",
        fsync="never",
        run_gc=False,
        options=options,
        metrics_port=0,
    ) as running:
        yield Tenants(running, tokens, tokens_file)


@pytest.fixture()
def stub(tenants: Tenants) -> Iterator[pb_grpc.KVStoreStub]:
    with grpc.insecure_channel(tenants.address) as channel:
        yield pb_grpc.KVStoreStub(channel)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask of a login shell: what made the dirs 0755 and the files 0644."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)
