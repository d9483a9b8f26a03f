"""Security review, issue 31 item 3: the engine's staging file, where a tenant's KV lands.

The finding: the file was ``/dev/shm/kvstore-staging-<pid>-<random>``, directly in a directory
every local user (and, with ``--ipc=host``, every container) shares. An engine in another PID
namespace saw that pid as dead and deleted the live file as stale; the fetcher then opened the
name lazily with a plain ``open(O_RDWR)``, so a file another user had planted at it received
the tenant's KV. One test per part of the fix, each the attack reproduced on real files and a
real fetcher process: the directory the areas live in, the name a new area takes, staleness
judged by a lock instead of a pid, and the fetcher mapping the descriptor it was handed.

Run as root, a planted entry is also given to another uid (what a second local user would own).
"""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvstore.engine.staging as staging
from kvstore.childenv import ROOT, child_env
from kvstore.engine.fetcher import Fetcher
from kvstore.engine.kvlayout import KVLayout
from kvstore.engine.staging import StageLayout, StagingArea, remove_stale_areas
from kvstore.errors import ConfigError
from kvstore.geometry import GeometryConfig
from kvstore.keys import block_keys
from kvstore.tier.files import DirectoryTier

GEOMETRY = GeometryConfig(num_state_seqs=4)
KV = KVLayout.from_geometry(GEOMETRY)
#: What must never reach a file anyone else could read: a tenant's block, a marker repeated.
SECRET = b"TENANT-SECRET-KV"
OTHER_UID = 65534


