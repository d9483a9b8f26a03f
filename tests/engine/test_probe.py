"""The load-path probe (``kvstore.engine.probe``): one block of a hit read the way the fetcher
would read it, timed; against a real file tier, with a clock the reads move."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
from test_scheduler import FINGERPRINT, file_tier, prompt_of, store_blocks  # noqa: F401

from kvstore.engine.probe import LoadProbe
from kvstore.engine.scheduler import PagedScheduler
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.files import DirectoryTier
from kvstore.tier.records import DirectGrant, HitAnswer, HitRequest

BLOCK = 64  # store_blocks' payloads


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowReads:
    """The file tier, each read taking ``seconds`` on the clock (a thin link)."""

    def __init__(self, tier: DirectoryTier, clock: Clock, seconds: float) -> None:
        self._tier, self._clock, self._seconds = tier, clock, seconds
        self.asked: list[tuple[int, str | None]] = []

    def get_blocks(self, keys, lease_id=None, *, keep_lease=False):  # type: ignore[no-untyped-def]
        self.asked.append((len(keys), lease_id))
        self._clock.now += self._seconds
        return self._tier.get_blocks(keys)


def hit(tier: DirectoryTier, blocks: int) -> HitAnswer:
    prompt = prompt_of(blocks * BLOCK_TOKENS + 1)
    store_blocks(tier, prompt, blocks)
    scheduler = PagedScheduler(tier, FINGERPRINT, mode="full-attention")
    answer = tier.query_hit(
        HitRequest(
            block_keys=scheduler.keys(prompt, blocks), prompt_len=len(prompt), mode="full-attention"
        )
    )
    assert len(answer.hit_block_keys) == blocks, answer.plan
    return dataclasses.replace(answer, lease_id="lease-1")


def test_without_a_grant_one_block_is_read_through_the_gateway_without_the_lease(
    file_tier,  # noqa: F811
) -> None:
    clock = Clock()
    gateway = SlowReads(file_tier, clock, 0.25)
    probe = LoadProbe(gateway, BLOCK, clock=clock)
    assert probe(hit(file_tier, 4), 10.0) == (BLOCK, 0.25)
    # One block, and never with the lease: a GetBlocks with it would end the load's lease.
    assert gateway.asked == [(1, None)]


def test_a_miss_or_a_failing_tier_gives_no_figure(file_tier) -> None:  # noqa: F811
    answer = hit(file_tier, 2)
    empty = DirectoryTier(file_tier.root.parent / "empty")
    assert LoadProbe(empty, BLOCK)(answer, 10.0) is None

    class Down:
        def get_blocks(self, keys, lease_id=None, *, keep_lease=False):  # type: ignore[no-untyped-def]
            raise ConnectionError("tier down")

    assert LoadProbe(Down(), BLOCK)(answer, 10.0) is None  # type: ignore[arg-type]
    assert LoadProbe(file_tier, BLOCK)(dataclasses.replace(answer, hit_keys=()), 10.0) is None


class Nodes:
    """The fetcher's direct reader as the probe uses it: ``read_whole`` (None: the nodes do
    not answer this process) and ``close``."""

    def __init__(self, clock: Clock, reachable: bool) -> None:
        self._clock, self._reachable = clock, reachable
        self.read_blocks: list[int] = []
        self.closed = 0

    def read_whole(self, grant: DirectGrant, nbytes: int) -> bool | None:
        self.read_blocks.append(len(grant))
        if not self._reachable:
            return None
        self._clock.now += 0.01
        return True

    def close(self) -> None:
        self.closed += 1


def grant_of(blocks: int) -> DirectGrant:
    return DirectGrant(
        capability=b"cap",
        keys=np.zeros((blocks, 4), np.uint64),
        placements=np.zeros((blocks, 12), np.int32),
        sizes=np.full(blocks, BLOCK, np.int64),
        endpoints={0: ("127.0.0.1", 1)},
        k=10,
        m=2,
    )


def test_with_a_grant_the_nodes_are_read_when_they_answer_else_the_gateway(file_tier) -> None:  # noqa: F811
    clock = Clock()
    answer = dataclasses.replace(hit(file_tier, 3), direct=grant_of(3))
    gateway = SlowReads(file_tier, clock, 0.5)
    nodes = Nodes(clock, reachable=True)
    assert LoadProbe(gateway, BLOCK, direct=nodes, clock=clock)(answer, 10.0) == (BLOCK, 0.01)  # type: ignore[arg-type]
    assert nodes.read_blocks == [1] and nodes.closed == 1 and gateway.asked == []
    far = Nodes(clock, reachable=False)
    assert LoadProbe(gateway, BLOCK, direct=far, clock=clock)(answer, 10.0) == (BLOCK, 0.5)  # type: ignore[arg-type]
    assert gateway.asked == [(1, None)]


def test_a_block_that_misses_the_budget_answers_the_budget_and_the_next_probe_waits(
    file_tier,  # noqa: F811
) -> None:
    answer = hit(file_tier, 2)
    released = threading.Event()

    class Stuck:
        """A link so slow the block has not arrived when the budget is spent."""

        def __init__(self) -> None:
            self.reads = 0

        def get_blocks(self, keys, lease_id=None, *, keep_lease=False):  # type: ignore[no-untyped-def]
            self.reads += 1
            released.wait(10.0)
            return file_tier.get_blocks(keys)

    stuck = Stuck()
    probe = LoadProbe(stuck, BLOCK)  # type: ignore[arg-type]
    started = time.monotonic()
    assert probe(answer, 0.05) == (BLOCK, 0.05)
    assert probe(answer, 0.05) == (BLOCK, 0.05)  # queued behind the first: never two reads
    assert time.monotonic() - started < 5.0 and stuck.reads == 1
    released.set()
    probe.close()
