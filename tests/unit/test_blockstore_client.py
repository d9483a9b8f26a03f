"""The block client over plain nodes and meta shards in one process (no Ray): the write rule,
degraded and hedged reads, misses instead of exceptions, never wrong bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from blockstore_tier import Tier

from kvstore.blockstore.client import BlockStoreClient
from kvstore.blockstore.fanout import META, NODE
from kvstore.blockstore.placement import place
from kvstore.blockstore.records import Lease
from kvstore.blockstore.segments import SEGMENT_HEADER_BYTES
from kvstore.ec import Codec
from kvstore.errors import ConfigError, InvalidArgument


def _key(i: int) -> bytes:
    return hashlib.blake2b(b"client" + i.to_bytes(8, "little"), digest_size=32).digest()


def _payload(i: int, size: int = 6000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def tier(tmp_path: Path) -> Tier:
    return Tier(tmp_path)


def _same(got: np.ndarray | None, want: np.ndarray) -> bool:
    return got is not None and got.tobytes() == want.tobytes()


def _flip_last_byte(shard: np.ndarray) -> np.ndarray:
    shard[-1] ^= 0x55
    return shard


def test_put_lookup_get_round_trip_is_bit_exact(tier: Tier) -> None:
    keys = [_key(i) for i in range(8)]
    payloads = [_payload(i, 3000 + 997 * i) for i in range(8)]
    result = tier.client.put_blocks(keys, payloads, "agent")
    assert result.stored == keys and result.ok
    found = tier.client.lookup(keys)
    assert found.hit_blocks == 8 and found.lease is not None
    assert [b.size for b in found.lease.blocks] == [p.size for p in payloads]
    got = tier.client.get_blocks(keys, found.lease)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert got[0] is not None and not got[0].flags.writeable
    assert all(_same(g, p) for g, p in zip(tier.client.get_blocks(keys), payloads, strict=True))
    tier.client.release(found.lease)
    again = tier.client.put_blocks(keys[:2], [b"x", b"y"])
    assert again.existing == keys[:2] and again.stored == []
    stats = tier.metas[0].stats()
    assert stats["bytes_by_class"]["agent"] > 0


def test_a_put_of_stored_and_new_keys_writes_only_the_new_ones(tier: Tier) -> None:
    keys = [_key(i) for i in range(12)]
    payloads = [_payload(i, 9000) for i in range(12)]
    stored_first = [0, 3, 4, 9]
    first = tier.client.put_blocks(
        [keys[i] for i in stored_first], [payloads[i] for i in stored_first]
    )
    assert first.ok
    result = tier.client.put_blocks(keys, [_payload(100 + i, 9000) for i in range(12)])
    assert sorted(result.existing) == sorted(keys[i] for i in stored_first)
    fresh = [i for i in range(12) if i not in stored_first]
    assert result.stored == [keys[i] for i in fresh] and not result.under_redundant
    second = [_payload(100 + i, 9000) for i in range(12)]
    want = [payloads[i] if i in stored_first else second[i] for i in range(12)]
    got = tier.client.get_blocks(keys)
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))
    assert tier.client.counters["degraded_blocks"] == 0  # each whole, from its data shards


def test_a_payload_the_codec_refuses_gives_its_batchs_reservations_back(tier: Tier) -> None:
    keys = [_key(i) for i in range(3)]
    with pytest.raises(InvalidArgument, match="payload"):
        tier.client.put_blocks(keys, [_payload(0), "not bytes", _payload(2)])
    # Not left reserved by the failed call (another writer's reservation would say busy).
    result = tier.client.put_blocks(keys, [_payload(i) for i in range(3)])
    assert result.stored == keys and not result.busy


def test_lookup_is_the_longest_consecutive_prefix_and_leases_only_it(tier: Tier) -> None:
    keys = [_key(i) for i in range(6)]
    tier.client.put_blocks([keys[i] for i in (0, 1, 2, 4, 5)], [_payload(i) for i in range(5)])
    found = tier.client.lookup(keys)
    assert found.hit_blocks == 3 and found.keys == keys[:3]
    tier.client.flush_releases()  # blocks beyond the prefix are given back without waiting
    assert _leased(tier) == set(keys[:3])  # blocks 4, 5 were leased by their shard, then released
    assert tier.client.lookup([_key(99)] + keys).hit_blocks == 0
    assert tier.client.get_blocks([_key(99)]) == [None]


def _leased(tier: Tier) -> set[bytes]:
    return {
        bytes(k)
        for m in tier.metas.values()
        for k, count in zip(
            m.snapshot_table().column("key").to_pylist(),
            m.snapshot_table().column("lease_count").to_pylist(),
            strict=True,
        )
        if count
    }


def test_a_release_without_waiting_rides_on_the_next_lookup(tmp_path: Path) -> None:
    tier = Tier(tmp_path, release_batch_s=1.0)  # the flusher waits long: the lookup comes first
    keys = [_key(i) for i in range(40)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(40)])
    first = tier.client.lookup(keys[:20])
    assert _leased(tier) == set(keys[:20])
    tier.client.release_many([first.lease], wait=False)
    assert _leased(tier) == set(keys[:20])  # deferred, not sent yet
    tier.fanout.calls.clear()
    second = tier.client.lookup(keys[20:])
    assert _leased(tier) == set(keys[20:])  # the first lease went back with this lookup
    assert all(method == "lookup_wire" for _, method in tier.fanout.calls), tier.fanout.calls
    tier.client.release(second.lease)  # waited for: sent at once
    assert _leased(tier) == set()


def test_a_deferred_release_is_sent_by_itself_when_no_lookup_comes(tmp_path: Path) -> None:
    tier = Tier(tmp_path, release_batch_s=0.01)
    keys = [_key(i) for i in range(12)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(12)])
    tier.client.release_many([tier.client.lookup(keys).lease], wait=False)
    deadline = time.monotonic() + 10
    while _leased(tier) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _leased(tier) == set()
    assert any(method == "release" for _, method in tier.fanout.calls)


def test_a_release_by_stale_rows_finds_its_keys_again(tier: Tier) -> None:
    keys = [_key(i) for i in range(30)]
    tier.client.put_blocks(keys, [_payload(i, 500) for i in range(30)])
    lease = tier.client.lookup(keys).lease
    assert lease is not None and lease.rows is not None
    # Rows that no longer name these keys (as after a meta shard restart): all row 0.
    shuffled = Lease(
        lease.lease_id,
        lease.until,
        lease.key_words,
        lease.placements,
        lease.sizes,
        np.zeros_like(lease.rows),
    )
    tier.client.release(shuffled)
    assert _leased(tier) == set()


def test_bytes_and_arrays_of_any_dtype_are_payloads(tier: Tier) -> None:
    floats = np.linspace(0, 1, 999, dtype=np.float32)
    tier.client.put_blocks([_key(1), _key(2)], [b"hello" * 999, floats])
    got = tier.client.get_blocks([_key(1), _key(2)])
    assert got[0] is not None and got[0].tobytes() == b"hello" * 999
    assert got[1] is not None and got[1].tobytes() == floats.tobytes()


def test_bad_arguments_are_typed_errors(tier: Tier) -> None:
    with pytest.raises(InvalidArgument, match="payloads"):
        tier.client.put_blocks([_key(1)], [])
    with pytest.raises(InvalidArgument, match="keys"):
        tier.client.put_blocks([_key(1), _key(1)], [b"a", b"b"])
    with pytest.raises(InvalidArgument, match=r"keys\[0\]"):
        tier.client.lookup([b"short"])
    with pytest.raises(ConfigError, match="traffic_class"):
        tier.client.put_blocks([_key(1)], [b"a"], "nope")


def test_two_dead_nodes_cost_nothing_three_in_a_stripe_make_it_a_miss(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(40)]
    payloads = [_payload(i) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    tier.fanout.dead |= {(NODE, 0), (NODE, 5)}
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    tier.fanout.dead.add((NODE, 9))
    placements = place(keys, range(14), 12)
    lost = (np.isin(placements, [0, 5, 9]).sum(axis=1) >= 3).tolist()
    assert any(lost) and not all(lost)
    outcome = tier.client.read(keys)
    for g, p, is_lost in zip(outcome.payloads, payloads, lost, strict=True):
        assert (g is None) if is_lost else _same(g, p)
    # Each miss says why: which shards came, and that the other nodes failed.
    for position, (placement, is_lost) in enumerate(zip(placements, lost, strict=True)):
        failed = sorted({0, 5, 9} & set(placement.tolist()))
        said = f"{12 - len(failed)} of 12 shards came (10 needed); failed: {failed}"
        assert outcome.why.get(position) == (said if is_lost else None)
    hit = tier.client.lookup(keys).hit_blocks
    assert hit == lost.index(True)


def test_a_node_skipped_as_down_is_asked_when_a_block_cannot_be_read_without_it(
    tmp_path: Path,
) -> None:
    # Two nodes dead (a host cut off) and a third that failed one call a moment ago but
    # answers now: the blocks with a shard on each of the three are read, not missed.
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(40)]
    payloads = [_payload(i) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    tier.fanout.dead |= {(NODE, 0), (NODE, 5)}
    tier.client._mark_failed(9)
    needs_9 = np.isin(place(keys, range(14), 12), [0, 5, 9]).sum(axis=1) >= 3
    assert needs_9.any() and not needs_9.all()
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.counters["get_misses"] == 0
    assert 9 not in tier.client.down_nodes()  # it answered: up again


def test_a_lookup_probes_a_node_down_on_one_failed_call_instead_of_missing_its_blocks(
    tmp_path: Path,
) -> None:
    # 12 nodes: every stripe has a shard on each. Two are declared down by the cluster, and a
    # third failed one call a moment ago but answers now: every block is readable (10 of its
    # 12 shards) and a read returns it, so the lookup must hit it too.
    tier = Tier(tmp_path)
    keys = [_key(i) for i in range(8)]
    payloads = [_payload(i) for i in range(8)]
    assert tier.client.put_blocks(keys, payloads).ok
    for meta in tier.metas.values():
        meta.mark_nodes(down=[0, 1])
    tier.fanout.dead |= {(NODE, 0), (NODE, 1)}
    tier.client._mark_failed(2)
    found = tier.client.lookup(keys)
    assert found.hit_blocks == 8 and found.lease is not None
    got = tier.client.get_blocks(keys, found.lease)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    tier.client.release(found.lease)
    # It answered its probe: lookups count it up for the rest of its skip without asking it
    # again (writes still leave it out until then: a failed put may have been the reason).
    again = tier.client.lookup(keys)
    assert again.hit_blocks == 8
    tier.client.release(again.lease)
    assert tier.fanout.calls.count(((NODE, 2), "holds")) == 1
    # A node that fails its probe too is down: the blocks that need it are not hit, and what
    # the meta shards leased of them is given back.
    tier.fanout.dead.add((NODE, 3))
    tier.client._mark_failed(3)
    assert tier.client.lookup(keys).hit_blocks == 0
    tier.client.flush_releases()
    assert _leased(tier) == set()
    # Confirmed down now: the next lookup does not probe it again.
    probes = tier.fanout.calls.count(((NODE, 3), "holds"))
    assert probes == 1
    assert tier.client.lookup(keys).hit_blocks == 0
    assert tier.fanout.calls.count(((NODE, 3), "holds")) == probes


def test_reads_rebuilt_from_parity_are_counted_as_degraded(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    keys = [_key(i) for i in range(40)]
    payloads = [_payload(i) for i in range(40)]
    assert tier.client.put_blocks(keys, payloads).ok
    assert all(_same(g, p) for g, p in zip(tier.client.get_blocks(keys), payloads, strict=True))
    assert tier.client.counters["degraded_blocks"] == 0
    tier.fanout.dead |= {(NODE, 2), (NODE, 7)}
    placements = place(keys, range(14), 12)
    # Shards 0..9 are data: a block is degraded when a data shard sat on a dead node.
    needs_parity = int(np.isin(placements[:, :10], [2, 7]).any(axis=1).sum())
    assert needs_parity > 0
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.counters["degraded_blocks"] == needs_parity


def _data_holders(key: bytes, nodes: int) -> list[int]:
    """The nodes holding ``key``'s data shards (a read that knows no slow node asks them)."""
    return [int(n) for n in place([key], range(nodes), 12)[0, :10]]