def _give_away(path: Path) -> None:
    """Make ``path`` look planted by another local user (when we may chown)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


def _plant_file(path: Path, size: int) -> Path:
    """Another user's world-writable file of ``size`` bytes at ``path``: big enough to map as
    the area, so a fetcher that opened it by name would write the whole load into it."""
    path.write_bytes(bytes(size))
    path.chmod(0o666)
    _give_away(path)
    return path


def _files_under(top: Path) -> list[Path]:
    return sorted(path for path in top.rglob("*") if path.is_file())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The shared directory the areas go under: sticky and world-writable, like /dev/shm."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    return shm


# --- where an area lives ---------------------------------------------------------------------


def test_areas_live_in_a_directory_only_this_user_can_enter(root: Path, umask_022: None) -> None:
    with StagingArea(8192, root) as area:
        home = area.path.parent
        assert home == root / f"kvstore-{os.geteuid()}"
        info = os.lstat(home)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(area.path).st_mode) == 0o600


def test_a_directory_another_user_made_at_our_name_is_refused(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine runs as OTHER_UID here, and the directory at its name is this process's: one
    # made by another user, without needing root to give it away.
    theirs = root / f"kvstore-{OTHER_UID}"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    maker = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    with pytest.raises(ConfigError, match=f"owned by uid {maker}"):
        StagingArea(8192, root)
    monkeypatch.undo()
    assert _files_under(theirs) == []  # nothing of ours was created where they can read it


def test_a_symlink_at_our_directory_name_is_refused(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    (root / f"kvstore-{os.geteuid()}").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symlink"):
        StagingArea(8192, root)
    assert _files_under(elsewhere) == []


# --- the name a new area takes ---------------------------------------------------------------


@pytest.mark.parametrize("planted", ["file", "symlink", "live area"])
def test_an_entry_at_the_chosen_name_never_receives_kv(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    with StagingArea(8192, root) as first:  # makes our directory; its file is not in the way
        home = first.path.parent
    name = "kvstore-staging-planted"
    # The planted inode is also linked outside, so what reaches it can be read after it lost
    # its name in our directory (an unlocked file there is stale, and removed, not written).
    outside = tmp_path / "outside"
    _plant_file(outside, 8192)
    if planted == "symlink":
        (home / name).symlink_to(outside)
    else:
        os.link(outside, home / name)
    held = os.open(outside, os.O_RDONLY)
    try:
        if planted == "live area":
            fcntl.flock(held, fcntl.LOCK_EX)  # another engine of ours, alive
        suffixes = iter(["planted", "fresh"])
        monkeypatch.setattr(staging, "_random_suffix", lambda: next(suffixes), raising=False)
        with StagingArea(8192, root) as area:
            assert os.stat(area.path).st_ino != os.stat(outside).st_ino
            area.buffer[:] = np.frombuffer(SECRET * (8192 // len(SECRET)), dtype=np.uint8)
            if planted != "file":  # a link is not followed, a live area not touched
                assert area.path != home / name and os.path.lexists(home / name)
            assert SECRET not in outside.read_bytes()
    finally:
        os.close(held)


# --- staleness: a lock, not a pid ------------------------------------------------------------

_OWNER = """
import sys
from kvstore.engine.staging import StagingArea
area = StagingArea(8192, sys.argv[1])
print(area.path, flush=True)
sys.stdin.read()
"""


def test_a_live_area_survives_a_remover_that_cannot_see_its_owner(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
    )
    try:
        assert owner.stdout is not None
        path = Path(owner.stdout.readline().strip())
        assert path.is_file()

        # An engine in another PID namespace: the owner's pid is nobody's there (or, reused,
        # a stranger's). Whatever a pid says, the owner's lock keeps the area.
        def no_such_process(pid: int, signal: int) -> None:
            raise ProcessLookupError(pid)

        with monkeypatch.context() as patched:
            patched.setattr(os, "kill", no_such_process)
            assert remove_stale_areas(path.parent) == []
        assert path.is_file()
        with StagingArea(8192, root) as neighbour:  # a second engine starting beside it
            assert path.is_file() and neighbour.path != path
    finally:
        owner.kill()  # no close(): the file stays behind, its lock released by the death
        owner.wait()
    assert path.is_file()
    assert remove_stale_areas(path.parent) == [path]
    assert not path.exists()


# --- the fetcher maps what it was handed -----------------------------------------------------


@pytest.mark.parametrize("move", ["unlink", "rename"])
def test_the_fetcher_fills_the_area_it_was_handed_not_whatever_is_at_its_name(
    root: Path, tmp_path: Path, move: str
) -> None:
    tier = DirectoryTier(tmp_path / "tier", GEOMETRY)
    tokens = np.arange(3 * 128)
    keys = block_keys(GEOMETRY.fingerprint(), tokens)
    block = SECRET * (KV.block_bytes // len(SECRET)) + SECRET[: KV.block_bytes % len(SECRET)]
    tier.put_blocks(keys, [block] * len(keys))
    with StagingArea(8 << 20, root) as area, Fetcher(tier.factory(), area, KV) as fetcher:
        # What the finding's remover did to the live file, then a local user planted a file at
        # its name (where the fetcher used to open the area, on its first load).
        path = area.path
        if move == "unlink":
            path.unlink()
        else:
            path.rename(tmp_path / "moved-away")
        planted = _plant_file(path, area.capacity)
        # With the header of the first load in place, as the planter can predict it (job ids
        # start at 1, the first region at 0, the layout follows from the model): a fetcher
        # that maps this file finds nothing amiss and writes the load into it.
        bait = np.memmap(planted, dtype=np.uint8, mode="r+")
        StageLayout.plan(KV, len(keys), False).header(bait).initialise(job_id=1)
        bait.flush()
        del bait
        fetch = fetcher.submit(keys)
        assert fetch.wait_finished(60), "the fetch never finished"
        assert SECRET not in planted.read_bytes()
        assert fetch.failure is None, fetch.failure
        assert fetch.block_ok().all()
        staged = fetch.layout.blocks_view(fetch.region(), 0)
        assert bytes(staged[0]) == block[: KV.layers[0].block_nbytes]
        fetch.release()


def test_a_cpu_engines_shared_kv_cache_has_no_name_anyone_could_open(tmp_path: Path) -> None:
    """Loads in place (``kvstore.engine.sharedkv``) put the whole KV cache in shared memory:
    it is an anonymous file (``memfd_create``), in no directory, so no other user can open,
    plant or swap it; only the engine and the fetcher it hands the descriptor to map it."""
    torch = pytest.importorskip("torch")
    from kvstore.engine.sharedkv import SharedKV

    cache = [torch.zeros(4, 1024)]
    shared = SharedKV.move(cache)
    try:
        target = os.readlink(f"/proc/self/fd/{shared.fd}")
        assert target.startswith("/memfd:kvstore-kv-cache") and "(deleted)" in target
        if Path("/dev/shm").is_dir():
            assert not [p for p in Path("/dev/shm").rglob("*") if "kv-cache" in p.name]
        flags = fcntl.fcntl(shared.fd, fcntl.F_GETFD)
        assert flags & fcntl.FD_CLOEXEC  # no other child of the engine inherits it
    finally:
        shared.close()
