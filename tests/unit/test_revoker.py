"""``Revoker``: released leases' revocations go to the nodes in batches from one thread, each
batch with the latest end among its ids; a failing send loses that batch only."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.tier.revoke import Revoker


def test_releases_queued_while_a_send_runs_go_out_together_with_the_latest_end() -> None:
    gate, entered = threading.Event(), threading.Event()
    batches: list[tuple[list[str], float]] = []

    def send(ids: Sequence[str], until: float) -> None:
        entered.set()
        gate.wait(10)
        batches.append((list(ids), until))

    revoker = Revoker(send)
    revoker.revoke("a", 5.0)  # the first send waits on the gate: the next ones queue up
    assert entered.wait(10)
    for lease_id, until in (("b", 7.0), ("c", 6.0)):
        revoker.revoke(lease_id, until)
    gate.set()
    assert revoker.flush(10)
    assert batches == [(["a"], 5.0), (["b", "c"], 7.0)] and revoker.sent == 3
    revoker.close()
    revoker.revoke("d", 9.0)  # closed: nothing more is sent
    assert revoker.flush(1) and revoker.sent == 3


def test_releases_within_the_window_share_one_batch_and_a_flush_does_not_wait_for_it() -> None:
    batches: list[list[str]] = []
    revoker = Revoker(lambda ids, until: batches.append(list(ids)), window_s=3600.0)
    for lease_id in ("a", "b", "c"):
        revoker.revoke(lease_id, 5.0)
    assert revoker.sent == 0  # still in the window
    assert revoker.flush(10)  # sent at once, not an hour later
    assert batches == [["a", "b", "c"]] and revoker.sent == 3
    revoker.revoke("d", 5.0)
    revoker.close()  # what is queued goes out before the thread stops
    assert batches == [["a", "b", "c"], ["d"]]


def test_a_failing_send_loses_its_batch_not_the_thread() -> None:
    sent: list[str] = []

    def send(ids: Sequence[str], until: float) -> None:
        if "bad" in ids:
            raise RuntimeError("a node is gone")
        sent.extend(ids)

    revoker = Revoker(send)
    revoker.revoke("bad", 1.0)
    assert revoker.flush(10)
    revoker.revoke("good", 1.0)
    assert revoker.flush(10)
    assert sent == ["good"]
    revoker.close()