def _asked_node(tier: Tier, key: bytes) -> int:
    """A node the next read of ``key`` asks first: one holding a data shard of it, and not slow
    by the client's latency estimates (in-process they are microseconds, and one scheduling
    hiccup can make a node count as slow; then reads ask it last, and hanging it proves
    nothing)."""
    slow = tier.client.stats()["slow_nodes"]
    assert isinstance(slow, list)
    return next(n for n in _data_holders(key, len(tier.nodes)) if n not in slow)


def test_a_hung_node_is_hedged_around(tmp_path: Path) -> None:
    tier = Tier(tmp_path, call_timeout_s=3.0)
    keys = [_key(i) for i in range(10)]
    payloads = [_payload(i) for i in range(10)]
    tier.client.put_blocks(keys, payloads)
    tier.fanout.hung.add((NODE, _asked_node(tier, keys[0])))
    started = time.monotonic()
    got = tier.client.get_blocks(keys)
    assert time.monotonic() - started < tier.config.call_timeout_s
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))
    assert tier.client.stats()["hedged_reads"] >= 1


def test_a_read_whose_answers_are_in_does_not_hedge_however_late_the_reader_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader descheduled past its hedge time (a busy host: CI's two cores) found its answers
    # waiting, yet hedged, because it looked at the clock before at them. A hedge delay of 1 ns
    # makes every read that late: the in-process nodes answered while they were asked.
    # No sampled probes of slow nodes (``fetches % 1`` is never 1): on a loaded host any node
    # can look slow, and each probe is one more get, so only hedges could add gets here.
    monkeypatch.setattr("kvstore.blockstore.reads._LATENCY_SAMPLE_EVERY", 1)
    tier = Tier(tmp_path, hedge_after_s=1e-9)
    key, payload = _key(1), _payload(1)
    tier.client.put_blocks([key], [payload])
    before = len(tier.fanout.calls)
    for _ in range(10):  # fewer than are timed before the learned delay takes over
        assert _same(tier.client.get_blocks([key])[0], payload)
    assert tier.client.stats().get("hedged_reads", 0) == 0
    gets = [target for target, method in tier.fanout.calls[before:] if method == "get"]
    assert len(gets) == 10 * tier.config.data_shards  # k nodes a read, no more


def test_a_node_is_slow_only_when_it_is_slower_by_a_margin_that_matters(tmp_path: Path) -> None:
    # Microseconds apart is noise (one scheduling hiccup), not a reason to read parity instead.
    tier = Tier(tmp_path)
    for node in range(12):
        tier.client._note_latency(node, 20e-6)
    tier.client._note_latency(4, 0.0004)  # 20x the median, yet 0.4 ms: not slow
    assert tier.client.stats()["slow_nodes"] == []
    tier.client._note_latency(4, 0.005, lower_bound=True)  # 5 ms: slow
    assert tier.client.stats()["slow_nodes"] == [4]


def test_a_node_that_stays_slow_costs_one_hedge_not_one_per_probe(tmp_path: Path) -> None:
    # Every few reads also probe the slow node; the read is done before the probe answers, so
    # the probe's wait is only a lower bound of the node's latency. Folded in as an answer it
    # made the hung node look fast again every few probes, and the next read waited for its
    # hedge again (the chaos slow-node scenario's p99 at 4.6x normal).
    tier = Tier(tmp_path)
    key, payload = _key(1), _payload(1)
    tier.client.put_blocks([key], [payload])
    tier.fanout.hung.add((NODE, _data_holders(key, 12)[0]))
    for _ in range(200):
        assert _same(tier.client.get_blocks([key])[0], payload)
    # One hedge at most: the first read's, which finds the node hung.
    assert tier.client.stats().get("hedged_reads", 0) <= 1


def test_a_reader_that_stalls_does_not_bring_a_node_known_slow_back(tmp_path: Path) -> None:
    # A reader that sleeps until all its calls answered takes their answers together: each
    # node's time is then only a bound. Folded in as times, three reads whose reader was
    # descheduled for 80 ms (a busy host) raised every node's estimate to ~30 ms, the hung
    # node's 20 ms fell under twice that median, and the next read asked it and hedged again.
    tier = Tier(tmp_path, hedge_after_s=0.02)
    key, payload = _key(1), _payload(1)
    tier.client.put_blocks([key], [payload])
    hung = _data_holders(key, 12)[0]
    tier.fanout.hung.add((NODE, hung))
    wait, reads = tier.fanout.wait, [0]

    def stalled(tickets: Any, timeout: float, all_of: bool = False) -> Any:
        ready = wait(tickets, timeout, all_of)
        if 42 <= reads[0] < 45 and ready:  # reads that sample no node (one in 8 does)
            time.sleep(0.08)  # descheduled before taking the answers
        return ready

    tier.fanout.wait = stalled  # type: ignore[method-assign]
    for reads[0] in range(60):
        assert _same(tier.client.get_blocks([key])[0], payload)
    assert tier.client.stats().get("hedged_reads", 0) == 1  # the first read's, no other
    assert tier.client.stats()["slow_nodes"] == [hung]


def test_a_puts_times_never_make_a_node_slow(tmp_path: Path) -> None:
    # A put's node calls are taken together after one wait: each node's time only bounds its
    # latency, and the node sent to first waits for the sends to all the others. Taken as
    # times (a busy host: ~0.5 ms a send), the first nodes sent to counted slow, and with more
    # nodes slow than a block has parity the reads asked a hung one among them: a hedge a read.
    tier = Tier(tmp_path)
    submit, sent = tier.fanout.submit, []

    def a_slow_send(target: Any, method: Any, /, *args: Any, **kwargs: Any) -> Any:
        if method.__name__ == "put":
            if len(sent) == 1:
                time.sleep(0.02)  # the second send is late: the first node's answer waits
            sent.append(target)
        return submit(target, method, *args, **kwargs)

    tier.fanout.submit = a_slow_send  # type: ignore[method-assign]
    key, payload = _key(1), _payload(1)
    assert tier.client.put_blocks([key], [payload]).ok
    tier.fanout.submit = submit  # type: ignore[method-assign]
    assert tier.client.stats()["slow_nodes"] == []
    # A time (an answer the reader waited for alone) replaces the bounds, and counts: 5 ms
    # where the others took 20 us is slow.
    for node in range(12):
        tier.client._note_latency(node, 0.005 if node == 3 else 20e-6)
    assert tier.client.stats()["slow_nodes"] == [3]


def test_a_read_asks_the_slowest_of_the_slow_nodes_last(tmp_path: Path) -> None:
    # More nodes slow than the block has parity: some of them must be asked, and they are the
    # least slow ones; the hung node (slowest of all) is not, and no read waits for a hedge.
    tier = Tier(tmp_path)
    key, payload = _key(1), _payload(1)
    tier.client.put_blocks([key], [payload])
    holders = _data_holders(key, 12)
    hung = holders[0]  # first in placement order: a read that ignores the estimates asks it
    tier.fanout.hung.add((NODE, hung))
    for node in range(12):
        tier.client._note_latency(node, 0.004 if node in holders[1:4] else 20e-6)
    tier.client._note_latency(hung, 0.03, lower_bound=True)
    assert tier.client.slow_nodes() == {hung, *holders[1:4]}
    # The client's first read also probes each slow node (one in 8 does), and waits for none.
    assert _same(tier.client.get_blocks([key])[0], payload)
    before = len(tier.fanout.calls)
    for _ in range(5):
        assert _same(tier.client.get_blocks([key])[0], payload)
    assert tier.client.stats().get("hedged_reads", 0) == 0
    assert ((NODE, hung), "get") not in tier.fanout.calls[before:]


def test_the_hedge_waits_for_the_typical_tail_of_reads_of_that_size(tmp_path: Path) -> None:
    # Until reads of a size were timed a read waits ``hedge_after_s`` before asking the other
    # nodes; then the ``hedge_percentile`` of recent reads (here: in-process, about nothing, so
    # the 1 ms floor). A node that turns slow then costs a read about one normal tail.
    tier = Tier(tmp_path, hedge_after_s=2.0, call_timeout_s=10.0)
    keys = [_key(i) for i in range(3)]
    payloads = [_payload(i) for i in range(3)]
    tier.client.put_blocks(keys, payloads)
    for _ in range(20):
        assert _same(tier.client.get_blocks(keys[:1])[0], payloads[0])
    delays = tier.client.stats()["hedge_delay_ms"]
    assert isinstance(delays, dict)
    assert set(delays) == {1}  # single-block reads only so far
    assert delays[1] < 2000.0
    tier.fanout.hung.add((NODE, _asked_node(tier, keys[0])))
    started = time.monotonic()
    assert _same(tier.client.get_blocks(keys[:1])[0], payloads[0])
    assert time.monotonic() - started < 1.0  # hedged at the learned delay, not at 2 s
    assert tier.client.stats()["hedged_reads"] == 1
    # A batch of two blocks has not been timed yet: it waits the configured 2 s.
    tier.fanout.hung.clear()
    tier.fanout.hung.add((NODE, _data_holders(keys[1], 12)[0]))
    tier.client._latency.clear()  # forget which node was slow: the read asks it again
    started = time.monotonic()
    got = tier.client.get_blocks(keys[1:])
    assert time.monotonic() - started >= 2.0
    assert all(_same(g, p) for g, p in zip(got, payloads[1:], strict=True))


def test_a_dead_meta_shard_is_a_miss_and_a_failed_put_never_an_exception(tier: Tier) -> None:
    keys = [_key(i) for i in range(12)]
    tier.client.put_blocks(keys, [_payload(i) for i in range(12)])
    assert tier.client.read([_key(99)]).why == {0: "not in the index"}
    tier.fanout.dead |= {(META, i) for i in range(tier.config.meta_shards)}
    assert tier.client.lookup(keys).hit_blocks == 0
    outcome = tier.client.read(keys)
    assert outcome.payloads == [None] * 12
    assert all(outcome.why[p].startswith("its meta shard did not answer") for p in range(12))
    assert tier.client.put_blocks([_key(50)], [b"x"]).failed == [_key(50)]


def test_a_put_around_a_dead_node_lands_on_healthy_ones(tmp_path: Path) -> None:
    tier = Tier(tmp_path, nodes=14)
    tier.fanout.dead.add((NODE, 2))
    keys = [_key(i) for i in range(20)]
    assert tier.client.put_blocks(keys, [_payload(i) for i in range(20)]).ok
    assert tier.nodes[2].usage()["shards"] == 0
    found = tier.client.lookup(keys)
    assert found.lease is not None
    assert all(2 not in block.placement for block in found.lease.blocks)
    tier.fanout.dead.add((NODE, 3))
    tier.client._retry_at.clear()  # forget what it learnt: the put must discover it itself
    tier.fanout.dead.discard((NODE, 2))
    more = [_key(i) for i in range(100, 120)]
    assert tier.client.put_blocks(more, [_payload(i) for i in range(20)]).ok


def _put_14(tier: Tier) -> None:
    keys = [os.urandom(32) for _ in range(14)]  # 14 stripes: every node takes shards of some
    assert tier.client.put_blocks(keys, [_payload(i) for i in range(14)]).ok


def _window(tier: Tier, node: int) -> float:
    return tier.client._retry_at[node] - time.monotonic()


def test_a_node_that_times_out_in_a_row_is_skipped_twice_as_long_each_time(
    tmp_path: Path,
) -> None:
    # A node cut off (a partitioned host: every call waits out the timeout) must not cost every
    # put a call timeout.
    tier = Tier(tmp_path, nodes=14, node_retry_s=0.05, call_timeout_s=0.2)
    tier.fanout.hung.add((NODE, 2))
    windows = []
    for _ in range(6):
        tier.client._retry_at.pop(2, None)  # its window over: the next put tries it again
        _put_14(tier)
        windows.append(_window(tier, 2))
    assert 2 in tier.client.down_nodes()
    # 0.05, 0.1, 0.2, 0.4, then capped at 8 x 0.05.
    assert windows[0] <= 0.05 < windows[1] <= 0.1 < windows[2] <= 0.2 < windows[3] <= 0.4
    assert 0.35 < windows[4] <= 0.4 and 0.35 < windows[5] <= 0.4
    # Answering again resets it: the next timeout is skipped for node_retry_s again.
    tier.fanout.hung.discard((NODE, 2))
    tier.client._retry_at.pop(2)
    _put_14(tier)
    assert 2 not in tier.client._failures_in_a_row
    tier.fanout.hung.add((NODE, 2))
    _put_14(tier)
    assert _window(tier, 2) <= 0.05


def test_a_node_that_refuses_at_once_is_tried_again_after_node_retry_s(tmp_path: Path) -> None:
    # A dead process (a restart on its way) costs nothing to try: no growing window for it.
    tier = Tier(tmp_path, nodes=14, node_retry_s=0.05, call_timeout_s=0.2)
    tier.fanout.dead.add((NODE, 2))
    for _ in range(4):
        tier.client._retry_at.pop(2, None)
        _put_14(tier)
        assert _window(tier, 2) <= 0.05
    assert 2 not in tier.client._failures_in_a_row


def test_fewer_than_min_write_shards_live_nodes_means_the_put_fails_cleanly(tier: Tier) -> None:
    tier.fanout.dead |= {(NODE, 0), (NODE, 1)}  # 10 of 12 live: under min_write_shards = 11
    result = tier.client.put_blocks([_key(1)], [b"payload"])
    assert result.failed == [_key(1)]
    tier.client._retry_at.clear()
    tier.fanout.dead.clear()
    assert tier.client.put_blocks([_key(1)], [b"payload"]).stored == [_key(1)]


def test_a_put_is_one_call_a_node_each_shard_committed_as_it_is_written(tier: Tier) -> None:
    keys = [_key(i) for i in range(16)]
    payloads = [_payload(i) for i in range(16)]
    tier.fanout.calls.clear()
    assert tier.client.put_blocks(keys, payloads).stored == keys
    node_calls = [method for (kind, _), method in tier.fanout.calls if kind == NODE]
    assert node_calls == ["put"] * 12  # no second round of commit marks
    for node in tier.nodes.values():
        usage = node.usage()
        assert (usage["shards"], usage["pending"]) == (16, 0)
        assert usage["dead_bytes"] == SEGMENT_HEADER_BYTES  # not one COMMIT mark
    assert _same(tier.client.get_blocks(keys)[3], payloads[3])


def _die_before_meta_commit(tier: Tier, key: bytes, payload: np.ndarray, shards: int) -> None:
    """A writer that reserved ``key``, wrote the first ``shards`` shards of its stripe (each
    committed as written, as the client's put does) and died before its meta commit."""
    token = 4242
    shard = int(tier.client._by_meta([key]).popitem()[0])
    tier.metas[shard].begin_put([key], token)
    stripe = Codec().encode(payload, key)
    placement = place([key], range(len(tier.nodes)), 12)[0]
    for index, node in list(enumerate(placement))[:shards]:
        assert tier.nodes[int(node)].put(
            token, [key], [stripe[index]], [0], [tier.clock.now()], True
        ) == [True]


def _committed_shards(tier: Tier) -> int:
    return sum(int(node.usage()["shards"]) for node in tier.nodes.values())


def test_a_writer_dying_mid_put_leaves_nothing_visible_ever(tier: Tier) -> None:
    key = _key(7)
    _die_before_meta_commit(tier, key, _payload(7), shards=9)  # fewer than k
    assert tier.client.lookup([key]).hit_blocks == 0
    assert tier.client.get_blocks([key]) == [None]
    for shard in range(tier.config.meta_shards):  # 9 shards are no block: never restored
        tier.rebuild_meta(shard)
    assert tier.client.lookup([key]).hit_blocks == 0
    # the reservation ran out; a new writer stores the block normally
    tier.clock.advance(tier.config.put_reservation_s + 1)
    assert tier.client.put_blocks([key], [_payload(8)]).ok
    got = tier.client.get_blocks([key])[0]
    assert _same(got, _payload(8))
    # its shards replaced the dead writer's on the same nodes: nothing is left to reclaim
    assert _committed_shards(tier) == 12
    assert tier.reclaim_orphans() == 0
    assert _same(tier.client.get_blocks([key])[0], _payload(8))


def test_a_whole_write_whose_writer_died_is_rebuilt_with_its_own_bytes_or_reclaimed(
    tier: Tier,
) -> None:
    # Every shard durable, no meta commit: invisible. A meta shard's rebuild may bring it
    # back (its own bytes, whole); where none does, the orphan scrub takes every shard.
    def owner(key: bytes) -> int:
        return int(tier.client._by_meta([key]).popitem()[0])

    rebuilt = _key(7)
    dropped = next(_key(i) for i in range(8, 200) if owner(_key(i)) != owner(rebuilt))
    _die_before_meta_commit(tier, rebuilt, _payload(7), shards=12)
    _die_before_meta_commit(tier, dropped, _payload(8), shards=12)
    assert tier.client.lookup([rebuilt]).hit_blocks == 0
    assert tier.client.lookup([dropped]).hit_blocks == 0
    tier.rebuild_meta(owner(rebuilt))
    assert _same(tier.client.get_blocks([rebuilt])[0], _payload(7))
    assert tier.reclaim_orphans() == 12  # the dropped write's, none of the rebuilt block's
    assert tier.client.lookup([dropped]).hit_blocks == 0
    assert _committed_shards(tier) == 12
    assert _same(tier.client.get_blocks([rebuilt])[0], _payload(7))


def test_a_restarted_meta_shard_rebuilds_every_committed_block(tier: Tier) -> None:
    keys = [_key(i) for i in range(30)]
    payloads = [_payload(i) for i in range(30)]
    tier.client.put_blocks(keys, payloads, "chatbot")
    sizes = {k: p.size for k, p in zip(keys, payloads, strict=True)}
    for shard in range(tier.config.meta_shards):
        rebuilt = tier.rebuild_meta(shard)
        held = rebuilt.snapshot_table().column("key").to_pylist()
        assert rebuilt.stored_bytes_by_class()["chatbot"] == sum(sizes[k] for k in held)
    assert tier.client.lookup(keys).hit_blocks == 30
    got = tier.client.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))


