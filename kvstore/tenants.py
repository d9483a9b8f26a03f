"""Tenants: who is asking, which keys are theirs, and what they may do (docs/rules.md §10).

Every request is made by an identity (a bearer token from the tokens file, or the common name of
an mTLS client certificate) that maps to one ``Tenant``. A tenant's keys live in its own
namespace: every key a client sends is replaced, before any index, file or directory sees it, by
BLAKE2b-256 keyed with the tenant's secret salt (``namespaced``), so a key another tenant computed
from the same tokens is a different key here — never found, never read, never overwritten. The
salts are HMAC-SHA256(server secret, tenant name): the secret never leaves the server, a tenant
cannot compute its own salt, let alone another's.

A shared namespace (public system prompts) has a salt of its own; a tenant may read it
(``shared = "read"``), write it too (``"write"``: the trusted writer role), or neither. Quotas
(bytes stored, open leases, requests per second) and the traffic classes a tenant may use are
the operator's, in the tokens file, never the client's.

The tokens file (TOML, mode 0600, reread when it changes so tokens rotate without a restart)::

    [tenants.alice]
    tokens = ["alice-token-1", "alice-token-2"]   # list the new one, deploy, drop the old one
    subjects = ["alice-engine"]                   # mTLS client certificate common names
    classes = ["alice"]        # traffic classes it may use; the first is its default
    shared = "read"            # none | read | write
    max_bytes = 500_000_000_000
    max_leases = 10_000        # open leases (the default; at most 100,000)
    max_requests_per_s = 5000
    admin = false              # may see the whole tier's figures (GetStats)
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import os
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.privatefs import check_private_file, create_private_file

_native: ModuleType | None
try:  # one C call for a whole key array; hashlib gives the same digests one call per key
    from kvstore import _blake2b as _native
except ImportError:  # pragma: no cover - the CI machine builds it
    _native = None

log = logging.getLogger(__name__)

SharedAccess = Literal["none", "read", "write"]
_SHARED = ("none", "read", "write")
#: The tenant of a gateway that needs no identity (loopback, no tokens file) and of in-cluster
#: callers that name none.
DEFAULT_TENANT = "default"
_SALT_LABEL = b"kvstore.tenant.salt.v1\x00"
_SHARED_LABEL = b"kvstore.shared.salt.v1"
_SECRET_BYTES = 32
#: What one tenant's max_leases may be: the gateway's whole lease table
#: (``kvstore.tier.leases.MAX_OPEN_LEASES``).
MAX_TENANT_LEASES = 100_000
_RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class Tenant:
    name: str
    #: Salt of the tenant's own namespace (HMAC of the server secret and the name).
    salt: bytes = field(repr=False)
    #: Salt of the shared namespace (the same for every tenant).
    shared_salt: bytes = field(repr=False)
    shared: SharedAccess = "none"
    #: Traffic classes it may use (None: every class); the first is its default.
    classes: tuple[str, ...] | None = None
    max_bytes: int | None = None
    max_leases: int | None = None
    max_requests_per_s: float | None = None
    admin: bool = False
    #: Of ``classes``, those no other tenant may use: their class-wide figures (bytes stored,
    #: evictions) are this tenant's alone, so only these are shown to it.
    exclusive_classes: tuple[str, ...] = ()

    @property
    def reads_shared(self) -> bool:
        return self.shared in ("read", "write")

    def traffic_class(self, asked: str) -> str:
        """The class a request of this tenant is stored under: the one it asked for if allowed,
        its default when it named none. Raises ``PermissionError`` naming the class."""
        if self.classes is None:
            return asked  # any class; the tier's default when none is named
        if not asked:
            return self.classes[0]
        if asked not in self.classes:
            raise PermissionError(
                f"traffic class {asked!r} is not one of tenant {self.name!r}'s "
                f"({', '.join(self.classes)})"
            )
        return asked


def namespaced(salt: bytes, words: np.ndarray) -> np.ndarray:
    """Keys ((n, 4) uint64 words of 32-byte keys) in the namespace of ``salt``, as words."""
    raw = np.ascontiguousarray(words, dtype=np.uint64)
    out = np.empty_like(raw)
    if _native is not None:
        _native.keyed_hash(salt, raw, out)
        return out
    flat = raw.view(np.uint8).reshape(-1, KEY_BYTES)
    target = out.view(np.uint8).reshape(-1, KEY_BYTES)
    for row in range(flat.shape[0]):
        target[row] = np.frombuffer(
            hashlib.blake2b(flat[row].tobytes(), key=salt, digest_size=KEY_BYTES).digest(),
            dtype=np.uint8,
        )
    return out


def namespaced_key(salt: bytes, key: bytes) -> BlockKey:
    """One key in the namespace of ``salt`` (the same digest ``namespaced`` gives)."""
    return BlockKey(hashlib.blake2b(bytes(key), key=salt, digest_size=KEY_BYTES).digest())


def salts(secret: bytes, name: str) -> tuple[bytes, bytes]:
    """(the tenant's own salt, the shared namespace's salt) under ``secret``."""
    own = hmac.new(secret, _SALT_LABEL + name.encode(), hashlib.sha256).digest()
    return own, hmac.new(secret, _SHARED_LABEL, hashlib.sha256).digest()


def load_secret(path: Path) -> bytes:
    """The server secret in ``path``, made (32 random bytes, 0600, never overwritten) if the
    file does not exist. A secret readable by group or others is refused: with it and the tenant
    names, anyone computes every namespace."""
    if not path.exists():
        create_private_file(path, os.urandom(_SECRET_BYTES), "tenant_secret")
    check_private_file(path, "tenant_secret")
    secret = path.read_bytes()
    if len(secret) < 16:
        raise ConfigError("tenant_secret", f"{path} holds {len(secret)} bytes; at least 16 needed")
    return secret


class TenantDirectory:
    """Token → tenant and certificate subject → tenant, from the tokens file (reread when its
    modification time changes, at most once a second) or from one static token."""

    def __init__(
        self,
        secret: bytes,
        *,
        tokens_file: Path | None = None,
        static_token: str | None = None,
    ) -> None:
        self._secret = secret
        self._path = tokens_file
        self._lock = threading.Lock()
        self._checked = 0.0
        self._mtime: float | None = None
        self._refused_mtime: float | None = None
        self._by_token: dict[bytes, Tenant] = {}  # SHA-256 of the token -> tenant
        self._by_subject: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        if tokens_file is not None:
            self._load()
        elif static_token is not None:
            tenant = self.default()
            self._install({DEFAULT_TENANT: tenant}, {_digest(static_token.encode()): tenant}, {})

    @property
    def requires_identity(self) -> bool:
        """False for an open gateway (loopback, no tokens): everyone is the default tenant."""
        return self._path is not None or bool(self._by_token)

    def make(self, name: str, **policy: Any) -> Tenant:
        own, shared = salts(self._secret, name)
        return Tenant(name, own, shared, **policy)

    def default(self) -> Tenant:
        """The one tenant of a gateway without a tokens file (open, or one static token): it
        is the whole tier's only user, so it sees the whole tier's figures."""
        return self._tenants.get(DEFAULT_TENANT) or self.make(DEFAULT_TENANT, admin=True)

    def tenants(self) -> dict[str, Tenant]:
        self._maybe_reload()
        return dict(self._tenants)

    def by_token(self, token: bytes) -> Tenant | None:
        """The tenant of a bearer token. Looked up by the token's SHA-256: how long a lookup
        takes tells nothing about the tokens (a timing attack learns at most digest bits)."""
        self._maybe_reload()
        return self._by_token.get(_digest(token))

    def by_subject(self, subject: str) -> Tenant | None:
        self._maybe_reload()
        return self._by_subject.get(subject)

    # --- loading --------------------------------------------------------------------------

    def _maybe_reload(self) -> None:
        if self._path is None or time.monotonic() - self._checked < _RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = time.monotonic()
            try:
                mtime = os.stat(self._path).st_mtime
            except OSError:
                return  # keep serving with what was loaded; the operator sees it in the log
            if mtime not in (self._mtime, self._refused_mtime):
                try:
                    self._load()
                except ConfigError as error:
                    # A broken edit must not lock everyone out: the previous tokens stay (said
                    # once per edit, not once a second).
                    self._refused_mtime = mtime
                    log.error("tokens file not reloaded, the previous tokens stay: %s", error)

    def _load(self) -> None:
        assert self._path is not None
        check_private_file(self._path, "tokens_file")
        mtime = os.stat(self._path).st_mtime
        try:
            document = tomllib.loads(self._path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError("tokens_file", f"cannot parse {self._path}: {error}") from error
        tables = document.get("tenants")
        if not isinstance(tables, Mapping) or not tables:
            raise ConfigError("tokens_file", f"{self._path} has no [tenants.<name>] table")
        tenants: dict[str, Tenant] = {}
        by_token: dict[bytes, Tenant] = {}
        by_subject: dict[str, Tenant] = {}
        for name, table in tables.items():
            tenant, tokens, subjects = self._parse(str(name), table)
            tenants[tenant.name] = tenant
            for token in tokens:
                digest = _digest(token.encode())
                if digest in by_token:
                    raise ConfigError(f"tenants.{name}.tokens", "a token is given twice")
                by_token[digest] = tenant
            for subject in subjects:
                if subject in by_subject:
                    raise ConfigError(
                        f"tenants.{name}.subjects",
                        f"{subject!r} is already {by_subject[subject].name!r}'s",
                    )
                by_subject[subject] = tenant
        tenants = self._check_classes(tenants)
        by_token = {digest: tenants[t.name] for digest, t in by_token.items()}
        by_subject = {subject: tenants[t.name] for subject, t in by_subject.items()}
        self._install(tenants, by_token, by_subject)
        self._mtime = mtime

    def _install(
        self,
        tenants: dict[str, Tenant],
        by_token: dict[bytes, Tenant],
        by_subject: dict[str, Tenant],
    ) -> None:
        self._tenants, self._by_token, self._by_subject = tenants, by_token, by_subject

    def _parse(self, name: str, table: object) -> tuple[Tenant, list[str], list[str]]:
        where = f"tenants.{name}"
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(where, "a tenant name is letters, digits, - and _")
        if not isinstance(table, Mapping):
            raise ConfigError(where, "must be a table")
        known = {
            "tokens",
            "subjects",
            "classes",
            "shared",
            "max_bytes",
            "max_leases",
            "max_requests_per_s",
            "admin",
        }
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; known: {sorted(known)}")
        tokens = _strings(table.get("tokens", []), f"{where}.tokens")
        if any(len(token) < 16 for token in tokens):
            raise ConfigError(f"{where}.tokens", "a token must be at least 16 characters")
        subjects = _strings(table.get("subjects", []), f"{where}.subjects")
        if not tokens and not subjects:
            raise ConfigError(where, "give tokens or subjects: a tenant nobody can be is no use")
        classes = table.get("classes")
        shared = table.get("shared", "none")
        if shared not in _SHARED:
            raise ConfigError(f"{where}.shared", f"must be one of {_SHARED}, got {shared!r}")
        admin = table.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"{where}.admin", "must be true or false")
        max_leases = _limit(table.get("max_leases"), f"{where}.max_leases", integer=True)
        if max_leases is not None and max_leases > MAX_TENANT_LEASES:
            raise ConfigError(
                f"{where}.max_leases",
                f"at most {MAX_TENANT_LEASES} (what the gateway's lease table holds for all)",
            )
        tenant = self.make(
            name,
            shared=shared,
            classes=None if classes is None else tuple(_strings(classes, f"{where}.classes")),
            max_bytes=_limit(table.get("max_bytes"), f"{where}.max_bytes", integer=True),
            max_leases=max_leases,
            max_requests_per_s=_limit(
                table.get("max_requests_per_s"), f"{where}.max_requests_per_s", integer=False
            ),
            admin=admin,
        )
        if tenant.classes == ():
            raise ConfigError(f"{where}.classes", "name at least one class (or leave it out)")
        if tenant.max_bytes is not None and tenant.classes is None:
            raise ConfigError(
                f"{where}.max_bytes",
                "caps the bytes stored in the tenant's classes: give it classes of its own",
            )
        return tenant, tokens, subjects

    @staticmethod
    def _check_classes(tenants: dict[str, Tenant]) -> dict[str, Tenant]:
        """Mark each tenant's exclusive classes; a tenant with a ``max_bytes`` quota (counted
        over its classes) must have them to itself, or another could fill them — and then
        every tenant must name its classes, since one allowed every class could too."""
        users: dict[str, list[str]] = {}
        for name, tenant in tenants.items():
            for cls in tenant.classes or ():
                users.setdefault(cls, []).append(name)
        capped = sorted(name for name, t in tenants.items() if t.max_bytes is not None)
        if capped:
            for name, tenant in sorted(tenants.items()):
                if tenant.classes is None:
                    raise ConfigError(
                        f"tenants.{name}.classes",
                        f"name its classes: tenant {capped[0]!r} has a max_bytes quota counted "
                        "over its classes, which a tenant allowed every class could fill",
                    )
            for name in capped:
                for cls in tenants[name].classes or ():
                    others = [other for other in users[cls] if other != name]
                    if others:
                        raise ConfigError(
                            f"tenants.{name}.classes",
                            f"class {cls!r} is also {others[0]!r}'s: a max_bytes quota needs "
                            "classes of the tenant's own",
                        )
        return {
            name: dataclasses.replace(
                tenant,
                exclusive_classes=tuple(
                    cls for cls in tenant.classes or () if users.get(cls) == [name]
                ),
            )
            for name, tenant in tenants.items()
        }


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(where, "must be a list of strings")
    out = []
    for item in value:
        if not isinstance(item, str) or not item or not item.isprintable():
            raise ConfigError(where, "must be a list of non-empty printable strings")
        out.append(item)
    return out


def _limit(value: object, where: str, *, integer: bool) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(where, f"must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(where, f"must be > 0, got {value!r}")
    if integer and value != int(value):  # 5e11 is fine, 0.5 leases is not
        raise ConfigError(where, f"must be a whole number, got {value!r}")
    return int(value) if integer else float(value)


class RateLimiter:
    """A token bucket per tenant: ``max_requests_per_s`` with a one-second burst."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, last time)
        self._lock = threading.Lock()

    def allow(self, tenant: Tenant, now: float | None = None) -> bool:
        rate = tenant.max_requests_per_s
        if rate is None:
            return True
        now = time.monotonic() if now is None else now
        burst = max(rate, 1.0)  # a rate below 1/s still lets one request through now and then
        with self._lock:
            tokens, last = self._buckets.get(tenant.name, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1:
                self._buckets[tenant.name] = (tokens, now)
                return False
            self._buckets[tenant.name] = (tokens - 1, now)
            return True
