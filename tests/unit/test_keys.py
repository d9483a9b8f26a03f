"""Canonical chained block keys: stable, prefix-naming, and strict about their input."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (
    BLOCK_TOKENS,
    KEY_BYTES,
    ROOT_KEY,
    block_keys,
    chain_key,
    check_key,
    key_hex,
)

FINGERPRINT = b"v4.1-flash|890B|swa528"
TOKENS = [(7 * i + 3) % 50_000 for i in range(3 * BLOCK_TOKENS)]


def test_same_tokens_same_keys():
    first = block_keys(FINGERPRINT, TOKENS)
    again = block_keys(FINGERPRINT, list(TOKENS))
    assert first == again
    assert len(first) == 3
    assert all(len(key) == KEY_BYTES for key in first)
    assert len(set(first)) == 3


def test_key_matches_the_documented_formula():
    # BLAKE2b-256(domain | len(fingerprint) | fingerprint | parent | tokens as <u4), recomputed
    # here from the description so a silent change of the key format fails this test.
    block = np.arange(BLOCK_TOKENS, dtype="<u4")
    digest = hashlib.blake2b(digest_size=32)
    digest.update(b"kvstore.block.v1\x00")
    digest.update(len(FINGERPRINT).to_bytes(4, "little"))
    digest.update(FINGERPRINT)
    digest.update(bytes(32))
    digest.update(block.tobytes())
    assert chain_key(FINGERPRINT, ROOT_KEY, list(range(BLOCK_TOKENS))) == digest.digest()


def test_chain_names_the_whole_prefix():
    keys = block_keys(FINGERPRINT, TOKENS)
    assert keys[0] == chain_key(FINGERPRINT, ROOT_KEY, TOKENS[:128])
    assert keys[1] == chain_key(FINGERPRINT, keys[0], TOKENS[128:256])
    assert keys[2] == chain_key(FINGERPRINT, keys[1], TOKENS[256:384])
    # Continuing from a parent gives the same keys as hashing the whole sequence.
    assert block_keys(FINGERPRINT, TOKENS[128:], parent=keys[0]) == keys[1:]


def test_different_parent_gives_different_key():
    other_parent = chain_key(FINGERPRINT, ROOT_KEY, [1] * 128)
    assert chain_key(FINGERPRINT, ROOT_KEY, TOKENS[:128]) != chain_key(
        FINGERPRINT, other_parent, TOKENS[:128]
    )
    # Same second block after a different first block → different second key.
    changed = [TOKENS[0] + 1, *TOKENS[1:]]
    assert block_keys(FINGERPRINT, changed)[1] != block_keys(FINGERPRINT, TOKENS)[1]


def test_different_fingerprint_gives_different_key():
    assert block_keys(b"v4-pro", TOKENS) != block_keys(b"v4-flash", TOKENS)
    # The length prefix keeps (fingerprint, tokens) boundaries unambiguous.
    assert block_keys(b"a", TOKENS)[0] != block_keys(b"a\x00", TOKENS)[0]


@pytest.mark.parametrize("index", [0, 64, 127])
def test_one_token_changes_the_key(index):
    changed = list(TOKENS[:128])
    changed[index] += 1
    assert chain_key(FINGERPRINT, ROOT_KEY, changed) != chain_key(
        FINGERPRINT, ROOT_KEY, TOKENS[:128]
    )


def test_list_tuple_and_numpy_give_one_key():
    expected = block_keys(FINGERPRINT, TOKENS)
    assert block_keys(FINGERPRINT, tuple(TOKENS)) == expected
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_keys(FINGERPRINT, np.asarray(TOKENS, dtype=dtype)) == expected
    assert block_keys(bytearray(FINGERPRINT), TOKENS) == expected


def test_partial_block_is_ignored():
    keys = block_keys(FINGERPRINT, TOKENS)
    assert block_keys(FINGERPRINT, TOKENS + [1, 2, 3]) == keys
    assert block_keys(FINGERPRINT, TOKENS[:127]) == []
    assert block_keys(FINGERPRINT, TOKENS[:255]) == keys[:1]
    assert block_keys(FINGERPRINT, []) == []


@pytest.mark.parametrize(
    "tokens",
    [
        [-1] + [0] * 127,
        [2**32] + [0] * 127,
        [0.0] * 128,
        np.zeros(128, dtype=np.float32),
        np.zeros((2, 128), dtype=np.int64),
        [[1, 2], [3]],
        [True] * 128,
        ["1"] * 128,
        5,
    ],
)
def test_bad_token_ids_are_rejected(tokens):
    with pytest.raises(InvalidArgument) as caught:
        block_keys(FINGERPRINT, tokens)
    assert caught.value.argument == "token_ids"


def test_largest_token_id_is_accepted():
    assert len(block_keys(FINGERPRINT, [2**32 - 1] * 128)) == 1


def test_chain_key_checks_its_block():
    with pytest.raises(InvalidArgument) as caught:
        chain_key(FINGERPRINT, ROOT_KEY, [1] * 127)
    assert caught.value.argument == "block_tokens"
    with pytest.raises(InvalidArgument) as caught:
        chain_key(FINGERPRINT, ROOT_KEY, [-1] * 128)
    assert caught.value.argument == "block_tokens"
    with pytest.raises(InvalidArgument) as caught:
        chain_key(FINGERPRINT, b"short", [1] * 128)
    assert caught.value.argument == "parent"


def test_bad_fingerprint_and_parent_are_rejected():
    with pytest.raises(InvalidArgument) as caught:
        block_keys("v4-flash", TOKENS)  # type: ignore[arg-type]
    assert caught.value.argument == "model_fingerprint"
    # A bad parent fails even when there is no full block to hash.
    with pytest.raises(InvalidArgument) as caught:
        block_keys(FINGERPRINT, [1, 2], parent=b"x")  # type: ignore[arg-type]
    assert caught.value.argument == "parent"


def test_check_key_and_key_hex():
    key = block_keys(FINGERPRINT, TOKENS)[0]
    assert check_key(bytearray(key)) == key
    assert key_hex(key) == key.hex()[:16]
    for bad in (b"", bytes(31), bytes(33), "0" * 32, None):
        with pytest.raises(InvalidArgument) as caught:
            check_key(bad, "block_key")
        assert caught.value.argument == "block_key"


_PRINT_KEYS = (
    "from kvstore.keys import block_keys; "
    "print(' '.join(k.hex() for k in block_keys(b'fp', list(range(1000, 1000 + 384)))))"
)


def test_keys_are_identical_across_processes_and_hash_seeds():
    outputs = []
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", _PRINT_KEYS],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs.append(result.stdout.split())
    assert len(outputs[0]) == 3
    assert outputs[0] == outputs[1] == outputs[2]
    # And equal to what this process computes.
    here = [key.hex() for key in block_keys(b"fp", list(range(1000, 1000 + 384)))]
    assert outputs[0] == here