def test_corrupt_and_foreign_shards_are_never_decoded_into_wrong_bytes(tier: Tier) -> None:
    keys = [_key(i) for i in range(6)]
    payloads = [_payload(i) for i in range(6)]
    tier.client.put_blocks(keys, payloads)
    placement = tier.client.lookup(keys).lease.blocks[0].placement  # type: ignore[union-attr]
    # a flipped byte in the fragment of shard 0 that its node did not catch (bit rot)
    tier.tamper(int(placement[0]), keys[0], _flip_last_byte)
    # replace shard 1 with a *valid* shard of a different payload of the same key and size,
    # as an old write of the key that raced a re-put would leave it
    other = Codec().encode(_payload(1000), keys[0])
    second = tier.nodes[placement[1]]
    token = 77
    second.put(token, [keys[0]], [other[1]], [0], [0.0], True)
    got = tier.client.get_blocks([keys[0]])[0]
    assert _same(got, payloads[0])
    # two more foreign shards: 8 shards of the real payload remain -> a miss, not garbage
    for index in (2, 3):
        n = tier.nodes[placement[index]]
        n.put(token, [keys[0]], [other[index]], [0], [0.0], True)
    assert tier.client.get_blocks([keys[0]]) == [None]
    rest = tier.client.get_blocks(keys[1:])
    assert all(_same(g, p) for g, p in zip(rest, payloads[1:], strict=True))


