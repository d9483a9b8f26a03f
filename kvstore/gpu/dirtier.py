"""A storage tier made of files in one directory: one machine, no Ray, no network.

For a single-machine engine (or a test) that wants the engine-side path end to end: the fetcher
process reads the same files the saver wrote. It satisfies ``TierReader``, ``TierWriter`` and
``HitSource``. Every file carries a header with its length and an xxh3-64 checksum of its bytes,
so a torn or corrupted file reads as a miss (``miss_reason`` says which), never as wrong bytes.
Writes go to a temporary file first and are renamed into place, so a reader sees the whole file
or none. No leases (nothing here is evicted behind a reader's back), no erasure coding.

Layout: ``<root>/blocks/<key hex>.blk`` and ``<root>/swa/<key hex>-<position>.state``.
"""

from __future__ import annotations

import functools
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from kvstore.api.backend import BlockRead, HitAnswer, PutAnswer, StateRead
from kvstore.errors import InvalidArgument
from kvstore.hitplan import MODES, plan_hit
from kvstore.keys import BLOCK_TOKENS, BlockKey, block_keys, check_key
from kvstore.swa.store import check_state

_MAGIC = b"KVSTFIL1"
_HEADER = struct.Struct("<8sQQ")  # magic, payload length, xxh3-64 of the payload
#: What ``query_hit`` names as the SWA owner: the states are in this directory.
LOCAL_OWNER = "local"


class DirectoryTier:
    """Blocks and SWA states as checksummed files under ``root``. Picklable (it is just a path).

    ``model_fingerprint`` turns token ids into block keys for ``query_hit``; ``state_bytes``
    (``GeometryConfig.state_size_to_disk``), when given, is the exact size a state put must have.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model_fingerprint: bytes | None = None,
        state_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.model_fingerprint = model_fingerprint
        self.state_bytes = state_bytes
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)
        (self.root / "swa").mkdir(parents=True, exist_ok=True)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (str(self.root), self.model_fingerprint, self.state_bytes))

    def factory(self) -> Callable[[], DirectoryTier]:
        """A picklable zero-argument callable that opens this tier (for the fetcher process)."""
        return functools.partial(_rebuild, str(self.root), self.model_fingerprint, self.state_bytes)

    # --- paths -------------------------------------------------------------------------------

    def block_path(self, key: bytes) -> Path:
        return self.root / "blocks" / f"{check_key(key).hex()}.blk"

    def state_path(self, key: bytes, position: int) -> Path:
        return self.root / "swa" / f"{check_key(key).hex()}-{int(position)}.state"

    # --- TierWriter --------------------------------------------------------------------------

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        if len(keys) != len(payloads):
            raise InvalidArgument(
                "payloads", f"{len(payloads)} payloads for {len(keys)} keys (one each)"
            )
        for index, key in enumerate(keys):
            check_key(key, f"keys[{index}]")
        for key, payload in zip(keys, payloads, strict=True):
            _write_file(self.block_path(key), bytes(payload))
        return PutAnswer(committed=len(keys))

    def put_swa_state(
        self, key: bytes, position: int, state: bytes, machine: str | None = None
    ) -> str:
        check_key(key)
        if self.state_bytes is not None:
            check_state(position, state, state_bytes=self.state_bytes)
        elif isinstance(position, bool) or not isinstance(position, int) or position <= 0:
            raise InvalidArgument("position", f"must be a positive integer, got {position!r}")
        _write_file(self.state_path(key, position), bytes(state))
        return machine or LOCAL_OWNER

    # --- TierReader --------------------------------------------------------------------------

    def get_blocks(self, keys: Sequence[bytes], lease_id: str | None = None) -> list[BlockRead]:
        reads = []
        for index, key in enumerate(keys):
            typed = check_key(key, f"keys[{index}]")
            payload, reason = _read_file(self.block_path(typed))
            reads.append(BlockRead(key=typed, payload=payload, miss_reason=reason))
        return reads

    def get_swa_state(self, key: bytes, position: int) -> StateRead:
        state, reason = _read_file(self.state_path(key, position))
        if state is not None and self.state_bytes is not None and len(state) != self.state_bytes:
            reason = f"state has {len(state)} B, expected {self.state_bytes}"
            state = None
        return StateRead(state=state, owner=LOCAL_OWNER if state else None, miss_reason=reason)

    # --- HitSource ---------------------------------------------------------------------------

    def query_hit(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        block_keys: Sequence[bytes] | None = None,
        prompt_len: int = 0,
        mode: str = "standard",
        traffic_class: str = "",
        take_lease: bool = True,
    ) -> HitAnswer:
        if mode not in MODES:
            raise InvalidArgument("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
        keys = self._keys(token_ids, block_keys)
        length = len(token_ids) if token_ids is not None else prompt_len
        if length <= 0:
            raise InvalidArgument("prompt_len", "give token_ids or a positive prompt_len")
        flags = [self.block_path(key).is_file() for key in keys[: length // BLOCK_TOKENS]]

        def state_here(position: int) -> str | None:
            key = keys[position // BLOCK_TOKENS - 1]
            return LOCAL_OWNER if self.state_path(key, position).is_file() else None

        plan = plan_hit(length, flags, state_here, mode=mode)
        hit_blocks = plan.hit_tokens // BLOCK_TOKENS
        return HitAnswer(
            plan=plan,
            swa_owner=plan.swa_location,
            advice="fetch" if plan.swa_hit else None,
            fetch_seconds=0.0,
            replay_seconds=0.0,
            lease_id=None,
            hit_keys=tuple(keys[:hit_blocks]),
        )

    def release(self, lease_id: str) -> bool:
        """Nothing to give back: this tier takes no leases (nothing evicts behind a reader)."""
        return False

    def _keys(
        self, token_ids: Sequence[int] | None, keys: Sequence[bytes] | None
    ) -> list[BlockKey]:
        if keys is not None and len(keys) > 0:
            return [check_key(key, f"block_keys[{i}]") for i, key in enumerate(keys)]
        if token_ids is None:
            raise InvalidArgument("token_ids", "give token_ids or block_keys")
        if self.model_fingerprint is None:
            raise InvalidArgument(
                "token_ids", "this tier has no model_fingerprint to key tokens with"
            )
        return block_keys(self.model_fingerprint, token_ids)


def _rebuild(root: str, fingerprint: bytes | None, state_bytes: int | None) -> DirectoryTier:
    return DirectoryTier(root, model_fingerprint=fingerprint, state_bytes=state_bytes)


def _write_file(path: Path, data: bytes) -> None:
    header = _HEADER.pack(_MAGIC, len(data), xxhash.xxh3_64_intdigest(data))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(header)
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_file(path: Path) -> tuple[bytes | None, str | None]:
    """(bytes, None) or (None, why it is a miss)."""
    try:
        raw = path.read_bytes()
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
