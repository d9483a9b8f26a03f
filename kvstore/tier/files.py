"""A storage tier made of files in one directory: one machine, no Ray, no network.

For a single-machine engine (or a test) that wants the engine-side path end to end: the fetcher
process reads the same files the saver wrote. It is a ``kvstore.tier.protocols.Tier`` like the
cluster, and plans hits with the same composition (``kvstore.tier.hit``). Every file carries a
header with its length and an xxh3-64 checksum of its bytes, so a torn or corrupted file reads as
a miss (``miss_reason`` says which), never as wrong bytes. Writes go to a temporary file first and
are renamed into place, so a reader sees the whole file or none. No leases (nothing here is
evicted behind a reader's back), no erasure coding.

Layout: ``<root>/blocks/<key hex>.blk`` and ``<root>/swa/<key hex>-<position>.state``. Only the
service's user reads them: the directories are 0700 (``root`` must be its own, not a symlink, not
writable by others), the files 0600, and every file is reached relative to the directory's held
descriptor without following symlinks (``kvstore.privatefs``). Temp files have random names, as
several processes (the saver, a fetcher) may write one key at once.
"""

from __future__ import annotations

import functools
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.keys import BlockKey, check_key, check_keys, words_to_keys
from kvstore.pending import Pending
from kvstore.privatefs import PrivateDir
from kvstore.swa.directory import StoreRef
from kvstore.swa.store import check_state
from kvstore.tier.counters import HitCounters, class_stats
from kvstore.tier.hit import HitQuery
from kvstore.tier.records import (
    BlockRead,
    HitAnswer,
    HitRequest,
    PutAnswer,
    StateRead,
    Stats,
)

_MAGIC = b"KVSTFIL1"
_HEADER = struct.Struct("<8sQQ")  # magic, payload length, xxh3-64 of the payload
#: What ``query_hit`` names as the SWA owner: the states are in this directory.
LOCAL_OWNER = "local"
_LOCAL_STORE = StoreRef(LOCAL_OWNER, LOCAL_OWNER)


class DirectoryTier:
    """Blocks and SWA states as checksummed files under ``root``, for the model of ``geometry``
    (its fingerprint keys token ids; its ``state_size_to_disk`` is the exact size of a state).
    Picklable (a path and a frozen config)."""

    def __init__(self, root: str | os.PathLike[str], geometry: GeometryConfig | None = None):
        self.root = Path(root)
        self.geometry = geometry or GeometryConfig.default()
        self.model_fingerprint = self.geometry.fingerprint()
        self.state_size = self.geometry.state_size_to_disk
        self.block_bytes = self.geometry.block_bytes
        home = PrivateDir.open(self.root, "root", check_parent=False)
        self._blocks = home.subdir("blocks")
        self._swa = home.subdir("swa")
        home.close()
        self.hit_counters = HitCounters()

    def __reduce__(self) -> tuple[object, ...]:
        return (DirectoryTier, (str(self.root), self.geometry))

    def factory(self) -> Callable[[], DirectoryTier]:
        """A picklable zero-argument callable that opens this tier (for the fetcher process)."""
        return functools.partial(DirectoryTier, str(self.root), self.geometry)

    # --- paths -------------------------------------------------------------------------------

    def block_path(self, key: bytes) -> Path:
        return self._blocks.path / _block_name(key)

    def state_path(self, key: bytes, position: int) -> Path:
        return self._swa.path / _state_name(key, position)

    # --- TierWriter --------------------------------------------------------------------------

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        if len(keys) != len(payloads):
            raise InvalidArgument(
                "payloads", f"{len(payloads)} payloads for {len(keys)} keys (one each)"
            )
        checked = check_keys(keys, "keys")
        for key, payload in zip(checked, payloads, strict=True):
            _write_file(self._blocks, _block_name(key), bytes(payload))
        return PutAnswer(stored=len(checked))

    def machine_at(self, address: str) -> str | None:
        """One machine, named by no address."""
        return None

    def put_swa_state(
        self,
        key: bytes,
        position: int,
        state: bytes,
        machine: str | None = None,
        *,
        state_bytes: int | None = None,
        owner: str = "",
    ) -> str:
        del owner  # one directory, no pool shared by tenants to keep shares of
        check_key(key)
        check_state(position, state, state_bytes=state_bytes or self.state_size)
        _write_file(self._swa, _state_name(key, position), bytes(state))
        return machine or LOCAL_OWNER

    # --- TierReader --------------------------------------------------------------------------

    def get_blocks(
        self, keys: Sequence[bytes], lease_id: str | None = None, *, keep_lease: bool = False
    ) -> list[BlockRead]:
        reads = []
        for key in check_keys(keys, "keys"):
            payload, reason = _read_file(self._blocks, _block_name(key))
            reads.append(BlockRead(key=key, payload=payload, miss_reason=reason))
        return reads

    def get_swa_state(
        self, key: bytes, position: int, *, state_bytes: int | None = None
    ) -> StateRead:
        state, reason = _read_file(self._swa, _state_name(key, position))
        expected = state_bytes or self.state_size
        if state is not None and len(state) != expected:
            reason = f"corrupt: state has {len(state)} B, expected {expected}"
            state = None
        return StateRead(state=state, owner=LOCAL_OWNER if state else None, miss_reason=reason)

    # --- HitSource ---------------------------------------------------------------------------

    def query_hit(self, request: HitRequest) -> HitAnswer:
        query = HitQuery(
            blocks=_FileBlocks(self._blocks), states=_FileStates(self._swa), geometry=self.geometry
        )
        result = query.query_hit(request)
        if request.counted:
            self.hit_counters.count(
                request.holder.tenant, request.traffic_class, result.plan, result.keys.shape[0]
            )
        return result.answer(None)

    def release_lease(self, lease_id: str) -> bool:
        """Nothing to give back: this tier takes no leases (nothing evicts behind a reader)."""
        return False

    def lease_tag(self, lease_id: str) -> None:
        return None  # no leases here

    def open_leases(self, tenant: str) -> int:
        return 0

    def stats(self) -> Stats:
        return Stats(
            classes={
                name: class_stats(figures) for name, figures in self.hit_counters.by_class().items()
            },
            block_bytes_stored=_stored_bytes(self._blocks, ".blk"),
            swa_bytes_stored=_stored_bytes(self._swa, ".state"),
            extra={"model_fingerprint": self.model_fingerprint.hex(), "root": str(self.root)},
        )