def test_a_hedged_read_whose_shards_do_not_decode_asks_the_node_it_gave_up_on(
    tier: Tier,
) -> None:
    # Two slow data nodes make the read hedge: every node is asked, and the read stops as soon
    # as k shards are in, giving up on the slow ones. One of those k is damaged, so the stripe
    # does not decode. The second chance must ask the nodes given up on (their answers are the
    # shards that are missing), not only nodes never asked: there are none left after a hedge,
    # and the block came back a miss (the chaos scrub scenario's failed reads).
    key, payload = _key(1), _payload(1)
    tier.client.put_blocks([key], [payload])
    placement = tier.client.lookup([key]).lease.blocks[0].placement  # type: ignore[union-attr]
    slow = {(NODE, int(placement[0])), (NODE, int(placement[1]))}
    tier.tamper(int(placement[2]), key, _flip_last_byte)
    tier.fanout.late_once |= slow
    # A fresh reader asks exactly the data shards first (the writer's own latency estimates,
    # from the puts, may rank a node slow and ask parity instead).
    reader = BlockStoreClient(tier.config, tier.fanout, clock=tier.clock)
    assert _same(reader.get_blocks([key])[0], payload)
    assert reader.stats()["hedged_reads"] == 1
    assert reader.stats()["second_chance_reads"] == 1


