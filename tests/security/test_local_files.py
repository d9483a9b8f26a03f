"""Security review of ``kvstore up`` (issue 15), local files: one test per finding, each the
attack or the loose mode reproduced against real storage nodes on real directories.

Findings: data dirs 0755 and shard files 0644 (any local user read another tenant's KV); a data
dir pre-created by another user was accepted; temp files (``LIVE.tmp``, ``NODE.tmp``, pending
shards, the manifest snapshot's temp) were opened through a symlink planted at their name, so a
root storage node overwrote a root-owned 0600 file elsewhere. (A node's files have changed since,
to ``NODE``, ``LOCK`` and its log's segments: the same checks hold for each.)
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvstore.blockstore.config import StorageNodeConfig
from kvstore.blockstore.node import StorageNode
from kvstore.blockstore.revokedfile import RevokedFile
from kvstore.ec import Codec
from kvstore.engine.staging import StagingArea
from kvstore.errors import ConfigError
from kvstore.tier.files import DirectoryTier

CODEC = Codec(10, 2)
TOKEN = 0x5EC
OTHER_UID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir to another uid needs root")


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"security-%d" % i, digest_size=32).digest()


def _put(node: StorageNode, i: int, token: int = TOKEN) -> list[bool]:
    payload = np.random.default_rng(i).integers(0, 256, 3000, dtype=np.uint8)
    shard = CODEC.encode(payload, _key(i))[0]
    return node.put(token, [_key(i)], [shard], [0], [1.0])


def _modes(top: Path) -> dict[str, int]:
    """Permission bits of ``top`` and everything below it, by path relative to ``top``."""
    found = {".": stat.S_IMODE(top.lstat().st_mode)}
    for path in top.rglob("*"):
        found[str(path.relative_to(top))] = stat.S_IMODE(path.lstat().st_mode)
    return found


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A 0600 file outside any data dir (root-owned when the tests run as root)."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    path = outside / "secret"
    path.write_bytes(b"root only\n")
    path.chmod(0o600)
    return path


# --- modes -----------------------------------------------------------------------------------


def test_node_dirs_are_0700_and_its_files_0600_under_umask_022(
    tmp_path: Path, umask_022: None
) -> None:
    root = tmp_path / "blocks"
    node = StorageNode(0, root / "node-0", StorageNodeConfig(fsync="always"))
    assert _put(node, 1) == [True] and node.commit(TOKEN, [_key(1)]) == [True]
    assert _put(node, 2) == [True]  # stays pending
    revoked = RevokedFile(node.root, 1_700_000_000.0)  # what the node's actor keeps beside
    revoked.append(["lease-1"], 1_700_000_030.0, 1_700_000_000.0)
    revoked.close()
    modes = _modes(root / "node-0")
    for name in ("segments", "NODE", "LOCK", "REVOKED"):
        assert name in modes, sorted(modes)
    assert any(name.startswith("segments/") for name in modes)
    for name, mode in modes.items():
        is_dir = (root / "node-0" / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), f"{name}: {mode:o}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700  # a data root the node had to create


def test_directory_tier_dirs_are_0700_and_its_files_0600_under_umask_022(
    tmp_path: Path, umask_022: None
) -> None:
    tier = DirectoryTier(tmp_path / "tier")
    tier.put_blocks([_key(1)], [b"kv bytes"])
    tier.put_swa_state(_key(1), 128, bytes(tier.state_size))
    modes = _modes(tmp_path / "tier")
    assert set(modes) >= {".", "blocks", "swa", f"blocks/{_key(1).hex()}.blk"}
    for name, mode in modes.items():
        is_dir = (tmp_path / "tier" / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), f"{name}: {mode:o}"


def test_staging_area_in_dev_shm_stays_0600_and_exclusive(umask_022: None) -> None:
    # Not a finding: a guard that the engine's shared-memory file keeps its O_EXCL 0600 create.
    with StagingArea(8192) as area:
        assert stat.S_IMODE(os.stat(area.path).st_mode) == 0o600


def test_an_old_0755_node_dir_of_ours_is_tightened_to_0700(tmp_path: Path) -> None:
    node_dir = tmp_path / "node-0"
    for directory in (node_dir, node_dir / "segments"):
        directory.mkdir()
        directory.chmod(0o755)  # what earlier versions left behind
    StorageNode(0, node_dir)
    assert {name: mode for name, mode in _modes(node_dir).items() if "/" not in name} == {
        ".": 0o700,
        "segments": 0o700,
        "NODE": 0o600,
        "LOCK": 0o600,
    }


# --- whose directory -------------------------------------------------------------------------


@as_root
def test_a_data_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "blocks"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{root}.*uid {OTHER_UID}"):
        StorageNode(0, root / "node-0")
    assert not (root / "node-0").exists()


@as_root
def test_a_node_dir_pre_created_by_another_user_is_refused(tmp_path: Path, secret: Path) -> None:
    node_dir = tmp_path / "node-0"
    node_dir.mkdir(mode=0o755)
    os.symlink(secret, node_dir / "NODE.tmp")  # what its owner planted, waiting for us
    os.lchown(node_dir / "NODE.tmp", OTHER_UID, OTHER_UID)
    os.chown(node_dir, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{node_dir}.*uid {OTHER_UID}"):
        StorageNode(0, node_dir)
    assert secret.read_bytes() == b"root only\n"
    tier_root = tmp_path / "tier"
    tier_root.mkdir(mode=0o755)
    os.chown(tier_root, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{tier_root}.*uid {OTHER_UID}"):
        DirectoryTier(tier_root)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
@pytest.mark.parametrize("which", ["data root", "node dir"])
def test_a_group_or_world_writable_data_root_or_node_dir_is_refused(
    tmp_path: Path, mode: int, which: str
) -> None:
    root = tmp_path / "blocks"
    node_dir = root / "node-0"
    node_dir.mkdir(parents=True, mode=0o700)
    loose = root if which == "data root" else node_dir
    loose.chmod(mode)
    with pytest.raises(ConfigError, match=f"{loose}.*writable"):
        StorageNode(0, node_dir)
    assert stat.S_IMODE(loose.stat().st_mode) == mode  # refused, not silently "fixed"


@pytest.mark.parametrize("which", ["data root", "node dir"])
def test_a_symlinked_data_root_or_node_dir_is_refused(tmp_path: Path, which: str) -> None:
    real = tmp_path / "real"
    (real / "node-0").mkdir(parents=True, mode=0o700)
    if which == "data root":
        (tmp_path / "blocks").symlink_to(real)
        node_dir = tmp_path / "blocks" / "node-0"
        link = tmp_path / "blocks"
    else:
        root = tmp_path / "blocks"
        root.mkdir(mode=0o700)
        node_dir = link = root / "node-0"
        node_dir.symlink_to(real / "node-0")
    with pytest.raises(ConfigError, match=f"{link}.*symlink"):
        StorageNode(0, node_dir)
    assert os.listdir(real / "node-0") == []


# --- planted temp names ----------------------------------------------------------------------


#: Every name a node creates a file at, and whether it does so at start-up or while serving
#: (a link planted before the start in a dir the node accepts, or later by whoever can write
#: there: either way the node must not write through it). Segments roll at every batch here.
PLANTED_NAMES = [
    ("NODE.tmp", "start"),
    ("LOCK", "start"),
    ("segments/0000000000000001.seg", "start"),
    ("segments/0000000000000002.seg", "serving"),
]


@pytest.mark.parametrize(("name", "when"), PLANTED_NAMES)
def test_a_symlink_planted_where_a_node_creates_a_file_is_never_followed(
    tmp_path: Path, secret: Path, name: str, when: str
) -> None:
    node_dir = tmp_path / "node-0"
    (node_dir / "segments").mkdir(parents=True, mode=0o700)
    node_dir.chmod(0o700)
    before = secret.stat()
    if when == "start":
        os.symlink(secret, node_dir / name)
    node = StorageNode(0, node_dir, StorageNodeConfig(fsync="always", segment_bytes=1))
    if when == "serving":
        os.symlink(secret, node_dir / name)
    assert _put(node, 1) == [True]  # the node still works: a fresh file, not the link
    assert node.commit(TOKEN, [_key(1)]) == [True]
    after = secret.stat()
    assert secret.read_bytes() == b"root only\n"
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_mtime_ns) == (
        before.st_ino,
        before.st_mode,
        before.st_uid,
        before.st_mtime_ns,
    )
    assert not (node_dir / name).is_symlink()
    node.close()
    assert StorageNode(0, node_dir).holds([_key(1)]) == [True]
