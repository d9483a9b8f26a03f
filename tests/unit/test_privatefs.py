"""Owner-only directories and files: exact modes whatever the umask, creates that never write
through what sits at the name, and a verified directory that stays the one written to."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.privatefs import PrivateDir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_modes_are_exact_under_any_umask(tmp_path: Path) -> None:
    for number, umask in enumerate((0o000, 0o022, 0o077, 0o277)):
        old = os.umask(umask)
        try:
            home = PrivateDir.open(tmp_path / f"d{number}", "root", check_parent=False)
            sub = home.subdir("sub")
            sub.write_atomically("file", [b"bytes"], sync=True)
        finally:
            os.umask(old)
        root = tmp_path / f"d{number}"
        assert (_mode(root), _mode(root / "sub"), _mode(root / "sub" / "file")) == (
            0o700,
            0o700,
            0o600,
        ), oct(umask)
        assert (root / "sub" / "file").read_bytes() == b"bytes"


def test_create_replaces_whatever_is_at_the_name_and_never_writes_through_it(
    tmp_path: Path,
) -> None:
    home = PrivateDir.open(tmp_path / "home", "root", check_parent=False)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "home" / "name")
    os.symlink(tmp_path / "nowhere", tmp_path / "home" / "dangling")
    for name in ("name", "dangling"):
        fd = home.create(name)
        os.write(fd, b"new")
        os.close(fd)
        assert not (tmp_path / "home" / name).is_symlink()
        assert (tmp_path / "home" / name).read_bytes() == b"new"
    assert target.read_bytes() == b"keep" and not (tmp_path / "nowhere").exists()
    (tmp_path / "home" / "a-dir").mkdir()
    with pytest.raises(OSError):
        home.create("a-dir")  # not unlinkable: the create fails cleanly
    assert (tmp_path / "home" / "a-dir").is_dir()


def test_reads_do_not_follow_symlinks(tmp_path: Path) -> None:
    home = PrivateDir.open(tmp_path / "home", "root", check_parent=False)
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", tmp_path / "home" / "link")
    with pytest.raises(OSError):
        home.read("link")
    assert not home.is_file("link")
    with pytest.raises(FileNotFoundError):
        home.read("absent")


def test_a_failed_write_leaves_neither_the_file_nor_its_temp(tmp_path: Path) -> None:
    home = PrivateDir.open(tmp_path / "home", "root", check_parent=False)
    with pytest.raises(TypeError):
        home.write_atomically("file", [b"head", object()], sync=False)
    assert os.listdir(tmp_path / "home") == []


def test_writes_stay_in_the_verified_directory_when_its_path_is_swapped(tmp_path: Path) -> None:
    home = PrivateDir.open(tmp_path / "data", "root", check_parent=False)
    os.rename(tmp_path / "data", tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "data")  # the old path now leads elsewhere
    home.write_atomically("file", [b"bytes"], sync=False)
    assert (tmp_path / "moved" / "file").read_bytes() == b"bytes"
    assert os.listdir(tmp_path / "elsewhere") == []
    with pytest.raises(ConfigError, match="symlink"):
        PrivateDir.open(tmp_path / "data", "root", check_parent=False)  # opened anew: refused


def test_the_parent_is_checked_only_when_asked_and_never_changed(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    parent.mkdir(mode=0o755)
    parent.chmod(0o777)
    with pytest.raises(ConfigError, match=r"data_dir: .*parent is group- or world-writable"):
        PrivateDir.open(parent / "node", "data_dir", check_parent=True)
    PrivateDir.open(parent / "tier", "root", check_parent=False)
    assert _mode(parent) == 0o777 and _mode(parent / "tier") == 0o700