def test_a_shard_with_a_damaged_header_is_left_out_and_counted(tier: Tier) -> None:
    keys = [_key(i) for i in range(3)]
    payloads = [_payload(i) for i in range(3)]
    tier.client.put_blocks(keys, payloads)
    blocks = tier.client.lookup(keys).lease.blocks  # type: ignore[union-attr]
    # data shards, so the reader needs them (or parity in their place)
    tier.tamper(blocks[0].placement[4], keys[0], lambda shard: shard[:10])  # shorter than a header
    tier.tamper(blocks[1].placement[5], keys[1], lambda shard: np.zeros_like(shard))  # no magic
    # Only shards the reader looks at are counted. A reader that hedges (a call slower than
    # 20 ms on a loaded machine) may finish a stripe from parity before the damaged shard
    # arrives, and one that remembers a node as slow from the puts asks parity instead of it:
    # a fresh reader that waits for its first k asks exactly the data shards.
    patient = dataclasses.replace(tier.config, hedge_after_s=60.0, call_timeout_s=60.0)
    reader = BlockStoreClient(patient, tier.fanout, clock=tier.clock)
    got = reader.get_blocks(keys)
    assert all(_same(g, p) for g, p in zip(got, payloads, strict=True))  # parity stood in
    assert reader.counters["corrupt_shards"] >= 2


