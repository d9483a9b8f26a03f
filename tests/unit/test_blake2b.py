"""The C BLAKE2b (``kvstore/_blake2b.c``) against hashlib: tenant namespaces (``namespaced``) and
chained block keys (``block_key_words``) give the same digests through the extension and
through the hashlib fallback; ``repeated_key`` finds the first repeat a naive loop finds."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore.keys as keys_module
import kvstore.tenants as tenants_module
from kvstore.errors import InvalidArgument
from kvstore.keys import (
    BLOCK_TOKENS,
    KEY_BYTES,
    ROOT_KEY,
    block_key_words,
    block_keys,
    chain_key,
    key_words,
    repeated_key,
    state_slot,
    words_to_keys,
)
from kvstore.tenants import namespaced, namespaced_key


def test_the_extension_is_built() -> None:
    # `pip install` builds it; without it the comparisons below would compare the fallback with
    # itself, so a missing build must fail here rather than pass quietly.
    assert tenants_module._native is not None and keys_module._native is not None


@contextmanager
def fallback(module: ModuleType) -> Iterator[None]:
    """``module`` without its C extension (the hashlib path) for the duration."""
    native = module._native
    module._native = None
    try:
        yield
    finally:
        module._native = native


def words_of(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint64).reshape(-1, 4).copy()


# --- namespaced ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    salt=st.binary(min_size=1, max_size=64),
    raw=st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=50),
)
def test_namespaced_in_c_equals_the_hashlib_fallback(salt: bytes, raw: list[bytes]) -> None:
    words = words_of(b"".join(raw))
    before = words.copy()
    native = namespaced(salt, words)
    with fallback(tenants_module):
        python = namespaced(salt, words)
    assert native.shape == python.shape == (len(raw), 4) and native.dtype == np.uint64
    assert np.array_equal(native, python)
    assert np.array_equal(words, before)  # the input is not written to
    expected = [hashlib.blake2b(key, key=salt, digest_size=KEY_BYTES).digest() for key in raw]
    assert words_to_keys(native) == expected
    assert [namespaced_key(salt, key) for key in raw] == expected


def test_namespaced_at_the_salt_size_bounds_and_on_odd_layouts() -> None:
    rng = np.random.default_rng(7)
    big = rng.integers(0, 2**63, (40, 4), dtype=np.uint64)
    strided = big[::3]  # not contiguous
    for salt in (b"\x00", b"\xff" * 64, bytes(range(63)), bytes(32)):
        native = namespaced(salt, strided)
        with fallback(tenants_module):
            python = namespaced(salt, strided)
        assert np.array_equal(native, python)
        assert words_to_keys(native) == [namespaced_key(salt, k) for k in words_to_keys(strided)]
    # Different salts: different namespaces; the key itself never comes back.
    one, two = namespaced(b"a" * 32, big), namespaced(b"b" * 32, big)
    assert not (one == two).all(axis=1).any() and not (one == big).all(axis=1).any()
    empty = namespaced(b"salt", np.zeros((0, 4), dtype=np.uint64))
    assert empty.shape == (0, 4)


def test_namespaced_refuses_a_salt_beyond_64_bytes_both_ways() -> None:
    words = np.zeros((1, 4), dtype=np.uint64)
    with pytest.raises(ValueError):
        namespaced(b"x" * 65, words)
    with fallback(tenants_module), pytest.raises(ValueError):
        namespaced(b"x" * 65, words)


# --- block_key_words ----------------------------------------------------------------------------


@st.composite
def prompts(draw: st.DrawFn) -> tuple[bytes, bytes, np.ndarray]:
    fingerprint = draw(st.binary(min_size=1, max_size=200))
    parent = draw(
        st.one_of(st.just(bytes(ROOT_KEY)), st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))
    )
    count = draw(st.integers(0, 2000))
    seed = draw(st.integers(0, 2**32 - 1))
    tokens = np.random.default_rng(seed).integers(0, 2**32, count, dtype=np.uint64)
    if count:
        # The ends of the token id range, at places hypothesis picks.
        for index in draw(st.lists(st.integers(0, count - 1), max_size=4)):
            tokens[index] = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1]))
    return fingerprint, parent, tokens


def reference_chain(fingerprint: bytes, parent: bytes, tokens: np.ndarray) -> list[bytes]:
    out = []
    for start in range(0, tokens.size - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = chain_key(fingerprint, parent, tokens[start : start + BLOCK_TOKENS])
        out.append(parent)
    return out


@settings(max_examples=150, deadline=None)
@given(prompt=prompts())
def test_block_key_words_in_c_equals_the_hashlib_fallback(
    prompt: tuple[bytes, bytes, np.ndarray],
) -> None:
    fingerprint, parent, tokens = prompt
    native = block_key_words(fingerprint, tokens, parent)
    with fallback(keys_module):
        python = block_key_words(fingerprint, tokens, parent)
    full = tokens.size // BLOCK_TOKENS
    assert native.shape == python.shape == (full, 4) and native.dtype == np.uint64
    assert np.array_equal(native, python)
    assert words_to_keys(native) == reference_chain(fingerprint, parent, tokens)
    # A list, a tuple and an array of another integer dtype are the same tokens.
    as_list = tokens.tolist()
    assert np.array_equal(block_key_words(fingerprint, as_list, parent), native)
    assert np.array_equal(block_key_words(fingerprint, tuple(as_list), parent), native)
    assert np.array_equal(block_key_words(fingerprint, tokens.astype(np.int64), parent), native)


@settings(max_examples=100, deadline=None)
@given(prompt=prompts())
def test_block_keys_are_the_words_of_block_key_words(
    prompt: tuple[bytes, bytes, np.ndarray],
) -> None:
    fingerprint, parent, tokens = prompt
    words = block_key_words(fingerprint, tokens, parent)
    keys = block_keys(fingerprint, tokens, parent)
    assert keys == words_to_keys(words)
    assert all(type(key) is bytes and len(key) == KEY_BYTES for key in keys)
    assert np.array_equal(key_words(keys), words)
    with fallback(keys_module):
        assert block_keys(fingerprint, tokens, parent) == keys


def test_chained_keys_name_the_whole_prefix() -> None:
    fingerprint = b"model"
    tokens = np.arange(4 * BLOCK_TOKENS + 5, dtype=np.uint64)
    keys = block_keys(fingerprint, tokens)
    assert len(keys) == 4 and len(set(keys)) == 4
    changed = tokens.copy()
    changed[BLOCK_TOKENS + 3] += 1  # in block 1: blocks 1.. change, block 0 does not
    other = block_keys(fingerprint, changed)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:], strict=True))
    assert block_keys(b"another-model", tokens)[0] != keys[0]
    # Continuing from a block's key gives the rest of the chain.
    assert block_keys(fingerprint, tokens[2 * BLOCK_TOKENS :], keys[1]) == keys[2:]


def test_a_fingerprint_of_the_longest_preset_size_works_both_ways() -> None:
    tokens = np.arange(3 * BLOCK_TOKENS, dtype=np.uint64)
    for size in (484, 1003):  # 1003: the longest the C prefix buffer takes
        fingerprint = bytes(range(256)) * 4
        fingerprint = fingerprint[:size]
        native = block_key_words(fingerprint, tokens)
        with fallback(keys_module):
            assert np.array_equal(block_key_words(fingerprint, tokens), native)


def test_a_long_fingerprint_gives_the_fallbacks_keys() -> None:
    tokens = np.arange(2 * BLOCK_TOKENS, dtype=np.uint64)
    fingerprint = b"f" * 1004
    with fallback(keys_module):
        expected = block_key_words(fingerprint, tokens)
    assert np.array_equal(block_key_words(fingerprint, tokens), expected)


def test_bad_input_is_refused_the_same_way_both_ways() -> None:
    for path in ("native", "fallback"):
        with fallback(keys_module) if path == "fallback" else nullcontext():
            with pytest.raises(InvalidArgument, match="parent"):
                block_key_words(b"fp", [], b"short")
            with pytest.raises(InvalidArgument, match="model_fingerprint"):
                block_key_words("fp", [1, 2])  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="token_ids"):
                block_key_words(b"fp", [2**32] * BLOCK_TOKENS)
            with pytest.raises(InvalidArgument, match="token_ids"):
                block_key_words(b"fp", [-1] * BLOCK_TOKENS)
            with pytest.raises(InvalidArgument, match="token_ids"):
                block_key_words(b"fp", np.zeros((2, BLOCK_TOKENS), dtype=np.uint32))
            assert block_key_words(b"fp", list(range(BLOCK_TOKENS - 1))).shape == (0, 4)


# --- repeated_key and state_slot ----------------------------------------------------------------


def naive_first_repeat(rows: list[bytes]) -> int | None:
    for index, row in enumerate(rows):
        if row in rows[:index]:
            return index
    return None


@st.composite
def key_lists(draw: st.DrawFn) -> list[bytes]:
    """Up to 50 keys drawn from a small pool in which many keys share their first word (and
    some their first three) but differ later, so the one-word shortcut is exercised."""
    firsts = draw(st.lists(st.binary(min_size=8, max_size=8), min_size=1, max_size=4))
    pool = []
    for first in firsts:
        for tail in draw(
            st.lists(st.binary(min_size=24, max_size=24), min_size=1, max_size=4, unique=True)
        ):
            pool.append(first + tail)
            pool.append(first + tail[:16] + bytes(8))  # equal up to the last word
    pool = list(dict.fromkeys(pool))
    return draw(st.lists(st.sampled_from(pool), max_size=50))


@settings(max_examples=150, deadline=None)
@given(rows=key_lists())
def test_repeated_key_finds_the_first_repeat_a_naive_loop_finds(rows: list[bytes]) -> None:
    words = key_words(rows) if rows else np.zeros((0, 4), dtype=np.uint64)
    assert repeated_key(words) == naive_first_repeat(rows)
    # The same on a non-contiguous copy of the words.
    spread = np.zeros((2 * len(rows), 4), dtype=np.uint64)
    spread[::2] = words
    assert repeated_key(spread[::2]) == naive_first_repeat(rows)


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=50))
def test_repeated_key_on_random_keys(rows: list[bytes]) -> None:
    words = key_words(rows) if rows else np.zeros((0, 4), dtype=np.uint64)
    assert repeated_key(words) == naive_first_repeat(rows)


def test_repeated_key_examples() -> None:
    def k(*w: int) -> list[int]:
        return list(w)

    same_first = np.array([k(1, 2, 3, 4), k(1, 2, 3, 5), k(1, 9, 3, 4)], dtype=np.uint64)
    assert repeated_key(same_first) is None  # equal first words, different keys
    later = np.array([k(1, 2, 3, 4), k(1, 2, 3, 5), k(7, 7, 7, 7), k(1, 2, 3, 5)], dtype=np.uint64)
    assert repeated_key(later) == 3
    two = np.array([k(5, 0, 0, 1), k(9, 0, 0, 0), k(9, 0, 0, 0), k(5, 0, 0, 1)], dtype=np.uint64)
    assert repeated_key(two) == 2  # the first index that repeats, not the first key repeated
    assert repeated_key(np.zeros((1, 4), dtype=np.uint64)) is None
    assert repeated_key(np.zeros((0, 4), dtype=np.uint64)) is None
    assert repeated_key(np.zeros((2, 4), dtype=np.uint64)) == 1


def test_state_slot_binds_a_key_to_one_position() -> None:
    key = bytes(range(32))
    other = bytes(range(1, 33))
    slots = {state_slot(key, position) for position in range(0, 128 * 50, 128)}
    assert len(slots) == 50
    assert state_slot(key, 256) == state_slot(bytearray(key), 256)
    assert state_slot(key, 256) != state_slot(other, 256)
    assert state_slot(key, 256) != key and len(state_slot(key, 256)) == KEY_BYTES
    assert state_slot(key, -128) != state_slot(key, 128)
    expected = hashlib.blake2b(
        b"kvstore.swa.state-slot.v1\x00" + key + (256).to_bytes(8, "little", signed=True),
        digest_size=KEY_BYTES,
    ).digest()
    assert state_slot(key, 256) == expected
