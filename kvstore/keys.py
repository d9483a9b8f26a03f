"""Canonical chained keys of 128-token blocks.

key(block i) = BLAKE2b-256( DOMAIN | model_fingerprint | key(block i-1) | token ids of block i )

- The hash is a fixed cryptographic one (BLAKE2b, 32-byte digest), never Python's ``hash``:
  the same tokens give the same key in any process, on any machine, whatever PYTHONHASHSEED is.
- The chain makes a key name the whole prefix, not just its own 128 tokens, so a hit on block i
  implies the same tokens in blocks 0..i-1.
- The model fingerprint (preset + the numbers that shape stored bytes) is part of every key, so
  two models never share entries. It is an argument, not a process global: nothing to initialise.
- Token ids are hashed as little-endian uint32, so ``[1, 2]`` as a list, a tuple or a numpy
  array all give one key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import NewType

import numpy as np

from kvstore.errors import InvalidArgument

_native: ModuleType | None
try:  # the chained hashes of a whole prompt in one C call (hashlib: one call per block)
    from kvstore import _blake2b as _native
except ImportError:  # pragma: no cover - the CI machine builds it
    _native = None

BlockKey = NewType("BlockKey", bytes)

KEY_BYTES = 32
BLOCK_TOKENS = 128
#: Parent of the first block of every sequence.
ROOT_KEY = BlockKey(bytes(KEY_BYTES))
_DOMAIN = b"kvstore.block.v1\x00"
_MAX_TOKEN_ID = 2**32 - 1
#: Longest prefix (domain + fingerprint) the C path takes (``MAX_PREFIX`` in _blake2b.c);
#: a longer fingerprint is hashed by hashlib.
_NATIVE_MAX_PREFIX = 1024


def _as_token_array(tokens: Sequence[int] | np.ndarray, argument: str = "token_ids") -> np.ndarray:
    try:
        array = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError) as error:
        # Ragged nested lists and the like: numpy's own error would not name the argument.
        raise InvalidArgument(argument, f"is not a flat sequence of integers ({error})") from None
    if array.ndim != 1:
        raise InvalidArgument(argument, f"must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return array.astype("<u4")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgument(argument, f"must be integers, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > _MAX_TOKEN_ID:
        raise InvalidArgument(
            argument, f"must lie in [0, {_MAX_TOKEN_ID}], got values in [{low}, {high}]"
        )
    return array.astype("<u4", copy=False)


def _check_fingerprint(model_fingerprint: object) -> bytes:
    if not isinstance(model_fingerprint, bytes | bytearray | memoryview):
        raise InvalidArgument(
            "model_fingerprint", f"must be bytes, got {type(model_fingerprint).__name__}"
        )
    return bytes(model_fingerprint)


def chain_key(
    model_fingerprint: bytes, parent: BlockKey, block_tokens: Sequence[int] | np.ndarray
) -> BlockKey:
    """Key of one block given its parent's key and its exactly-128 token ids."""
    fingerprint = _check_fingerprint(model_fingerprint)
    tokens = _as_token_array(block_tokens, "block_tokens")
    if tokens.size != BLOCK_TOKENS:
        raise InvalidArgument(
            "block_tokens", f"a block holds exactly {BLOCK_TOKENS} tokens, got {tokens.size}"
        )
    check_key(parent, "parent")
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    digest.update(_DOMAIN)
    digest.update(len(fingerprint).to_bytes(4, "little"))
    digest.update(fingerprint)
    digest.update(parent)
    digest.update(tokens.tobytes())
    return BlockKey(digest.digest())


def block_keys(
    model_fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, parent: BlockKey = ROOT_KEY
) -> list[BlockKey]:
    """Keys of every *full* 128-token block of ``token_ids`` (a trailing partial block has none)."""
    return words_to_keys(block_key_words(model_fingerprint, token_ids, parent))


def block_key_words(
    model_fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, parent: BlockKey = ROOT_KEY
) -> np.ndarray:
    """``block_keys`` as (n, 4) uint64 words (``key_words``), with no Python object per key: one
    C call for the whole prompt, the GIL released (a 1M-token prompt: ~10 ms, not ~110)."""
    fingerprint = _check_fingerprint(model_fingerprint)
    check_key(parent, "parent")  # also when there is no full block, so a bad call always fails
    tokens = _as_token_array(token_ids)
    full = tokens.size // BLOCK_TOKENS
    out = np.empty((full, 4), dtype=np.uint64)
    whole = np.ascontiguousarray(tokens[: full * BLOCK_TOKENS], dtype="<u4")
    prefix = _DOMAIN + len(fingerprint).to_bytes(4, "little") + fingerprint
    if _native is not None and len(prefix) <= _NATIVE_MAX_PREFIX:
        _native.chain_keys(prefix, bytes(parent), whole, out)
        return out
    target = out.view(np.uint8).reshape(-1, KEY_BYTES)
    for index in range(full):
        parent = chain_key(
            fingerprint, parent, whole[index * BLOCK_TOKENS : (index + 1) * BLOCK_TOKENS]
        )
        target[index] = np.frombuffer(parent, dtype=np.uint8)
    return out