def test_a_rewritten_block_reads_as_the_new_write_never_a_mix(tier: Tier) -> None:
    key = _key(1)
    old, new = _payload(1), _payload(2)
    tier.client.put_blocks([key], [old])
    placement = tier.client.lookup([key]).lease.blocks[0].placement  # type: ignore[union-attr]
    shards = Codec().encode(new, key)
    # A re-put's shards replace the old ones node by node, each committed as it is written:
    # readers in between see whole shards of one write or the other, and only ever a block of
    # one write.
    for done, (index, node_id) in enumerate(zip(range(12), placement, strict=True), start=1):
        node = tier.nodes[int(node_id)]
        assert node.put(9, [key], [shards[index]], [0], [2.0], True) == [True]
        block = tier.client.get_blocks([key])[0]
        if done <= 2:
            assert _same(block, old)  # 10 or 11 old shards still decode the old write
        elif done >= 10:
            assert _same(block, new)
        else:
            assert block is None  # neither write has k shards: a miss, never the mix


def test_each_node_gets_its_shards_of_a_batch_as_one_slice_of_the_encoded_rows() -> None:
    """The first placement ranks the encoding's rows by node: each node's shards (data first,
    rows ascending) are one slice of the array, not a copy; shards a retry placed anew are a
    copy of the same rows."""
    from kvstore.blockstore.client import _by_node, _rank, _shards_of

    codec = Codec(10, 2)
    keys = [os.urandom(32) for _ in range(6)]
    payloads = [_payload(i) for i in range(6)]
    placements = np.stack([np.random.default_rng(i).permutation(14)[:12] for i in range(6)])
    placements[2, 11] = -1  # a parity shard placed nowhere (fewer nodes than the width)
    by_node = _by_node(placements, 10)
    rank = _rank(by_node, 6, 12)
    rows = codec.encode_rows(payloads, keys, rank)
    assert rows is not None
    stripes = codec.encode_many(payloads, keys)
    for slots, indices in by_node.values():
        shards = _shards_of(rows, None, rank, slots, indices)
        assert isinstance(shards, np.ndarray) and np.shares_memory(shards, rows)
        wanted = [stripes[b][i] for b, i in zip(slots.tolist(), indices.tolist(), strict=True)]
        assert np.array_equal(shards, np.stack(wanted))
        assert np.array_equal(_shards_of(None, stripes, rank, slots, indices), shards)
    again = _shards_of(rows, None, rank, np.array([5, 0]), np.array([3, 7]))
    assert not np.shares_memory(again, rows)
    assert np.array_equal(again, np.stack([stripes[5][3], stripes[0][7]]))
