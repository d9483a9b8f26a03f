"""``TenantView``: one tenant's view of a real tier (the in-process cluster, and a directory of
files), without Ray. Keys are namespaced per tenant (two tenants' keys never meet), answers carry
the caller's own keys, the shared namespace is read first and written only by the writer role,
leases are each tenant's own and capped (also under concurrency), each question is counted
once, a tenant's SWA states live in its own share of the stores and count toward its quota, and
policy (sizes, repeats, classes, the bytes quota) is checked before the tier is asked anything."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from tier_parts import GEOMETRY, InProcessTier

import kvstore.tier.tenancy as tenancy
from kvstore.errors import ConfigError, Forbidden, InvalidArgument, LeaseError, Overloaded
from kvstore.keys import block_keys, key_words
from kvstore.tenants import Tenant, TenantDirectory
from kvstore.tier.files import DirectoryTier
from kvstore.tier.protocols import Tier
from kvstore.tier.records import HitAnswer, HitRequest
from kvstore.tier.tenancy import TenantView, TenantViews

BLOCK = GEOMETRY.block_tokens
SIZE = GEOMETRY.block_bytes
STATE = GEOMETRY.state_size_to_disk
BOUNDED = "bounded-replay"  # hit = the whole block run (standard backs off a block without state)
DIRECTORY = TenantDirectory(b"s" * 32)


def prompt(blocks: int, seed: int = 0) -> tuple[np.ndarray, list[bytes]]:
    """Token ids whose ``blocks`` full blocks all lie inside the hit cap, and their keys."""
    tokens = np.random.default_rng(seed).integers(0, 100_000, blocks * BLOCK + 200)
    return tokens, list(block_keys(GEOMETRY.fingerprint(), tokens))[:blocks]


def payload(key: bytes, tag: str) -> bytes:
    seed = int.from_bytes(key[:8], "little") ^ int.from_bytes(tag.encode().ljust(8, b"."), "big")
    return np.random.default_rng(seed).bytes(SIZE)


def payloads(keys: list[bytes], tag: str) -> list[bytes]:
    return [payload(key, tag) for key in keys]


def state(tag: int) -> bytes:
    return bytes([tag]) * STATE


def view(tier: Tier, name: str, **policy: object) -> TenantView:
    """A tenant's view; the classes it is given are its own (as a tokens file in which no
    other tenant names them marks them)."""
    policy.setdefault("exclusive_classes", policy.get("classes") or ())
    return TenantView(tier, DIRECTORY.make(name, **policy))


def hit(
    tenant: TenantView, tokens: np.ndarray, *, mode: str = BOUNDED, lease: bool = True
) -> HitAnswer:
    return tenant.query_hit(HitRequest(token_ids=tokens, mode=mode, take_lease=lease))


def read(tenant: TenantView, keys: list[bytes], lease_id: str | None = None) -> list[bytes | None]:
    return [r.payload for r in tenant.get_blocks(keys, lease_id)]


def outstanding_leases(parts: InProcessTier) -> int:
    stats = [meta.stats() for meta in parts.blocks.metas.values()]
    return sum(int(s["leases"]) - int(s["releases"]) for s in stats)  # type: ignore[call-overload]


@pytest.fixture()
def parts(tmp_path: Path) -> InProcessTier:
    return InProcessTier(tmp_path, release_batch_s=0)


@pytest.fixture(params=["cluster", "files"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "cluster":
        return InProcessTier(tmp_path, release_batch_s=0).tier
    return DirectoryTier(tmp_path / "files", GEOMETRY)


def leases(tier: Tier) -> bool:
    return not isinstance(tier, DirectoryTier)


# --- namespaces ---------------------------------------------------------------------------------


def test_two_tenants_keys_never_meet(tier: Tier) -> None:
    a, b = view(tier, "alice"), view(tier, "bob")
    tokens, keys = prompt(4)
    put = a.put_blocks(keys, payloads(keys, "a"))
    assert (put.stored, put.existing, put.failed_keys, put.busy_keys) == (4, 0, (), ())
    a.put_swa_state(keys[3], 4 * BLOCK, state(1))

    missed = hit(b, tokens)
    assert (missed.plan.block_hit_tokens, len(missed.hit_block_keys), missed.lease_id) == (
        0,
        0,
        None,
    )
    assert read(b, keys) == [None] * 4
    assert b.get_swa_state(keys[3], 4 * BLOCK).state is None
    # The tier itself never saw the raw keys.
    assert [r.payload for r in tier.get_blocks(keys)] == [None] * 4
    assert tier.get_swa_state(keys[3], 4 * BLOCK).state is None

    # B's put of the same keys is a write of its own, not "already there".
    again = b.put_blocks(keys, payloads(keys, "b"))
    assert (again.stored, again.existing) == (4, 0)
    b.put_swa_state(keys[3], 4 * BLOCK, state(2))
    assert read(a, keys) == payloads(keys, "a")
    assert read(b, keys) == payloads(keys, "b")
    assert a.get_swa_state(keys[3], 4 * BLOCK).state == state(1)
    assert b.get_swa_state(keys[3], 4 * BLOCK).state == state(2)

    found = hit(a, tokens)
    assert found.plan.block_hit_tokens == 4 * BLOCK
    assert list(found.hit_block_keys) == keys
    assert (found.lease_id is not None) == leases(tier)
    assert read(a, keys, found.lease_id) == payloads(keys, "a")


def test_answers_carry_the_callers_own_keys(tier: Tier) -> None:
    a = view(tier, "alice")
    tokens, keys = prompt(6, seed=1)
    a.put_blocks(keys, payloads(keys, "a"))
    a.put_swa_state(keys[5], 6 * BLOCK, state(3))
    by_tokens = hit(a, tokens, mode="standard")
    assert (by_tokens.plan.hit_tokens, by_tokens.plan.swa_hit) == (6 * BLOCK, True)
    assert list(by_tokens.hit_block_keys) == keys
    assert by_tokens.hit_keys_packed == b"".join(keys)
    for asked in (keys, key_words(keys)):
        by_keys = a.query_hit(
            HitRequest(block_keys=asked, prompt_len=len(tokens), mode="standard", take_lease=False)
        )
        assert by_keys.plan == by_tokens.plan and list(by_keys.hit_block_keys) == keys
    reads = a.get_blocks(keys, by_tokens.lease_id)
    assert [r.key for r in reads] == keys
    assert [r.payload for r in reads] == payloads(keys, "a")
    # Without the state the standard hit backs off one block: the first five keys.
    other_tokens, other_keys = prompt(3, seed=2)
    a.put_blocks(other_keys, payloads(other_keys, "a"))
    short = hit(a, other_tokens, mode="standard", lease=False)
    assert short.plan.hit_tokens == 2 * BLOCK and list(short.hit_block_keys) == other_keys[:2]


# --- the shared namespace -----------------------------------------------------------------------


def _shared_setup(tier: Tier) -> tuple[TenantView, TenantView, TenantView, np.ndarray, list[bytes]]:
    """A writer put blocks 0-2 in the shared namespace; the reader (and a tenant that may not
    read it) blocks 3-5 in their own."""
    writer = view(tier, "writer", shared="write")
    reader = view(tier, "reader", shared="read")
    loner = view(tier, "loner", shared="none")
    tokens, keys = prompt(6, seed=3)
    put = writer.put_blocks(keys[:3], payloads(keys[:3], "shared"), shared=True)
    assert (put.stored, put.existing) == (3, 0)
    assert reader.put_blocks(keys[3:], payloads(keys[3:], "reader")).stored == 3
    assert loner.put_blocks(keys[3:], payloads(keys[3:], "loner")).stored == 3
    return writer, reader, loner, tokens, keys


def test_a_reader_gets_the_shared_run_and_its_own_blocks_in_one_hit(tier: Tier) -> None:
    writer, reader, loner, tokens, keys = _shared_setup(tier)
    expected = payloads(keys[:3], "shared") + payloads(keys[3:], "reader")

    answer = hit(reader, tokens)
    assert answer.plan.block_hit_tokens == 6 * BLOCK
    assert list(answer.hit_block_keys) == keys
    assert (answer.lease_id is not None) == leases(tier)
    assert read(reader, keys, answer.lease_id) == expected  # with the lease
    assert read(reader, keys) == expected  # without one
    if leases(tier):
        # One lease, several batches: the shared blocks are found through it each time.
        kept = hit(reader, tokens)
        assert kept.lease_id is not None
        batches = [
            [r.payload for r in reader.get_blocks(keys[i : i + 2], kept.lease_id, keep_lease=True)]
            for i in (4, 0, 2)
        ]
        assert batches == [expected[4:6], expected[0:2], expected[2:4]]
        assert reader.release_lease(kept.lease_id) is True

    # A tenant that may not read the shared namespace: no shared hit, no shared bytes.
    none = hit(loner, tokens)
    assert none.plan.block_hit_tokens == 0 and none.lease_id is None
    assert read(loner, keys) == [None] * 3 + payloads(keys[3:], "loner")
    # The writer reads the shared run too (its own namespace has nothing after it).
    mine = hit(writer, tokens, lease=False)
    assert mine.plan.block_hit_tokens == 3 * BLOCK
    assert list(mine.hit_block_keys) == keys[:3]


@pytest.mark.parametrize("kind", ["mixed", "only shared", "no shared"])
def test_the_async_path_gives_the_sync_answer(tmp_path: Path, kind: str) -> None:
    parts = InProcessTier(tmp_path / "cluster", release_batch_s=0)
    files = DirectoryTier(tmp_path / "files", GEOMETRY)
    for tier in (parts.tier, files):
        writer, reader, _, tokens, keys = _shared_setup(tier)
        expected = payloads(keys[:3], "shared") + payloads(keys[3:], "reader")
        if kind == "only shared":
            tokens, keys, expected = tokens[: 3 * BLOCK + 200], keys[:3], expected[:3]
        elif kind == "no shared":
            tokens, keys = prompt(4, seed=9)
            reader.put_blocks(keys, payloads(keys, "reader"))
            expected = payloads(keys, "reader")
        for mode in (BOUNDED, "standard"):
            request = HitRequest(token_ids=tokens, mode=mode)
            sync = reader.query_hit(request)
            awaited = asyncio.run(reader.query_hit_async(request))
            assert awaited.plan == sync.plan, (kind, mode)
            assert list(awaited.hit_block_keys) == list(sync.hit_block_keys)
            assert (awaited.swa_owner, awaited.advice) == (sync.swa_owner, sync.advice)
            assert list(awaited.hit_block_keys) == keys[: sync.plan.hit_tokens // BLOCK]
            if mode == BOUNDED:
                assert sync.plan.block_hit_tokens == len(keys) * BLOCK
            for answer in (sync, awaited):
                assert (answer.lease_id is not None) == (tier is parts.tier)
                assert read(reader, keys, answer.lease_id) == expected
        assert reader.stats().classes["default"]["lookups"] == 4
    # Every lease the two namespaces' lookups took was given back or read.
    assert outstanding_leases(parts) == 0
    assert parts.tier.stats().extra["open_leases"] == 0


def test_a_readers_state_is_found_after_a_shared_run(parts: InProcessTier) -> None:
    writer, reader, loner, tokens, keys = _shared_setup(parts.tier)
    reader.put_swa_state(keys[5], 6 * BLOCK, state(5))
    answer = hit(reader, tokens, mode="standard", lease=False)
    assert (answer.plan.hit_tokens, answer.plan.swa_hit) == (6 * BLOCK, True)
    # A state the writer put in the shared namespace is read by readers, not by others.
    writer.put_swa_state(keys[2], 3 * BLOCK, state(6), shared=True)
    shared_only = hit(reader, tokens[: 3 * BLOCK + 200], mode="standard", lease=False)
    assert (shared_only.plan.hit_tokens, shared_only.plan.swa_hit) == (3 * BLOCK, True)
    assert reader.get_swa_state(keys[2], 3 * BLOCK).state == state(6)
    assert writer.get_swa_state(keys[2], 3 * BLOCK).state == state(6)
    assert loner.get_swa_state(keys[2], 3 * BLOCK).state is None
    # The reader's own state for that position wins over the shared one.
    reader.put_swa_state(keys[2], 3 * BLOCK, state(7))
    assert reader.get_swa_state(keys[2], 3 * BLOCK).state == state(7)


def test_a_state_at_the_end_of_a_shared_run_is_the_shared_ones(parts: InProcessTier) -> None:
    """Documented behaviour: the state at a position inside the shared run is looked for in the
    shared namespace (the trusted writer publishes it with the prompt); a reader's own state
    there is kept and read back, but a hit on the shared prefix does not use it."""
    writer, reader, _, tokens, keys = _shared_setup(parts.tier)
    reader.put_swa_state(keys[1], 2 * BLOCK, state(8))
    assert reader.get_swa_state(keys[1], 2 * BLOCK).state == state(8)
    answer = hit(reader, tokens[: 2 * BLOCK + 200], mode="standard", lease=False)
    assert answer.plan.block_hit_tokens == 2 * BLOCK
    assert (answer.plan.hit_tokens, answer.plan.swa_hit) == (BLOCK, False)  # backs off a block
    writer.put_swa_state(keys[1], 2 * BLOCK, state(9), shared=True)
    answer = hit(reader, tokens[: 2 * BLOCK + 200], mode="standard", lease=False)
    assert (answer.plan.hit_tokens, answer.plan.swa_hit) == (2 * BLOCK, True)


def test_only_the_writer_role_writes_the_shared_namespace(tier: Tier) -> None:
    writer = view(tier, "writer", shared="write")
    tokens, keys = prompt(2, seed=4)
    for shared in ("read", "none"):
        other = view(tier, f"not-a-writer-{shared}", shared=shared)
        with pytest.raises(Forbidden, match="shared namespace"):
            other.put_blocks(keys, payloads(keys, "x"), shared=True)
        with pytest.raises(Forbidden, match="shared namespace"):
            other.put_swa_state(keys[1], 2 * BLOCK, state(1), shared=True)
    # Nothing was written anywhere.
    assert read(writer, keys) == [None, None]
    assert hit(writer, tokens, lease=False).plan.block_hit_tokens == 0
    assert writer.get_swa_state(keys[1], 2 * BLOCK).state is None


# --- leases -------------------------------------------------------------------------------------


def test_lease_ids_are_per_view(parts: InProcessTier) -> None:
    a, b = view(parts.tier, "alice"), view(parts.tier, "bob")
    tokens, keys = prompt(3, seed=5)
    a.put_blocks(keys, payloads(keys, "a"))
    b.put_blocks(keys, payloads(keys, "b"))
    answer = hit(a, tokens)
    assert answer.lease_id is not None and outstanding_leases(parts) == 3
    assert b.release_lease(answer.lease_id) is False
    with pytest.raises(LeaseError, match="unknown or has expired"):
        b.get_blocks(keys, answer.lease_id)
    with pytest.raises(LeaseError):
        b.get_blocks(keys, answer.lease_id, keep_lease=True)
    assert outstanding_leases(parts) == 3  # untouched by B
    assert read(a, keys, answer.lease_id) == payloads(keys, "a")
    assert outstanding_leases(parts) == 0  # the read gave it back
    with pytest.raises(LeaseError):
        a.get_blocks(keys, answer.lease_id)
    assert a.release_lease(answer.lease_id) is False


def test_the_lease_cap_refuses_and_frees_after_a_release(parts: InProcessTier) -> None:
    capped = view(parts.tier, "capped", max_leases=2)
    other = view(parts.tier, "other", max_leases=2)
    tokens, keys = prompt(2, seed=6)
    capped.put_blocks(keys, payloads(keys, "c"))
    other.put_blocks(keys, payloads(keys, "o"))
    first, second = hit(capped, tokens), hit(capped, tokens)
    assert first.lease_id and second.lease_id and first.lease_id != second.lease_id
    with pytest.raises(Overloaded, match="'capped' holds 2 leases"):
        hit(capped, tokens)
    assert outstanding_leases(parts) == 4  # the refused query took none
    assert hit(capped, tokens, lease=False).plan.block_hit_tokens == 2 * BLOCK  # no lease: fine
    assert hit(other, tokens).lease_id  # another tenant's cap is its own
    assert capped.stats().extra["open_leases"] == 2
    assert capped.release_lease(first.lease_id) is True
    third = hit(capped, tokens)
    assert third.lease_id
    with pytest.raises(Overloaded):
        hit(capped, tokens)
    assert read(capped, keys, second.lease_id) == payloads(keys, "c")  # a read ends a lease
    assert hit(capped, tokens).lease_id


def test_the_lease_cap_holds_when_a_tenant_asks_many_times_at_once(parts: InProcessTier) -> None:
    # The cap is taken with the lease in the tier's one table: 40 questions at once from a
    # tenant capped at 5 get exactly 5 leases, never more (a check before asking and a count
    # after answering let concurrent questions slip past it).
    capped = view(parts.tier, "capped", max_leases=5)
    tokens, keys = prompt(2, seed=8)
    capped.put_blocks(keys, payloads(keys, "c"))
    start = threading.Barrier(40)
    granted: list[str] = []
    refused: list[Overloaded] = []

    def ask() -> None:
        start.wait()
        try:
            answer = hit(capped, tokens)
            assert answer.lease_id is not None
            granted.append(answer.lease_id)
        except Overloaded as error:
            refused.append(error)

    threads = [threading.Thread(target=ask) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert (len(granted), len(refused)) == (5, 35)
    assert capped.stats().extra["open_leases"] == 5
    assert outstanding_leases(parts) == 5 * len(keys)  # the refused ones gave theirs back


def test_one_question_is_counted_once_for_the_tenant_and_the_tier(parts: InProcessTier) -> None:
    # A reader of the shared namespace asks the tier two or three times per question (shared,
    # own, mixed); the figures count the question, once, in one set of counters.
    writer, reader, _, tokens, keys = _shared_setup(parts.tier)
    answer = hit(reader, tokens, lease=False)
    assert answer.plan.block_hit_tokens == 6 * BLOCK
    mine = reader.stats().classes["default"]
    assert (mine["lookups"], mine["hit_blocks"], mine["miss_blocks"]) == (1, 6, 0)
    whole = parts.tier.stats().classes["default"]
    assert (whole["lookups"], whole["hit_blocks"], whole["miss_blocks"]) == (1, 6, 0)
    assert writer.stats().classes.get("default", {}).get("lookups", 0) == 0


def test_keep_lease_reads_several_batches_with_one_lease(parts: InProcessTier) -> None:
    a = view(parts.tier, "alice")
    tokens, keys = prompt(6, seed=7)
    a.put_blocks(keys, payloads(keys, "a"))
    answer = hit(a, tokens)
    assert answer.lease_id is not None and outstanding_leases(parts) == 6
    for start in (0, 2, 4, 0):
        batch = keys[start : start + 2]
        got = a.get_blocks(batch, answer.lease_id, keep_lease=True)
        assert [r.payload for r in got] == payloads(batch, "a")
        assert outstanding_leases(parts) == 6 and a.stats().extra["open_leases"] == 1
    assert a.release_lease(answer.lease_id) is True
    assert outstanding_leases(parts) == 0 and a.stats().extra["open_leases"] == 0
    with pytest.raises(LeaseError):
        a.get_blocks(keys[:1], answer.lease_id, keep_lease=True)
    assert a.release_lease(answer.lease_id) is False


def test_a_tenant_keeps_every_lease_up_to_its_own_cap(
    parts: InProcessTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenancy, "DEFAULT_MAX_LEASES", 10)  # table of 40, as 40,000 deployed
    big = view(parts.tier, "big", max_leases=100)
    tokens, keys = prompt(1, seed=8)
    big.put_blocks(keys, payloads(keys, "b"))
    ids = [hit(big, tokens).lease_id for _ in range(41)]
    assert all(ids)
    assert big.stats().extra["open_leases"] == 41
    assert read(big, keys, ids[0]) == payloads(keys, "b")


# --- policy checks ------------------------------------------------------------------------------


def test_a_put_of_the_wrong_size_or_repeating_a_key_is_refused(tier: Tier) -> None:
    a = view(tier, "alice")
    tokens, keys = prompt(3, seed=10)
    good = payloads(keys, "a")
    for index, wrong in ((1, good[1][:-1]), (2, good[2] + b"x"), (0, b"")):
        bad = list(good)
        bad[index] = wrong
        with pytest.raises(InvalidArgument, match=str(SIZE)) as raised:
            a.put_blocks(keys, bad)
        assert raised.value.argument == f"payloads[{index}]"
    with pytest.raises(InvalidArgument) as raised:
        a.put_blocks(keys, good[:2])
    assert raised.value.argument == "payloads"
    with pytest.raises(InvalidArgument, match="twice") as raised:
        a.put_blocks([keys[0], keys[1], keys[0]], [good[0], good[1], good[0]])
    assert raised.value.argument == "keys"
    with pytest.raises(InvalidArgument) as raised:
        a.put_blocks([keys[0], keys[1][:31]], good[:2])
    assert raised.value.argument == "keys[1]"
    # Nothing of the refused puts was stored.
    assert read(a, keys) == [None] * 3
    assert hit(a, tokens, lease=False).plan.block_hit_tokens == 0
    assert a.put_blocks(keys, good).stored == 3


def test_the_bytes_quota_refuses_the_block_that_does_not_fit(parts: InProcessTier) -> None:
    quota = view(parts.tier, "quota", classes=("agent",), max_bytes=2 * SIZE)
    _, keys = prompt(4, seed=11)
    assert quota.put_blocks(keys[:1], payloads(keys[:1], "q")).stored == 1
    with pytest.raises(Overloaded, match="'quota'"):
        quota.put_blocks(keys[1:3], payloads(keys[1:3], "q"))  # 1 + 2 > 2
    assert quota.put_blocks(keys[1:2], payloads(keys[1:2], "q")).stored == 1
    with pytest.raises(Overloaded, match=f"{2 * SIZE} bytes"):
        quota.put_blocks(keys[2:3], payloads(keys[2:3], "q"))
    assert read(quota, keys) == payloads(keys[:2], "q") + [None, None]
    assert parts.tier.stats().classes["agent"]["stored_bytes"] == 2 * SIZE
    # A view made afresh (a gateway restart) counts from the tier's figures.
    fresh = view(parts.tier, "quota", classes=("agent",), max_bytes=2 * SIZE)
    with pytest.raises(Overloaded):
        fresh.put_blocks(keys[2:3], payloads(keys[2:3], "q"))
    assert quota.stats().classes["agent"]["stored_bytes"] == 2 * SIZE
    assert quota.stats().block_bytes_stored == 2 * SIZE


def test_concurrent_puts_never_pass_the_bytes_quota_together(parts: InProcessTier) -> None:
    # 12 puts of 4 blocks at once against a 10-block quota: the bytes are reserved before a
    # put runs, so at most two fit (a check then a put let all 12 through: 48 blocks).
    quota = view(parts.tier, "quota", classes=("agent",), max_bytes=10 * SIZE)
    _, keys = prompt(48, seed=14)
    start = threading.Barrier(12)
    stored: list[int] = []
    refused: list[Overloaded] = []

    def put(part: list[bytes]) -> None:
        start.wait()
        try:
            stored.append(quota.put_blocks(part, payloads(part, "q"), "agent").stored)
        except Overloaded as error:
            refused.append(error)

    threads = [threading.Thread(target=put, args=(keys[i : i + 4],)) for i in range(0, 48, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(stored) <= 10 and len(stored) + len(refused) == 12
    assert parts.tier.stats().classes["agent"]["stored_bytes"] == sum(stored) * SIZE <= 10 * SIZE


def test_a_tenants_swa_flood_never_evicts_anothers_state(parts: InProcessTier) -> None:
    # Issue 31 item 5: a tenant storing 40 states flushed another tenant's state out of the
    # shared SWA store (its next read: not_in_directory_or_owner_lost).
    victim, flood = view(parts.tier, "victim"), view(parts.tier, "flood")
    _, keys = prompt(41, seed=15)
    assert victim.put_swa_state(keys[0], BLOCK, state(1)) == "m0"
    for n in range(1, 41):
        assert flood.put_swa_state(keys[n], (n + 1) * BLOCK, state(n % 200)) == "m0"
    read = victim.get_swa_state(keys[0], BLOCK)
    assert (read.state, read.miss_reason) == (state(1), None)
    # Each store holds 8 states: the flood recycles its own, and holds the rest of the room.
    assert flood.get_swa_state(keys[40], 41 * BLOCK).state == state(40)
    assert flood.get_swa_state(keys[1], 2 * BLOCK).state is None
    assert (victim.stats().swa_bytes_stored, flood.stats().swa_bytes_stored) == (STATE, 7 * STATE)
    owners = parts.tier.stats().extra["swa"]["bytes_by_owner"]
    assert owners == {"victim": STATE, "flood": 7 * STATE}


def test_swa_states_count_toward_the_bytes_quota(parts: InProcessTier) -> None:
    # Issue 31 item 5: a tenant with a 10-block quota stored 40 states (57 MB) beside it.
    ten = view(parts.tier, "ten-blocks", classes=("agent",), max_bytes=10 * SIZE)
    _, keys = prompt(4, seed=16)
    with pytest.raises(Overloaded, match=f"'ten-blocks' stores or is writing 0 of its {10 * SIZE}"):
        ten.put_swa_state(keys[0], BLOCK, state(1))  # one state is more than 10 blocks
    assert ten.get_swa_state(keys[0], BLOCK).state is None
    # Blocks and states together: 2 blocks and 2 states fit, nothing more of either.
    quota = view(parts.tier, "quota", classes=("agent",), max_bytes=2 * SIZE + 2 * STATE)
    assert quota.put_blocks(keys[:2], payloads(keys[:2], "q")).stored == 2
    quota.put_swa_state(keys[0], BLOCK, state(2))
    quota.put_swa_state(keys[1], 2 * BLOCK, state(3), machine="m1")
    with pytest.raises(Overloaded, match=f"'quota' stores or is writing {2 * SIZE + 2 * STATE}"):
        quota.put_swa_state(keys[2], 3 * BLOCK, state(4))
    with pytest.raises(Overloaded, match="'quota'"):
        quota.put_blocks(keys[2:3], payloads(keys[2:3], "q"))
    assert quota.get_swa_state(keys[2], 3 * BLOCK).state is None
    assert quota.stats().swa_bytes_stored == 2 * STATE  # over both stores
    # A view made afresh (a gateway restart) counts the states from the tier's figures.
    fresh = view(parts.tier, "quota", classes=("agent",), max_bytes=2 * SIZE + 2 * STATE)
    with pytest.raises(Overloaded, match="'quota'"):
        fresh.put_swa_state(keys[3], 4 * BLOCK, state(5))


def test_a_class_outside_the_tenants_list_is_forbidden(parts: InProcessTier) -> None:
    agent = view(parts.tier, "agent-only", classes=("agent",))
    tokens, keys = prompt(2, seed=12)
    with pytest.raises(Forbidden, match="'chatbot'"):
        agent.put_blocks(keys, payloads(keys, "a"), "chatbot")
    with pytest.raises(Forbidden, match="'default'"):
        agent.query_hit(HitRequest(token_ids=tokens, traffic_class="default"))
    assert outstanding_leases(parts) == 0
    assert parts.tier.stats().block_bytes_stored == 0
    # Its own class, named or by default.
    assert agent.put_blocks(keys, payloads(keys, "a")).stored == 2
    assert parts.tier.stats().classes["agent"]["stored_bytes"] == 2 * SIZE
    assert hit(agent, tokens, lease=False).plan.block_hit_tokens == 2 * BLOCK
    found = agent.query_hit(HitRequest(token_ids=tokens, traffic_class="agent", take_lease=False))
    assert found.plan.block_hit_tokens == 2 * BLOCK
    assert agent.stats().classes["agent"]["lookups"] == 2


# --- figures ------------------------------------------------------------------------------------


def test_stats_are_the_tenants_own_an_admin_sees_the_tier(parts: InProcessTier) -> None:
    tier = parts.tier
    quiet = view(tier, "quiet")
    busy = view(tier, "busy")
    agent = view(tier, "agent-only", classes=("agent",))
    admin = view(tier, "root", admin=True)
    tokens, keys = prompt(4, seed=13)
    busy.put_blocks(keys, payloads(keys, "b"))
    hit(busy, tokens, lease=False)
    hit(busy, tokens, lease=False)
    hit(quiet, tokens, lease=False)
    agent.put_blocks(keys[:1], payloads(keys[:1], "g"))

    mine = quiet.stats()
    assert mine.classes == {
        "default": {
            "lookups": 1,
            "hit_blocks": 0,
            "miss_blocks": 4,
            "miss_reasons": {},
            "stored_bytes": 0,
        }
    }
    assert (mine.block_bytes_stored, mine.swa_bytes_stored) == (0, 0)
    assert mine.extra["tenant"] == "quiet" and mine.storage_nodes == 12
    theirs = busy.stats()
    assert theirs.classes["default"]["lookups"] == 2
    assert theirs.classes["default"]["hit_blocks"] == 8
    assert theirs.classes["default"]["stored_bytes"] == 0  # "default" is not its own class
    assert set(theirs.classes) == {"default"} and theirs.block_bytes_stored == 0
    own = agent.stats()
    assert set(own.classes) == {"agent"}
    assert own.classes["agent"]["stored_bytes"] == SIZE and own.block_bytes_stored == SIZE
    assert own.classes["agent"]["lookups"] == 0
    everything = admin.stats()
    base = tier.stats()
    assert everything.block_bytes_stored == base.block_bytes_stored == 5 * SIZE
    assert everything.classes == base.classes
    assert everything.classes["default"]["lookups"] == 3


def test_with_a_quota_in_the_file_every_tenant_names_its_classes(tmp_path: Path) -> None:
    """A tenant allowed every class could fill the class another's quota counts over (and see
    its figures): a tokens file with a quota and a tenant without classes is refused."""
    text = (
        '[tenants.owner]\ntokens = ["owner-token-000000001"]\nclasses = ["agent"]\n'
        f"max_bytes = {2 * SIZE}\n\n"
        '[tenants.anyone]\ntokens = ["anyone-token-00000001"]\n'
    )
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as raised:
        TenantDirectory(b"s" * 32, tokens_file=path)
    assert raised.value.field == "tenants.anyone.classes"
    path.write_text(text + 'classes = ["chatbot"]\n')
    assert set(TenantDirectory(b"s" * 32, tokens_file=path).tenants()) == {"owner", "anyone"}


def test_tenant_views_keep_one_view_per_tenant_and_take_new_policy(parts: InProcessTier) -> None:
    views = TenantViews(parts.tier)
    first = DIRECTORY.make("alice", max_leases=5)
    alice = views.view(first)
    assert views.view(first) is alice and alice.tenant is first
    bob = views.view(DIRECTORY.make("bob"))
    assert bob is not alice and bob.tenant.name == "bob"
    tokens, keys = prompt(2, seed=15)
    alice.put_blocks(keys, payloads(keys, "a"))
    taken = hit(alice, tokens)
    assert taken.lease_id is not None
    # The tokens file was reloaded: a new Tenant object, same name, a lower cap.
    reloaded: Tenant = DIRECTORY.make("alice", max_leases=1)
    again = views.view(reloaded)
    assert again is alice and again.tenant is reloaded
    with pytest.raises(Overloaded, match="holds 1 leases"):
        hit(again, tokens)
    assert read(again, keys, taken.lease_id) == payloads(keys, "a")  # its lease lived on
    assert read(bob, keys) == [None, None]


def test_states_are_found_only_at_their_position(tier: Tier) -> None:
    a, b = view(tier, "alice"), view(tier, "bob")
    _, keys = prompt(3, seed=16)
    a.put_swa_state(keys[2], 3 * BLOCK, state(9))
    a.put_swa_state(keys[1], 2 * BLOCK, state(10))
    assert a.get_swa_state(keys[2], 3 * BLOCK).state == state(9)
    assert a.get_swa_state(keys[1], 2 * BLOCK).state == state(10)
    for position in (BLOCK, 2 * BLOCK, 4 * BLOCK):
        assert a.get_swa_state(keys[2], position).state is None, position
    assert a.get_swa_state(keys[1], 3 * BLOCK).state is None
    assert b.get_swa_state(keys[2], 3 * BLOCK).state is None
