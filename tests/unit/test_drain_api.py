"""``kvstore.runtime.drain`` against a stand-in repair actor (its ``.remote()`` answers the
value itself): a drain watched to the end, a timeout that leaves it running, an unknown node,
an older repair actor, and a repair actor that does not answer for a while."""

from __future__ import annotations

import pytest
from fake_repair import FakeRepair, Remote

from kvstore.errors import InvalidArgument, StoreError
from kvstore.runtime import drain


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_drain_is_watched_until_no_stripe_references_the_node() -> None:
    repair, clock, seen = FakeRepair(), Clock(), []
    status = drain.drain_node(
        repair, 3, on_progress=lambda s: seen.append(dict(s)), clock=clock, sleep=clock.sleep
    )
    assert status["done"] and status["stripes_left"] == 0 and status["node"] == 3
    assert [s["stripes_left"] for s in seen] == [100, 75, 50, 25, 0]
    # Rate from the bytes left seen falling: 25 MB per 0.5 s look.
    assert seen[-1]["rate_bytes_per_s"] == pytest.approx(50e6)
    assert seen[0]["rate_bytes_per_s"] is None and seen[0]["eta_s"] is None
    assert seen[1]["eta_s"] == pytest.approx(75e6 / 50e6)
    assert drain.drain_status(repair) == {
        3: {"node": 3, "draining": True, "stripes_left": 0, "bytes_left": 0, "done": True}
    }


def test_no_wait_starts_it_and_returns() -> None:
    repair = FakeRepair()
    status = drain.drain_node(repair, 5, wait=False)
    assert status["stripes_left"] == 100 and not status["done"]
    assert repair.left == {5: 100}


def test_a_timeout_leaves_the_drain_running_and_resuming_finishes_it() -> None:
    repair, clock = FakeRepair(per_look=10), Clock()
    with pytest.raises(drain.DrainTimeout, match="node 3 not drained after 1 s") as caught:
        drain.drain_node(repair, 3, timeout_s=1.0, clock=clock, sleep=clock.sleep)
    assert "goes on in the background" in str(caught.value)
    assert 0 < caught.value.status["stripes_left"] < 100
    assert repair.left[3] > 0  # still draining: nothing undid it
    again = drain.drain_node(repair, 3, clock=clock, sleep=clock.sleep)
    assert again["done"]


def test_an_unknown_node_and_a_bad_argument_are_named() -> None:
    with pytest.raises(InvalidArgument, match="no storage node 40"):
        drain.drain_node(FakeRepair(), 40)
    for bad in (-1, "3", True):
        with pytest.raises(InvalidArgument, match="node_id"):
            drain.drain_node(FakeRepair(), bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout_s"):
        drain.drain_node(FakeRepair(), 3, timeout_s=0)


def test_a_repair_actor_without_drains_is_named() -> None:
    class Old:
        stats = Remote(lambda: {"stripes": 0})

    with pytest.raises(StoreError, match="no drain"):
        drain.drain_node(Old(), 3)
    assert drain.drain_status(Old()) == {}


def test_a_repair_actor_that_misses_a_few_looks_is_waited_for() -> None:
    repair, clock = FakeRepair(), Clock()
    repair.stats_failures = 5  # 2.5 s of a restarting actor: under the grace
    assert drain.drain_node(repair, 3, clock=clock, sleep=clock.sleep)["done"]


def test_a_node_no_longer_listed_gives_up_after_the_grace() -> None:
    repair, clock = FakeRepair(), Clock()
    repair.forget = True
    with pytest.raises(StoreError, match="not draining any more"):
        drain.drain_node(repair, 3, clock=clock, sleep=clock.sleep)
    assert clock.now >= drain.UNANSWERED_GRACE_S


def test_undrain_puts_the_node_back() -> None:
    repair = FakeRepair()
    drain.drain_node(repair, 3, wait=False)
    status = drain.undrain_node(repair, 3)
    assert status["node"] == 3 and status["draining"] is False
    assert repair.left == {}


def test_a_drain_that_could_never_finish_is_refused() -> None:
    twelve = drain.LiveRepair("kv", FakeRepair(range(12)), tuple(range(12)))
    with pytest.raises(InvalidArgument, match="11 storage nodes in service, fewer than the 12"):
        twelve.check_can_drain(0, {})
    thirteen = drain.LiveRepair("kv", FakeRepair(), tuple(range(13)))
    thirteen.check_can_drain(0, {})
    with pytest.raises(InvalidArgument, match="add a node first"):
        thirteen.check_can_drain(1, {0: {}})
    thirteen.check_can_drain(0, {0: {}})  # already draining: resumed, not refused
    with pytest.raises(
        InvalidArgument, match=r"no storage node 13 in deployment 'kv' \(nodes: 0-12\)"
    ):
        thirteen.check_node(13)
    gappy = drain.LiveRepair("kv", None, (0, 1, 2, 5, 7, 8))
    with pytest.raises(InvalidArgument, match=r"nodes: 0-2, 5, 7-8"):
        gappy.check_node(4)
