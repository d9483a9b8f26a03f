"""The testbed's run directory, where root keeps the Ray token and the gateway's secrets
(issue 31, item 8).

The finding: the run directory was ``/tmp/kvstore-testbed/<name>``, a name known in advance in a
parent anyone could make first; another local user could put a link to a directory of theirs in
its place before the gateway's secrets were made, and root then served TLS with their
certificate. Now it is a fresh ``mkdtemp`` directory (0700, this user's) in a parent no one else
can change, checked again before any secret is written.

No root or namespaces needed: the network and the processes are stubbed out, what is checked is
where the files go. "Another user's directory" is one writable by everyone and not sticky (this
test cannot make one owned by someone else without root), or a link in place of the run
directory. Against the code before the fix, the secrets land in the other user's directory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvstore.errors import ConfigError
from kvstore.testbed import testbed as testbed_module
from kvstore.testbed.testbed import Testbed, TestbedConfig

NAME = "kvtbplant"


class Stop(Exception):
    """Where the stubs end the run: the files are where they are by then."""


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """A /tmp of our own (sticky, writable by all) and a directory "another user" controls."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    return {"tmp": tmp, "theirs": theirs}


def up_until_the_network(monkeypatch: pytest.MonkeyPatch, run_root: Path) -> list[Path]:
    """``Testbed.up`` as far as making the network (stubbed: ``Stop``); answers where the Ray
    token was written, each checked then to be in a directory of this user's, 0700."""
    written: list[Path] = []

    class Network:
        @classmethod
        def create(cls, name: str, hosts: Any, mtu: int = 1500) -> None:
            written.extend(Path(run_root).resolve().parent.rglob("ray_token"))
            for token in written:
                info = os.lstat(token.parent)
                assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
                assert info.st_uid == os.geteuid()
            raise Stop

    monkeypatch.setattr(testbed_module, "require_tools", lambda: None)
    monkeypatch.setattr(testbed_module, "Network", Network)
    with pytest.raises((Stop, ConfigError)):
        Testbed.up(TestbedConfig(storage_hosts=1, name=NAME, run_root=str(run_root)))
    return written


def test_a_run_root_another_user_planted_is_refused(
    world: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    old_name = world["tmp"] / "kvstore-testbed"  # the root the run directories were made in
    old_name.symlink_to(world["theirs"])
    written = up_until_the_network(monkeypatch, old_name)
    assert not written, f"the Ray token went to {written}"
    assert not list(world["theirs"].iterdir())
    with pytest.raises(ConfigError, match="writable by others and not sticky"):
        Testbed.up(TestbedConfig(storage_hosts=1, name=NAME, run_root=str(old_name)))


def test_the_run_directory_is_fresh_private_and_never_a_planted_name(
    world: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, theirs = world["tmp"], world["theirs"]
    (tmp / NAME).symlink_to(theirs)  # the name as it was: <root>/<name>
    first = up_until_the_network(monkeypatch, tmp)
    second = up_until_the_network(monkeypatch, tmp)
    assert len(first) == len(second) == 1, (first, second)
    run_dirs = [first[0].parent, second[0].parent]
    assert run_dirs[0] != run_dirs[1]  # never a name used before
    for run_dir in run_dirs:
        assert run_dir.parent == tmp.resolve() and run_dir.name.startswith(f"{NAME}-")
        assert not run_dir.exists()  # ``up`` failed (the stub): it took down what it made
    assert not list(theirs.iterdir())


def test_a_run_directory_replaced_by_a_link_gets_no_gateway_secret(
    world: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = world["tmp"] / f"{NAME}-made"
    run_dir.mkdir(mode=0o700)
    network: Any = _StubNetwork()  # no namespaces: only where the files go is checked
    ray: Any = _StubRay()
    bed = Testbed(TestbedConfig(storage_hosts=1, name=NAME), network, ray, run_dir)
    run_dir.rmdir()  # between ``up`` and ``kvstore_up``, the other user's link in its place
    run_dir.symlink_to(world["theirs"])

    def self_signed(cert: Path, key: Path, address: str) -> None:
        cert.write_text("their certificate")
        key.write_text("key")

    def start(*args: Any, **kwargs: Any) -> None:
        raise Stop

    monkeypatch.setattr(testbed_module, "_self_signed", self_signed)
    monkeypatch.setattr(testbed_module.TierProcess, "start", start)
    with pytest.raises((ConfigError, Stop)) as raised:
        bed.kvstore_up()
    assert not list(world["theirs"].iterdir()), "the gateway's secrets went through the link"
    assert raised.type is ConfigError and "not a directory" in str(raised.value)


def test_a_run_directory_someone_else_planted_is_not_taken_for_a_testbed(
    world: dict[str, Path],
) -> None:
    (world["theirs"] / "testbed.json").write_text("{}")
    (world["tmp"] / f"{NAME}-x").symlink_to(world["theirs"])
    assert testbed_module.testbeds(world["tmp"]) == []


class _StubNetwork:
    def address(self, host: str) -> str:
        return "10.0.0.1"

    def exec_prefix(self, host: str) -> list[str]:
        return []


class _StubRay:
    address = "10.0.0.1:6379"

    def env(self) -> dict[str, str]:
        return {}
