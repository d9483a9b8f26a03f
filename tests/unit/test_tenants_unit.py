"""Tenants (``kvstore.tenants``): the tokens file and its reload, salts, the server secret, the
per-tenant rate limit and traffic classes. Every bad input of the tokens file is a ConfigError
whose ``field`` names the key the operator has to fix."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.privatefs import check_private_file
from kvstore.tenants import (
    DEFAULT_TENANT,
    RateLimiter,
    Tenant,
    TenantDirectory,
    load_secret,
    salts,
)

SECRET = b"s" * 32
ALICE_1 = "alice-token-0001"
ALICE_2 = "alice-token-0002"
BOB_1 = "bob-token-000001"

GOOD = f"""
[tenants.alice]
tokens = ["{ALICE_1}", "{ALICE_2}"]
subjects = ["alice-engine"]
classes = ["agent", "chatbot"]
shared = "read"
max_bytes = 500_000_000_000
max_leases = 100
max_requests_per_s = 5000
admin = false

[tenants.bob-2_x]
tokens = ["{BOB_1}"]
classes = ["default"]
shared = "write"
admin = true

[tenants.carol]
subjects = ["carol-engine", "carol-batch"]
classes = ["default"]
"""


def write_private(path: Path, text: str, *, mtime: float | None = None) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def directory_of(tmp_path: Path, text: str) -> TenantDirectory:
    return TenantDirectory(SECRET, tokens_file=write_private(tmp_path / "tokens.toml", text))


# --- parsing ------------------------------------------------------------------------------------


def test_a_good_file_maps_tokens_and_subjects_to_their_tenants(tmp_path: Path) -> None:
    directory = directory_of(tmp_path, GOOD)
    tenants = directory.tenants()
    assert sorted(tenants) == ["alice", "bob-2_x", "carol"]
    alice = tenants["alice"]
    assert directory.by_token(ALICE_1.encode()) is alice
    assert directory.by_token(ALICE_2.encode()) is alice
    assert directory.by_token(BOB_1.encode()) is tenants["bob-2_x"]
    assert directory.by_token(b"not-a-token-at-all") is None
    assert directory.by_subject("alice-engine") is alice
    assert directory.by_subject("carol-batch") is tenants["carol"]
    assert directory.by_subject("nobody") is None
    assert (alice.classes, alice.shared, alice.admin) == (("agent", "chatbot"), "read", False)
    assert (alice.max_bytes, alice.max_leases, alice.max_requests_per_s) == (
        500_000_000_000,
        100,
        5000.0,
    )
    assert isinstance(alice.max_requests_per_s, float)
    bob = tenants["bob-2_x"]
    assert (bob.classes, bob.shared, bob.admin, bob.max_bytes, bob.max_leases) == (
        ("default",),
        "write",
        True,
        None,
        None,
    )
    carol = tenants["carol"]
    assert (carol.shared, carol.reads_shared, alice.reads_shared, bob.reads_shared) == (
        "none",
        False,
        True,
        True,
    )
    assert directory.requires_identity
    # The salts are those of the secret and the name.
    assert (alice.salt, alice.shared_salt) == salts(SECRET, "alice")


def _tenant(body: str, name: str = "alice") -> str:
    return f"[tenants.{name}]\n{body}\n"


TOKEN = f'tokens = ["{ALICE_1}"]'


BAD_INPUTS = [
    (_tenant(f"{TOKEN}\ncolour = 'red'"), "tenants.alice.colour"),
    (_tenant('tokens = ["short-token"]'), "tenants.alice.tokens"),
    (_tenant(f'tokens = ["{ALICE_1}", "{ALICE_1}"]'), "tenants.alice.tokens"),
    (_tenant(TOKEN) + _tenant(f'tokens = ["{ALICE_1}"]', "bob"), "tenants.bob.tokens"),
    (_tenant(f"{TOKEN}\nshared = 'all'"), "tenants.alice.shared"),
    (_tenant(f"{TOKEN}\nshared = true"), "tenants.alice.shared"),
    (_tenant(f"{TOKEN}\nmax_bytes = 1000"), "tenants.alice.max_bytes"),
    (_tenant(f"{TOKEN}\nclasses = []"), "tenants.alice.classes"),
    (_tenant(f"{TOKEN}\nclasses = []\nmax_bytes = 1000"), "tenants.alice.classes"),
    (_tenant(f"{TOKEN}\nclasses = ['agent', '']"), "tenants.alice.classes"),
    (_tenant(f"{TOKEN}\nclasses = 'agent'"), "tenants.alice.classes"),
    (_tenant('tokens = "alice-token-0001"'), "tenants.alice.tokens"),
    (_tenant("tokens = [1234567890123456789]"), "tenants.alice.tokens"),
    (_tenant("subjects = []"), "tenants.alice"),
    (_tenant('subjects = ["bad\\nname"]'), "tenants.alice.subjects"),
    (_tenant(f"{TOKEN}\nadmin = 'yes'"), "tenants.alice.admin"),
    (_tenant(f"{TOKEN}\nmax_leases = 0"), "tenants.alice.max_leases"),
    (_tenant(f"{TOKEN}\nmax_leases = true"), "tenants.alice.max_leases"),
    (_tenant(f"{TOKEN}\nmax_requests_per_s = -1"), "tenants.alice.max_requests_per_s"),
    (_tenant(f"{TOKEN}\nmax_requests_per_s = nan"), "tenants.alice.max_requests_per_s"),
    (_tenant(f"{TOKEN}\nmax_requests_per_s = inf"), "tenants.alice.max_requests_per_s"),
    (_tenant(f"{TOKEN}\nmax_requests_per_s = '5'"), "tenants.alice.max_requests_per_s"),
    (_tenant(TOKEN, '"al ice"'), "tenants.al ice"),
    (_tenant(TOKEN, '"a.b"'), "tenants.a.b"),
    ("[tenants]\nalice = 3\n", "tenants.alice"),
    ("[tenants]\n", "tokens_file"),
    ("[other]\nx = 1\n", "tokens_file"),
    ("tenants = 3\n", "tokens_file"),
    ("[tenants.alice\n", "tokens_file"),
]


@pytest.mark.parametrize(
    ("text", "field"),
    BAD_INPUTS,
    ids=[f"{index}-{field}" for index, (_, field) in enumerate(BAD_INPUTS)],
)
def test_each_bad_input_is_refused_naming_its_key(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        directory_of(tmp_path, text)
    assert raised.value.field == field, raised.value


def test_a_duplicate_token_across_tenants_names_the_second_one(tmp_path: Path) -> None:
    text = _tenant(TOKEN) + _tenant(f'tokens = ["{BOB_1}", "{ALICE_1}"]', "bob")
    with pytest.raises(ConfigError, match="twice") as raised:
        directory_of(tmp_path, text)
    assert raised.value.field == "tenants.bob.tokens"


def test_a_tokens_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = write_private(tmp_path / "tokens.toml", GOOD)
    for mode in (0o644, 0o640, 0o604, 0o660):
        os.chmod(path, mode)
        with pytest.raises(ConfigError, match="chmod 600") as raised:
            TenantDirectory(SECRET, tokens_file=path)
        assert raised.value.field == "tokens_file"
    os.chmod(path, 0o400)  # read-only for its owner is fine
    assert sorted(TenantDirectory(SECRET, tokens_file=path).tenants()) == [
        "alice",
        "bob-2_x",
        "carol",
    ]


def test_a_missing_or_linked_tokens_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        TenantDirectory(SECRET, tokens_file=tmp_path / "absent.toml")
    assert raised.value.field == "tokens_file"
    target = write_private(tmp_path / "real.toml", GOOD)
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="regular file") as raised:
        TenantDirectory(SECRET, tokens_file=link)
    assert raised.value.field == "tokens_file"
    (tmp_path / "a-dir").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="regular file"):
        check_private_file(tmp_path / "a-dir", "tokens_file")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a file to another uid")
def test_a_tokens_file_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    path = write_private(tmp_path / "tokens.toml", GOOD)
    os.chown(path, os.geteuid() + 4242, -1)
    with pytest.raises(ConfigError, match="owned by uid") as raised:
        TenantDirectory(SECRET, tokens_file=path)
    assert raised.value.field == "tokens_file"


@pytest.mark.parametrize("key", ["max_leases", "max_bytes"])
def test_a_fractional_integer_limit_is_refused(tmp_path: Path, key: str) -> None:
    text = _tenant(f"{TOKEN}\nclasses = ['agent']\n{key} = 0.5")
    with pytest.raises(ConfigError) as raised:
        directory_of(tmp_path, text)
    assert raised.value.field == f"tenants.alice.{key}"


def test_a_subject_given_to_two_tenants_is_refused(tmp_path: Path) -> None:
    text = _tenant('subjects = ["shared-cn"]') + _tenant('subjects = ["shared-cn"]', "bob")
    with pytest.raises(ConfigError) as raised:
        directory_of(tmp_path, text)
    assert raised.value.field == "tenants.bob.subjects"


def test_without_a_tokens_file_the_directory_is_open_or_one_static_token() -> None:
    open_directory = TenantDirectory(SECRET)
    assert not open_directory.requires_identity
    default = open_directory.default()
    assert (default.name, default.admin, default.classes) == (DEFAULT_TENANT, True, None)
    assert open_directory.by_token(b"anything-at-all-0") is None
    static = TenantDirectory(SECRET, static_token="the-static-token-1")
    assert static.requires_identity
    tenant = static.by_token(b"the-static-token-1")
    assert tenant is not None and tenant.name == DEFAULT_TENANT and tenant.admin
    assert static.default() is tenant
    assert static.by_token(b"the-static-token-2") is None
    assert static.tenants() == {DEFAULT_TENANT: tenant}


# --- reload -------------------------------------------------------------------------------------


def test_a_rewritten_file_is_reread_after_a_second(tmp_path: Path) -> None:
    path = write_private(tmp_path / "tokens.toml", GOOD, mtime=1_700_000_000)
    directory = TenantDirectory(SECRET, tokens_file=path)
    alice = directory.by_token(ALICE_1.encode())
    assert alice is not None and alice.max_leases == 100
    rotated = GOOD.replace(f'"{ALICE_1}", "{ALICE_2}"', '"alice-token-0003"').replace(
        "max_leases = 100", "max_leases = 7"
    )
    write_private(path, rotated, mtime=1_700_000_100)
    time.sleep(1.1)  # the file is looked at at most once a second
    new = directory.by_token(b"alice-token-0003")
    assert new is not None and new.name == "alice" and new.max_leases == 7
    assert directory.by_token(ALICE_1.encode()) is None
    assert directory.by_token(ALICE_2.encode()) is None
    assert directory.tenants()["alice"] is new
    # Same name, same secret: the same namespace after the rotation.
    assert (new.salt, new.shared_salt) == (alice.salt, alice.shared_salt)


def test_a_broken_edit_keeps_the_previous_tokens_until_it_is_fixed(tmp_path: Path) -> None:
    path = write_private(tmp_path / "tokens.toml", GOOD, mtime=1_700_000_000)
    directory = TenantDirectory(SECRET, tokens_file=path)
    before = directory.tenants()
    # A short token (a ConfigError) and a mode others can read, with a new modification time.
    write_private(path, GOOD.replace(BOB_1, "short"), mtime=1_700_000_100)
    os.chmod(path, 0o644)
    time.sleep(1.1)
    alice = directory.by_token(ALICE_1.encode())
    assert alice is not None and alice is before["alice"]
    assert directory.by_token(BOB_1.encode()) is before["bob-2_x"]
    assert directory.by_subject("carol-engine") is before["carol"]
    # Fixed (same mtime as the broken one would not count: give it a new one): reread.
    write_private(path, GOOD.replace(BOB_1, "bob-token-000002"), mtime=1_700_000_200)
    time.sleep(1.1)
    assert directory.by_token(BOB_1.encode()) is None
    bob = directory.by_token(b"bob-token-000002")
    assert bob is not None and bob.name == "bob-2_x"


# --- salts and the secret -----------------------------------------------------------------------


def test_salts_differ_per_tenant_and_per_secret_the_shared_one_per_secret_only() -> None:
    other_secret = b"t" * 32
    own_a, shared_a = salts(SECRET, "alice")
    own_b, shared_b = salts(SECRET, "bob")
    own_a2, shared_a2 = salts(other_secret, "alice")
    assert len({own_a, own_b, own_a2, shared_a, shared_a2}) == 5
    assert shared_a == shared_b  # one shared namespace for every tenant of a server
    assert shared_a != shared_a2
    assert all(len(salt) == 32 for salt in (own_a, own_b, own_a2, shared_a))
    assert salts(SECRET, "alice") == (own_a, shared_a)  # stable
    # The directory gives the same salts.
    tenant = TenantDirectory(SECRET).make("alice")
    assert (tenant.salt, tenant.shared_salt) == (own_a, shared_a)
    # Names that only differ after a prefix do not share a namespace.
    assert salts(SECRET, "ali")[0] != own_a
    # A salt never appears in a tenant's repr (logs).
    assert own_a.hex() not in repr(tenant) and repr(own_a) not in repr(tenant)


def test_load_secret_makes_a_private_32_byte_secret_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    secret = load_secret(path)
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == secret
    assert load_secret(path) == secret  # never overwritten
    other = load_secret(tmp_path / "another")
    assert other != secret


def test_load_secret_refuses_a_readable_or_short_or_linked_file(tmp_path: Path) -> None:
    readable = tmp_path / "readable"
    readable.write_bytes(os.urandom(32))
    os.chmod(readable, 0o644)
    with pytest.raises(ConfigError, match="readable by group or others") as raised:
        load_secret(readable)
    assert raised.value.field == "tenant_secret"
    assert stat.S_IMODE(readable.stat().st_mode) == 0o644  # left as it was
    short = tmp_path / "short"
    short.write_bytes(b"x" * 15)
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="15 bytes") as raised:
        load_secret(short)
    assert raised.value.field == "tenant_secret"
    sixteen = tmp_path / "sixteen"
    sixteen.write_bytes(b"y" * 16)
    os.chmod(sixteen, 0o600)
    assert load_secret(sixteen) == b"y" * 16
    target = tmp_path / "target"
    link = tmp_path / "link"
    link.symlink_to(target)  # dangling: must not be created through
    with pytest.raises(ConfigError, match="regular file") as raised:
        load_secret(link)
    assert raised.value.field == "tenant_secret" and not target.exists()


# --- rate limit and classes ---------------------------------------------------------------------


def test_the_rate_limiter_is_a_token_bucket_with_a_one_second_burst() -> None:
    directory = TenantDirectory(SECRET)
    alice = directory.make("alice", max_requests_per_s=4)
    bob = directory.make("bob", max_requests_per_s=2)
    free = directory.make("free")
    limiter = RateLimiter()
    assert [limiter.allow(alice, now=100.0) for _ in range(5)] == [True] * 4 + [False]
    assert [limiter.allow(bob, now=100.0) for _ in range(3)] == [True, True, False]  # its own
    assert limiter.allow(alice, now=100.125) is False  # half a request refilled
    assert limiter.allow(alice, now=100.25) is True  # 0.5 + 0.5 = 1
    assert limiter.allow(alice, now=100.25) is False
    # A long pause refills to the burst, never beyond it.
    assert [limiter.allow(alice, now=1000.0) for _ in range(5)] == [True] * 4 + [False]
    assert all(limiter.allow(free, now=100.0) for _ in range(1000))  # no limit set


def test_a_rate_below_one_request_per_second_still_allows_requests() -> None:
    slow = TenantDirectory(SECRET).make("slow", max_requests_per_s=0.5)
    limiter = RateLimiter()
    allowed = [limiter.allow(slow, now=float(second)) for second in range(0, 20, 2)]
    assert sum(allowed) >= 5


def test_traffic_class_is_the_asked_one_if_allowed_else_the_default_or_refused() -> None:
    directory = TenantDirectory(SECRET)
    limited = directory.make("limited", classes=("agent", "chatbot"))
    assert limited.traffic_class("") == "agent"
    assert limited.traffic_class("agent") == "agent"
    assert limited.traffic_class("chatbot") == "chatbot"
    with pytest.raises(PermissionError, match="'default'.*'limited'"):
        limited.traffic_class("default")
    anything = directory.make("anything")
    assert anything.traffic_class("") == ""
    assert anything.traffic_class("whatever") == "whatever"
    assert isinstance(limited, Tenant)


def test_a_class_is_exclusive_only_when_no_other_tenant_names_it(tmp_path: Path) -> None:
    text = (
        '[tenants.a]\ntokens = ["token-of-tenant-a-0001"]\nclasses = ["agent", "chatbot"]\n\n'
        '[tenants.b]\ntokens = ["token-of-tenant-b-0001"]\nclasses = ["chatbot"]\n'
    )
    tenants = directory_of(tmp_path, text).tenants()
    assert tenants["a"].exclusive_classes == ("agent",)  # its figures are a's alone
    assert tenants["b"].exclusive_classes == ()
    # A bytes quota is counted over the tenant's classes: they must be its own.
    with pytest.raises(ConfigError) as raised:
        directory_of(
            tmp_path,
            text.replace('classes = ["chatbot"]', 'classes = ["chatbot"]\nmax_bytes = 1000'),
        )
    assert raised.value.field == "tenants.b.classes" and "'a'" in str(raised.value)
