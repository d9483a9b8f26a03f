"""The exception tree: messages name the field, status codes map, errors survive pickling."""

from __future__ import annotations

import pickle

import pytest

from kvstore.errors import (
    ConfigError,
    CorruptShard,
    InvalidArgument,
    KVStoreError,
    Overloaded,
    StateRejected,
    TooFewShards,
    grpc_status_name,
)


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("gc.watermarks.high", "must be in (0, 1]"),
        InvalidArgument("prompt_len", "must be ≥ 0"),
        StateRejected("state", "wrong size"),
        TooFewShards("block ab12: 9 good shards"),
        Overloaded("256 in flight"),
    ],
)
def test_errors_round_trip_through_pickle(error: KVStoreError) -> None:
    # Ray carries exceptions raised in actors by pickling them.
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert grpc_status_name(copy) == grpc_status_name(error)


def test_messages_name_the_field() -> None:
    assert str(InvalidArgument("prompt_len", "must be ≥ 0")).startswith("prompt_len: ")
    assert ConfigError("yoco_keep", "at least 134").field == "yoco_keep"


def test_status_codes() -> None:
    assert grpc_status_name(InvalidArgument("x", "y")) == "INVALID_ARGUMENT"
    assert grpc_status_name(Overloaded("busy")) == "RESOURCE_EXHAUSTED"
    assert grpc_status_name(CorruptShard("bad")) == "DATA_LOSS"
    assert grpc_status_name(ValueError("unexpected")) == "INTERNAL"