def check_key(key: object, argument: str = "key") -> BlockKey:
    """Validate that ``key`` is a 32-byte block key; returns it typed."""
    if type(key) is bytes and len(key) == KEY_BYTES:  # the common case, on every hot path
        return BlockKey(key)
    if not isinstance(key, bytes | bytearray | memoryview):
        raise InvalidArgument(argument, f"must be {KEY_BYTES} bytes, got {type(key).__name__}")
    raw = bytes(key)
    if len(raw) != KEY_BYTES:
        raise InvalidArgument(argument, f"must be {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(raw)


def check_keys(keys: Iterable[object], argument: str = "keys") -> list[BlockKey]:
    """Validate a batch of keys; an error names the position (``keys[7]``)."""
    if (
        type(keys) is list
        and set(map(type, keys)) <= {bytes}
        and set(map(len, keys)) <= {KEY_BYTES}
    ):
        return list(keys)  # the common case, 32-byte keys in a list: checked by passes in C
    checked: list[BlockKey] = []
    for index, key in enumerate(keys):
        if type(key) is bytes and len(key) == KEY_BYTES:
            checked.append(BlockKey(key))
        else:
            checked.append(check_key(key, f"{argument}[{index}]"))
    return checked


def key_words(keys: Sequence[object] | np.ndarray, argument: str = "keys") -> np.ndarray:
    """Keys as an (n, 4) uint64 array (the key's 32 bytes as four native words).

    This is the form every hot path works in (meta shard choice, the index probe, the wire
    between the gateway and the meta shards): one buffer, no Python object per key. Accepts a
    sequence of 32-byte keys or an array already shaped (n, 4) uint64 or (n, 32) uint8. The
    result may be a read-only view of the input: copy it before writing to it.
    """
    if isinstance(keys, np.ndarray):
        if keys.ndim == 2 and keys.dtype == np.uint64 and keys.shape[1] == 4:
            return np.ascontiguousarray(keys)
        if keys.ndim == 2 and keys.dtype == np.uint8 and keys.shape[1] == KEY_BYTES:
            return np.ascontiguousarray(keys).view(np.uint64)
        raise InvalidArgument(
            argument,
            f"an array of keys must be (n, 4) uint64 or (n, {KEY_BYTES}) uint8, "
            f"got {keys.shape} {keys.dtype}",
        )
    if isinstance(keys, bytes | bytearray | memoryview | str):
        raise InvalidArgument(argument, "must be a sequence of keys, got a single bytes object")
    count = len(keys)
    if count == 0:
        return np.zeros((0, 4), dtype=np.uint64)
    # Fast path, all in C: join, then prove every piece was exactly 32 bytes (the total is 32
    # per key and none is shorter, so none is longer). Anything odd takes the slow path below,
    # which names the first bad position.
    try:
        raw = b"".join(keys)  # type: ignore[arg-type]
    except TypeError:  # not all bytes-like
        raw = b""
    if len(raw) == count * KEY_BYTES and min(map(len, keys)) == KEY_BYTES:  # type: ignore[arg-type]
        return np.frombuffer(raw, dtype=np.uint64).reshape(count, 4)
    raw = b"".join(check_keys(keys, argument))
    return np.frombuffer(raw, dtype=np.uint64).reshape(count, 4)


def words_to_keys(words: np.ndarray) -> list[BlockKey]:
    """The inverse of ``key_words``: (n, 4) uint64 (or (n, 32) uint8) -> 32-byte keys."""
    raw = np.ascontiguousarray(words).tobytes()
    return [BlockKey(raw[i : i + KEY_BYTES]) for i in range(0, len(raw), KEY_BYTES)]


_STATE_SLOT = b"kvstore.swa.state-slot.v1\x00"


def state_slot(key: bytes, position: int) -> BlockKey:
    """The key an SWA state is kept under: its block key bound to the position it was taken at,
    so a state asked for at another position is a miss, never the state of another position."""
    data = _STATE_SLOT + bytes(key) + int(position).to_bytes(8, "little", signed=True)
    return BlockKey(hashlib.blake2b(data, digest_size=KEY_BYTES).digest())


def repeated_key(words: np.ndarray) -> int | None:
    """Index of the first key (row of (n, 4) words) that repeats an earlier one, or None.
    Chained prefix keys never repeat within a prompt: a repeat is a malformed request."""
    if words.shape[0] < 2:
        return None
    first_words = np.sort(words[:, 0])
    if not (first_words[1:] == first_words[:-1]).any():
        return None  # the common case, checked on one word per key (cheap on the hot path)
    rows = np.ascontiguousarray(words).view(np.dtype((np.void, KEY_BYTES))).ravel()
    _, first = np.unique(rows, return_index=True)
    if first.size == rows.size:
        return None
    seen = np.zeros(rows.size, dtype=bool)
    seen[first] = True
    return int(np.flatnonzero(~seen)[0])


def key_hex(key: bytes) -> str:
    """Short printable form for logs and error messages."""
    return bytes(key).hex()[:16]