class _FileBlocks:
    """``BlockLookup``: the leading run of blocks whose files exist (no leases here)."""

    def __init__(self, blocks: PrivateDir) -> None:
        self._blocks = blocks

    def lookup(self, keys: np.ndarray) -> Pending[tuple[int, Any]]:
        return Pending.of(lambda: (self._run(keys), None))  # local files: nothing to wait for

    def _run(self, keys: np.ndarray) -> int:
        run = 0
        for key in words_to_keys(keys):
            if not self._blocks.is_file(_block_name(key)):
                break
            run += 1
        return run

    def release(self, lease: Any) -> None:
        pass


class _FileStates:
    """``StateLocator``: the state file of that key at that position exists."""

    def __init__(self, states: PrivateDir) -> None:
        self._states = states

    def locate(
        self, key: BlockKey, position: int, prefer_machine: str | None = None
    ) -> Pending[StoreRef | None]:
        name = _state_name(key, position)
        return Pending.of(lambda: _LOCAL_STORE if self._states.is_file(name) else None)


def _block_name(key: bytes) -> str:
    return f"{check_key(key).hex()}.blk"


def _state_name(key: bytes, position: int) -> str:
    return f"{check_key(key).hex()}-{int(position)}.state"


def _write_file(directory: PrivateDir, name: str, data: bytes) -> None:
    header = _HEADER.pack(_MAGIC, len(data), xxhash.xxh3_64_intdigest(data))
    temporary = f".tmp-{secrets.token_hex(8)}"  # one per writer: processes may race on a key
    directory.write_atomically(name, [header, data], sync=False, temp=temporary)


def _stored_bytes(directory: PrivateDir, suffix: str) -> int:
    """Payload bytes of the files named ``*<suffix>`` in ``directory`` (headers left out)."""
    total = 0
    for entry in directory.entries():
        if entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size - _HEADER.size
    return total


def _read_file(directory: PrivateDir, name: str) -> tuple[bytes | None, str | None]:
    """(bytes, None) or (None, why it is a miss)."""
    try:
        raw = directory.read(name)
    except FileNotFoundError:
        return None, "absent"
    except OSError as error:
        return None, f"unreadable: {error.strerror}"
    if len(raw) < _HEADER.size:
        return None, "corrupt: truncated header"
    magic, length, digest = _HEADER.unpack_from(raw)
    data = raw[_HEADER.size :]
    if magic != _MAGIC or length != len(data):
        return None, "corrupt: bad header or length"
    if xxhash.xxh3_64_intdigest(data) != digest:
        return None, "corrupt: checksum mismatch"
    return data, None
