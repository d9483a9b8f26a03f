"""Mooncake request traces (FAST'25 release): reading them and mapping them to kvstore blocks.

One JSON object a line: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (remapped prefix-block hashes of 512 tokens each:
equal ids mean the same prefix, so reusable KV).

Mapping to kvstore: hash id ``h`` stands for 512 token ids of its own (``h * 512 + t``), so a
request's prompt is the concatenation of its ids' tokens cut to ``input_length``, and its
kvstore block keys are the canonical chained keys of that prompt (``kvstore.keys``): four
128-token blocks per id, each key naming its whole prefix exactly as an engine's would. Two
requests that share their first ids share those blocks' keys; a request's last, partial id
contributes only its full 128-token blocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import BLOCK_TOKENS, block_key_words

#: Tokens per hash id in Mooncake's traces.
TRACE_BLOCK_TOKENS = 512
SUB_BLOCKS = TRACE_BLOCK_TOKENS // BLOCK_TOKENS
_MAX_ID = (2**32) // TRACE_BLOCK_TOKENS - 1  # token ids are uint32


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, in file order ``line`` (1-based) and time ``at_s``."""

    line: int
    at_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        """kvstore blocks of the prompt: its full 128-token blocks that its ids cover."""
        return min(self.input_length // BLOCK_TOKENS, len(self.hash_ids) * SUB_BLOCKS)

    def tokens(self) -> np.ndarray:
        """The prompt's (synthetic) token ids: id ``h``'s 512 tokens are ``h * 512 + t``."""
        ids = np.asarray(self.hash_ids, dtype=np.uint64)
        tokens = (ids[:, None] * TRACE_BLOCK_TOKENS + np.arange(TRACE_BLOCK_TOKENS)).ravel()
        return tokens[: self.input_length].astype(np.uint32)

    def key_words(self, model_fingerprint: bytes) -> np.ndarray:
        """The chained keys of the prompt's full blocks, as (n, 4) uint64 words."""
        words = block_key_words(model_fingerprint, self.tokens())
        return words[: self.full_blocks]


def _field(record: dict[str, object], name: str, line: int, path: Path) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument("--trace", f"{path}:{line}: {name!r} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (name != "timestamp" and value != int(value)):
        raise InvalidArgument(
            "--trace", f"{path}:{line}: {name!r} must be a whole number >= 0, got {value!r}"
        )
    return value  # type: ignore[return-value]


def _parse(text: str, line: int, path: Path) -> TraceRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgument("--trace", f"{path}:{line}: not JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise InvalidArgument("--trace", f"{path}:{line}: must be a JSON object")
    stamp = float(_field(record, "timestamp", line, path))
    length = int(_field(record, "input_length", line, path))
    output = int(record.get("output_length", 0) or 0)
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_ID for i in ids
    ):
        raise InvalidArgument(
            "--trace",
            f"{path}:{line}: 'hash_ids' must be a list of integers in [0, {_MAX_ID}]",
        )
    if length < 1:
        raise InvalidArgument("--trace", f"{path}:{line}: 'input_length' must be >= 1")
    return TraceRequest(line, stamp / 1000.0, length, output, tuple(ids))


def iter_trace(path: Path) -> Iterator[TraceRequest]:
    """The requests of a trace file in file order (blank lines skipped); a bad line raises
    ``InvalidArgument`` naming the file and line."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as error:
        raise InvalidArgument("--trace", f"cannot read {path}: {error.strerror}") from None
    with handle:
        for line, text in enumerate(handle, start=1):
            if text.strip():
                yield _parse(text, line, path)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace (all when None) in timestamp order (file order
    among equal timestamps, as the trace lists turns of a conversation)."""
    if limit is not None and limit < 1:
        raise InvalidArgument("--limit", f"must be >= 1, got {limit}")
    requests: list[TraceRequest] = []
    for request in iter_trace(path):
        requests.append(request)
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise InvalidArgument("--trace", f"{path} holds no request")
    return sorted(requests, key=lambda r: (r.at_s, r.line))


@dataclass(frozen=True)
class TraceFacts:
    requests: int
    input_tokens: int
    seconds: float
    trace_blocks: int  # hash ids, counted with repeats
    unique_trace_blocks: int
    kv_blocks: int  # kvstore blocks, counted with repeats
    unique_kv_blocks: int


def trace_facts(requests: list[TraceRequest], key_words: list[np.ndarray]) -> TraceFacts:
    """What a trace holds, counted once (``key_words``: each request's ``key_words``)."""
    unique = {row.tobytes() for words in key_words for row in words}
    return TraceFacts(
        requests=len(requests),
        input_tokens=sum(r.input_length for r in requests),
        seconds=max(r.at_s for r in requests) - min(r.at_s for r in requests),
        trace_blocks=sum(len(r.hash_ids) for r in requests),
        unique_trace_blocks=len({i for r in requests for i in r.hash_ids}),
        kv_blocks=sum(len(words) for words in key_words),
        unique_kv_blocks=len(unique),
    )
