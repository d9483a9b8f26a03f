"""The per-machine SWA pool: exact sizes and positions, LRU order, TTL from last access, each
owner's states in its own share."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.clock import ManualClock
from kvstore.errors import ConfigError, InvalidArgument, StateRejected
from kvstore.geometry import GeometryConfig
from kvstore.swa.store import SWAStore, check_state

STATE = 4096  # small states keep the LRU tests cheap; one test uses the real 1,415,040


def key(n: int) -> bytes:
    return n.to_bytes(32, "little")


def blob(fill: int, size: int = STATE) -> np.ndarray:
    return np.full(size, fill, dtype=np.uint8)


def make(capacity_states: int = 3, ttl_s: float = 60.0) -> tuple[SWAStore, ManualClock]:
    clock = ManualClock()
    store = SWAStore(
        max_state_bytes=STATE, capacity_bytes=capacity_states * STATE, ttl_s=ttl_s, clock=clock
    )
    return store, clock


def test_real_geometry_state_round_trips_bit_exact_and_is_owned_by_the_store() -> None:
    size = GeometryConfig.default().state_size_to_disk
    assert size == 1_415_040
    store = SWAStore(max_state_bytes=size, capacity_bytes=2 * size, ttl_s=60, clock=ManualClock())
    source = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    original = source.copy()
    assert store.put(key(1), 384, source) == []
    source[:] = 0  # the producer reuses its buffer: the stored state must not change
    stored = store.get(key(1))
    assert stored is not None
    assert np.array_equal(stored, original)
    assert not stored.flags.writeable
    assert store.position(key(1)) == 384


@pytest.mark.parametrize("size", [STATE + 1, 0])
def test_a_state_past_the_largest_or_empty_is_rejected_naming_size_and_position(size: int) -> None:
    store, _ = make()
    with pytest.raises(StateRejected) as caught:
        store.put(key(1), 256, np.zeros(size, dtype=np.uint8))
    message = str(caught.value)
    assert caught.value.argument == "blob"
    assert f"{size} B" in message and "position 256" in message
    assert f"at most {STATE} B" in message and "p % 128 == 0" in message
    assert len(store) == 0


def test_states_of_several_layouts_share_the_pool_by_their_bytes() -> None:
    # A pool serves every model's layout: its capacity counts bytes, not states.
    store, _ = make(capacity_states=2)
    store.put(key(1), 128, blob(1, STATE // 2))
    store.put(key(2), 256, blob(2, STATE // 2))
    store.put(key(3), 384, blob(3))
    assert store.used_bytes == 2 * STATE and len(store) == 3
    # A whole state more pushes out the two oldest (least recently used) halves.
    assert store.put(key(4), 512, blob(4)) == [key(1), key(2)]
    assert store.used_bytes == 2 * STATE
    got = store.get(key(3))
    assert got is not None and got.size == STATE
    store.delete(key(3))
    assert store.used_bytes == STATE


@pytest.mark.parametrize("position", [0, -128, 130, 127, 1.0 * 128, True, "128"])
def test_position_not_allowed_by_spec6_is_rejected_naming_both(position: object) -> None:
    store, _ = make()
    with pytest.raises(InvalidArgument) as caught:
        store.put(key(1), position, blob(1))  # type: ignore[arg-type]
    assert caught.value.argument == "position"
    assert f"{STATE} B" in str(caught.value) and f"position {position!r}" in str(caught.value)
    assert len(store) == 0 and store.drain_removed() == []


def test_both_wrong_names_both_arguments() -> None:
    with pytest.raises(StateRejected) as caught:
        check_state(100, blob(0, 10), state_bytes=STATE)
    assert caught.value.argument == "blob, position"


def test_non_uint8_or_non_flat_blobs_are_rejected() -> None:
    store, _ = make()
    with pytest.raises(StateRejected, match="uint8"):
        store.put(key(1), 128, np.zeros(STATE // 4, dtype=np.float32))
    with pytest.raises(StateRejected, match="one-dimensional"):
        store.put(key(1), 128, np.zeros((2, STATE // 2), dtype=np.uint8))
    with pytest.raises(StateRejected, match="numpy array or bytes"):
        store.put(key(1), 128, [0] * STATE)
    with pytest.raises(InvalidArgument, match="key"):
        store.put(b"short", 128, blob(0))
    # bytes are accepted and copied
    store.put(key(2), 128, bytes(STATE))
    assert store.get(key(2)) is not None


def test_lru_evicts_least_recently_used_first_and_reports_it() -> None:
    store, clock = make(capacity_states=3)
    for n in (1, 2, 3):
        store.put(key(n), 128 * n, blob(n))
        clock.advance(1)
    assert store.get(key(1)) is not None  # 1 is now the most recent: 2 is the LRU victim
    assert store.put(key(4), 512, blob(4)) == [key(2)]
    assert store.keys() == [key(3), key(1), key(4)]
    assert store.put(key(5), 640, blob(5)) == [key(3)]
    assert store.drain_removed() == [key(2), key(3)]
    assert store.drain_removed() == []
    assert store.get(key(2)) is None
    assert store.used_bytes == 3 * STATE <= store.capacity_bytes
    stats = store.stats()
    assert (stats.states, stats.evicted_lru, stats.expired_ttl) == (3, 2, 0)


def test_refreshing_a_key_replaces_it_without_eviction() -> None:
    store, _ = make(capacity_states=2)
    store.put(key(1), 128, blob(1))
    store.put(key(2), 256, blob(2))
    assert store.put(key(1), 128, blob(9)) == []
    got = store.get(key(1))
    assert got is not None and int(got[0]) == 9
    assert store.drain_removed() == []
    assert store.keys() == [key(2), key(1)]


def test_ttl_counts_from_last_access() -> None:
    store, clock = make(ttl_s=60)
    store.put(key(1), 128, blob(1))
    store.put(key(2), 256, blob(2))
    clock.advance(50)
    assert store.get(key(1)) is not None  # touched at t=50
    clock.advance(11)  # t=61: key 2 idle 61 s > 60, key 1 idle 11 s
    assert store.expire() == [key(2)]
    assert store.drain_removed() == [key(2)]
    clock.advance(49)  # t=110: key 1 idle 60 s, not more
    assert store.expire() == []
    clock.advance(1)
    # An expired state is a miss on get, and reported as removed.
    assert store.get(key(1)) is None
    assert store.drain_removed() == [key(1)]
    assert store.stats().expired_ttl == 2


def test_capacity_must_hold_one_state() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        SWAStore(max_state_bytes=STATE, capacity_bytes=STATE - 1, ttl_s=1, clock=ManualClock())
    with pytest.raises(ConfigError, match="ttl_s"):
        SWAStore(max_state_bytes=STATE, capacity_bytes=STATE, ttl_s=0, clock=ManualClock())
    with pytest.raises(ConfigError, match="max_state_bytes"):
        SWAStore(max_state_bytes=0, capacity_bytes=STATE, ttl_s=1, clock=ManualClock())


def test_delete_reports_removal() -> None:
    store, _ = make()
    store.put(key(1), 128, blob(1))
    assert store.delete(key(1)) and not store.delete(key(1))
    assert store.drain_removed() == [key(1)]


# --- owners' shares -----------------------------------------------------------------------------


def test_an_owners_flood_evicts_its_own_states_never_anothers() -> None:
    # Issue 31 item 5: one tenant's 40 states flushed another's from a shared LRU.
    store, clock = make(capacity_states=4)
    store.put(key(1), 128, blob(1), owner="victim")
    flooded = [key(100 + n) for n in range(40)]
    evicted: list[bytes] = []
    for n, flood in enumerate(flooded):
        clock.advance(1)
        evicted += store.put(flood, 128, blob(n), owner="flood")
        if n == 2:
            assert store.get(flooded[0]) is not None  # read: the flood's LRU is now its 2nd
    # Free room is anyone's: the flood filled the pool, then recycled only its own states.
    assert key(1) in store and store.get(key(1)) is not None
    assert set(evicted) <= set(flooded) and key(1) not in evicted
    assert flooded[1] in evicted and store.keys() == [*flooded[-3:], key(1)]  # 1: just read
    assert store.stats().bytes_by_owner == {"victim": STATE, "flood": 3 * STATE}
    assert store.drain_removed() == evicted


def test_a_full_pool_takes_room_from_the_owner_most_beyond_its_share() -> None:
    store, _ = make(capacity_states=4)
    for n in (1, 2, 3):
        store.put(key(n), 128, blob(n), owner="a")
    store.put(key(4), 128, blob(4), owner="b")
    # Full: "c" (nothing held) takes room from "a", 3 states against a share of 4/3.
    assert store.put(key(5), 128, blob(5), owner="c") == [key(1)]
    assert store.put(key(6), 128, blob(6), owner="") == [key(2)]  # shares of 1: "a" has 1 over
    # Every owner at its share now: the putter makes room from its own.
    assert store.put(key(7), 128, blob(7), owner="b") == [key(4)]
    assert store.stats().bytes_by_owner == {"a": STATE, "b": STATE, "c": STATE, "": STATE}
    # An owner whose states are all gone (expired, deleted, evicted) has no share left.
    assert store.delete(key(3))
    assert "a" not in store.stats().bytes_by_owner
    # A state refreshed by another owner moves to that owner's books.
    assert store.put(key(7), 128, blob(8), owner="c") == []
    assert store.stats().bytes_by_owner == {"c": 2 * STATE, "": STATE}
