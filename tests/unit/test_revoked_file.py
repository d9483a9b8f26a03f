"""A storage node's revocations on disk (``kvstore.blockstore.revokedfile``): what a node told of
released leases still refuses after its process restarted, and what it lets go."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.blockstore import revokedfile
from kvstore.blockstore.capability import Revocations
from kvstore.blockstore.revokedfile import NAME, RevokedFile
from kvstore.privatefs import PrivateDir

NOW = 1_700_000_000.0


def _dir(tmp_path: Path) -> PrivateDir:
    return PrivateDir.open(tmp_path / "node", "data_dir", check_parent=False)


def _restarted(tmp_path: Path, now: float) -> Revocations:
    """What a node's process starting at ``now`` refuses: its file's batches read back."""
    kept = RevokedFile(_dir(tmp_path), now)
    revocations = Revocations()
    for lease_ids, until in kept.batches:
        revocations.revoke(lease_ids, until, now)
    kept.close()
    return revocations


def test_a_restarted_node_still_refuses_what_it_was_told_until_it_ends(tmp_path: Path) -> None:
    kept = RevokedFile(_dir(tmp_path), NOW)
    kept.append(["lease-a", "lease-b"], NOW + 30, NOW)
    kept.append(["lease-c"], NOW + 300, NOW)
    kept.close()  # the process dies here: nothing else of it survives
    again = _restarted(tmp_path, NOW + 10)
    assert [again.revoked(lease, NOW + 600) for lease in ("lease-a", "lease-b", "lease-c")] == [
        True,
        True,
        True,
    ]
    assert not again.revoked("lease-d", NOW + 600)
    # Started after lease-a and lease-b ended: only lease-c is kept, and the file shrank to it.
    later = _restarted(tmp_path, NOW + 60)
    assert len(later) == 1 and later.revoked("lease-c", NOW + 600)
    assert b"lease-a" not in _dir(tmp_path).read(NAME)


def test_a_line_torn_by_a_crash_is_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    kept = RevokedFile(_dir(tmp_path), NOW)
    kept.append(["lease-a"], NOW + 30, NOW)
    kept.close()
    fd = _dir(tmp_path).open_write(NAME)
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, b'{"until":1700000030.0,"ids":["lea')  # the append the crash cut short
    os.close(fd)
    again = _restarted(tmp_path, NOW)
    assert len(again) == 1 and again.revoked("lease-a", NOW + 600)


def test_the_file_is_rewritten_with_what_is_current_once_it_grew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(revokedfile, "REWRITE_BYTES", 4096)
    kept = RevokedFile(_dir(tmp_path), NOW)
    for step in range(200):  # each batch ends 5 s after it was sent
        kept.append([f"lease-{step}"], NOW + step + 5, NOW + step)
    size = os.stat(tmp_path / "node" / NAME).st_size
    assert size <= 4096 + 64  # rewritten as it grew: not the 200 batches (~8 KB)
    kept.close()
    again = _restarted(tmp_path, NOW + 199)
    assert {f"lease-{step}" for step in range(195, 200)} == {
        f"lease-{step}" for step in range(200) if again.revoked(f"lease-{step}", NOW + 999)
    }
