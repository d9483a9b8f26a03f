"""Worker side, puts: the saves queued while a put runs go out together in the next put.

The tier is real checksummed files (``DirectoryTier``); ``HeldTier`` only watches its
``put_blocks`` calls and holds the first one until the test lets it go, so that the steps after
it queue their saves as they would behind a slow put.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvstore.engine import worker as worker_module
from kvstore.engine.plan import PagedSave, StepPlan
from kvstore.engine.worker import PagedWorker
from kvstore.errors import InvalidArgument, NodeUnavailable
from kvstore.keys import BLOCK_TOKENS
from kvstore.tier.files import DirectoryTier
from kvstore.tier.records import PutAnswer

LAYERS, BLOCKS, SHAPE = 2, 8, (2, BLOCK_TOKENS, 16)


class HeldTier:
    """A ``DirectoryTier`` writer whose first put waits for ``release``; every put's keys and
    class are recorded. Like the block store, it refuses a key twice in one put."""

    def __init__(self, tier: DirectoryTier, fail_after_first: bool = False) -> None:
        self.tier = tier
        self.calls: list[tuple[list[bytes], str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self._fail_after_first = fail_after_first

    def put_blocks(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], traffic_class: str = ""
    ) -> PutAnswer:
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys", "must not repeat a key within one put")
        self.calls.append((list(keys), traffic_class))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(30)
        elif self._fail_after_first:
            raise NodeUnavailable("the tier went away")
        return self.tier.put_blocks(keys, payloads, traffic_class)

    def put_swa_state(self, *args: object, **kwargs: object) -> str:
        raise AssertionError("no window state is saved here")


@pytest.fixture
def cache() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn((BLOCKS, *SHAPE), generator=generator) for _ in range(LAYERS)]


@pytest.fixture
def file_tier(tmp_path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "tier")


@pytest.fixture
def made() -> Iterator[list[PagedWorker]]:
    workers: list[PagedWorker] = []
    yield workers
    for worker in workers:
        worker.close()


def key(n: int) -> bytes:
    return bytes([n]) * 32


def save(request: str, blocks: dict[int, int], traffic_class: str = "") -> PagedSave:
    """Rows ``blocks`` (engine block -> key number) of ``request``."""
    return PagedSave(request, tuple(blocks), tuple(key(n) for n in blocks.values()), traffic_class)


def run_step(worker: PagedWorker, saves: list[PagedSave]) -> None:
    worker.start(StepPlan(saves=saves))
    for layer in range(LAYERS):
        worker.save_layer(layer)
    worker.finish_step()


def payload(cache: list[torch.Tensor], block: int) -> bytes:
    return b"".join(layer[block].numpy().tobytes() for layer in cache)


def test_saves_queued_behind_a_put_go_out_in_one_put_a_class_each(cache, file_tier, made) -> None:
    tier = HeldTier(file_tier)
    worker = PagedWorker(cache, file_tier.factory(), tier, staging_bytes=4 << 20)
    made.append(worker)
    run_step(worker, [save("a", {0: 1, 1: 2})])
    assert tier.entered.wait(30)  # the put thread is in the first put: the next steps queue
    run_step(worker, [save("b", {2: 3, 3: 4}), save("c", {4: 5})])
    run_step(worker, [save("d", {5: 6}, "batch")])
    # Two requests of one prompt save the same blocks in one step: the put carries them once.
    run_step(worker, [save("e", {6: 7}), save("f", {6: 7}), save("g", {7: 6}, "batch")])
    tier.release.set()
    assert worker.flush(30)

    assert tier.calls == [
        ([key(1), key(2)], ""),
        ([key(3), key(4), key(5), key(7)], ""),
        ([key(6)], "batch"),
    ]
    assert worker.stats.blocks_saved == 7 and worker.stats.saves_failed == 0
    stored = {key(1): 0, key(2): 1, key(3): 2, key(4): 3, key(5): 4, key(6): 5, key(7): 6}
    reads = file_tier.get_blocks(list(stored))
    assert [read.payload for read in reads] == [payload(cache, b) for b in stored.values()]


def test_a_group_whose_put_fails_counts_each_of_its_saves_and_frees_their_bytes(
    cache, file_tier, made
) -> None:
    tier = HeldTier(file_tier, fail_after_first=True)
    worker = PagedWorker(cache, file_tier.factory(), tier, staging_bytes=4 << 20)
    made.append(worker)
    run_step(worker, [save("a", {0: 1})])
    assert tier.entered.wait(30)
    run_step(worker, [save("b", {1: 2, 2: 3})])
    run_step(worker, [save("c", {3: 4})])
    tier.release.set()
    assert worker.flush(30)  # every save's bytes given back, failed or not
    assert len(tier.calls) == 2
    assert worker.stats.blocks_saved == 1 and worker.stats.saves_failed == 3
    assert [read.payload is None for read in file_tier.get_blocks([key(2), key(4)])] == [
        True,
        True,
    ]


def test_a_group_stops_at_its_byte_bound_and_the_rest_goes_in_the_next_put(
    cache, file_tier, made, monkeypatch
) -> None:
    tier = HeldTier(file_tier)
    worker = PagedWorker(cache, file_tier.factory(), tier, staging_bytes=4 << 20)
    made.append(worker)
    monkeypatch.setattr(worker_module, "_GROUP_BYTES", 2 * worker.block_bytes)
    run_step(worker, [save("a", {0: 1})])
    assert tier.entered.wait(30)
    run_step(worker, [save("b", {1: 2, 2: 3})])  # two blocks: the bound, alone
    run_step(worker, [save("c", {3: 4})])
    run_step(worker, [save("d", {4: 5})])  # with c: two blocks
    run_step(worker, [save("e", {5: 6})])
    tier.release.set()
    assert worker.flush(30)
    assert [keys for keys, _ in tier.calls] == [
        [key(1)],
        [key(2), key(3)],
        [key(4), key(5)],
        [key(6)],
    ]
