"""The repair queue's order: most shards lost first, then by class rank, then most recently
used; drains last; bounded by bytes; a stripe repaired since the scan is skipped."""

from __future__ import annotations

import hashlib

import numpy as np

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.blockstore.meta import MetaShard
from kvstore.clock import ManualClock

CONFIG = BlockStoreConfig(meta_shards=1, storage_nodes=16)


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"q" + i.to_bytes(8, "little"), digest_size=32).digest()


def _commit(
    meta: MetaShard, key: bytes, placement: list[int], class_name: str, size: int = 10_000
) -> None:
    meta.begin_put([key], 1)
    row = np.asarray([placement], dtype=np.int32)
    assert meta.commit([key], 1, row, [size], CONFIG.class_id(class_name)) == [True]


def test_most_lost_first_then_longer_ttl_class_then_hot_then_drains() -> None:
    clock = ManualClock(1_000.0)
    meta = MetaShard(0, CONFIG, clock)
    base = list(range(12))
    # (key, placement, class): node 12 and 13 dead, node 14 draining
    layout = {
        "moving": ([14, *base[1:]], "chatbot"),
        "one-agent": ([12, *base[1:]], "agent"),
        "one-chatbot": ([12, *base[1:]], "chatbot"),
        "two-default": ([12, 13, *base[2:]], "default"),
        "one-lost-chatbot-hot": ([-1, *base[1:]], "chatbot"),
    }
    keys = {}
    for i, (name, (placement, class_name)) in enumerate(layout.items()):
        keys[name] = _key(i)
        clock.advance(1.0)
        _commit(meta, keys[name], placement, class_name)
    # the hot one was used last (its commit is the newest access)
    stripes, summary = meta.repair_queue(
        [12, 13], [14], limit=10, max_bytes=1 << 30, class_rank=CONFIG.repair_rank()
    )
    order = [next(n for n, k in keys.items() if k == s.key) for s in stripes]
    assert order == ["two-default", "one-lost-chatbot-hot", "one-chatbot", "one-agent", "moving"]
    assert summary["lost_2"] == 1 and summary["lost_1"] == 3 and summary["moving"] == 1
    assert summary["draining"] == {"14": 1}
    assert summary["bytes_left"] == (2 + 1 + 1 + 1 + 1) * 1000  # shard bytes to write
    # an explicit class order wins over TTLs
    rank = BlockStoreConfig(repair_class_order=("agent",)).repair_rank()
    stripes, _ = meta.repair_queue([12, 13], [14], 10, 1 << 30, rank, refresh=True)
    assert [s.key for s in stripes][1] == keys["one-agent"]


def test_a_round_is_bounded_by_bytes_and_skips_what_was_repaired_since() -> None:
    meta = MetaShard(0, CONFIG, ManualClock(1_000.0))
    keys = [_key(100 + i) for i in range(10)]
    for key in keys:
        _commit(meta, key, [12, *range(1, 12)], "default", size=100_000)
    # k=10 shards of 10,000 bytes read per stripe: 250,000 bytes fit two stripes
    stripes, _ = meta.repair_queue([12], [], limit=100, max_bytes=250_000)
    assert len(stripes) == 2
    # a stripe repaired behind the queue's back is not handed out again
    skipped = next(k for k in keys if k not in {s.key for s in stripes})
    assert meta.set_placements([(skipped, 0, 13, 12)]) == [True]
    rest, _ = meta.repair_queue([12], [], limit=100, max_bytes=1 << 30)
    assert len(rest) == 7 and skipped not in {s.key for s in rest}
    # one stripe larger than the whole budget still goes, alone
    again, _ = meta.repair_queue([12], [], limit=100, max_bytes=1, refresh=True)
    assert len(again) == 1


def test_an_idle_shard_scans_nothing() -> None:
    meta = MetaShard(0, CONFIG, ManualClock(1_000.0))
    _commit(meta, _key(1), list(range(12)), "default")
    stripes, summary = meta.repair_queue([], [], limit=10, max_bytes=1 << 30)
    assert stripes == [] and summary["stripes_left"] == 0
    # a shard recorded lost (scrub) makes the next call scan
    assert meta.set_placements([(_key(1), 5, -1, 5)]) == [True]
    stripes, summary = meta.repair_queue([], [], limit=10, max_bytes=1 << 30, refresh=True)
    assert len(stripes) == 1 and summary["lost_1"] == 1
