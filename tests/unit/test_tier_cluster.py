"""``ClusterTier``, the one facade over the cluster, with every part in this process (no Ray):
plans, leases (bounded, swept, released), reads, puts, SWA states, figures — and the two bugs the
facade's copies had (degraded reads credited to the wrong request; hit keys that drifted)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from blockstore_tier import placements_of
from tier_parts import GEOMETRY, InProcessTier

from kvstore.blockstore.capability import CapabilityRefused, ReadCapability, verify
from kvstore.blockstore.fanout import NODE
from kvstore.errors import InvalidArgument, LeaseError, StateRejected
from kvstore.keys import block_keys
from kvstore.tenants import Tenant, salts
from kvstore.tier.files import DirectoryTier
from kvstore.tier.records import HitRequest, LeaseTag
from kvstore.tier.revoke import Revoker
from kvstore.tier.tenancy import TenantView

BLOCK = GEOMETRY.block_tokens
STATE = GEOMETRY.state_size_to_disk


def prompt(blocks: int, extra: int = 200, seed: int = 0) -> tuple[np.ndarray, list[bytes]]:
    tokens = np.random.default_rng(seed).integers(0, 100_000, blocks * BLOCK + extra)
    return tokens, list(block_keys(GEOMETRY.fingerprint(), tokens))[:blocks]


def payload(key: bytes, size: int = 3000) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def outstanding_leases(parts: InProcessTier) -> int:
    stats = [meta.stats() for meta in parts.blocks.metas.values()]
    return sum(int(s["leases"]) - int(s["releases"]) for s in stats)  # type: ignore[call-overload]


@pytest.fixture()
def parts(tmp_path) -> InProcessTier:  # type: ignore[no-untyped-def]
    return InProcessTier(tmp_path, release_batch_s=0)


def test_a_hit_is_planned_leased_read_and_released(parts: InProcessTier) -> None:
    tier = parts.tier
    tokens, keys = prompt(8)  # L = 1224: cap 1090 → 8 whole blocks inside it
    put = tier.put_blocks(keys, [payload(k) for k in keys], "chatbot")
    assert (put.stored, put.existing, put.committed, put.failed_keys) == (8, 0, 8, ())
    again = tier.put_blocks(keys[:2], [payload(k) for k in keys[:2]], "chatbot")
    assert (again.stored, again.existing) == (0, 2)
    assert tier.put_swa_state(keys[7], 8 * BLOCK, bytes(STATE), machine="m1") == "m1"

    answer = tier.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot"))
    plan = answer.plan
    assert (plan.block_hit_tokens, plan.hit_tokens, plan.swa_hit) == (1024, 1024, True)
    assert answer.swa_owner == "m1" and answer.advice in ("fetch", "replay")
    assert list(answer.hit_block_keys) == keys and answer.lease_id
    assert outstanding_leases(parts) == 8
    reads = tier.get_blocks(list(answer.hit_block_keys), answer.lease_id)
    assert [r.payload for r in reads] == [payload(k) for k in keys]
    assert not any(r.degraded for r in reads)
    assert outstanding_leases(parts) == 0  # a read with the lease gives it back
    with pytest.raises(LeaseError, match="unknown or has expired"):
        tier.get_blocks(keys[:1], answer.lease_id)
    state = tier.get_swa_state(keys[7], 8 * BLOCK)
    assert state.owner == "m1" and state.state == bytes(STATE)

    by_keys = tier.query_hit(HitRequest(block_keys=keys, prompt_len=len(tokens), take_lease=False))
    assert by_keys.plan == plan and by_keys.lease_id is None
    assert outstanding_leases(parts) == 0  # not kept: given back at once
    figures = tier.stats()
    assert figures.classes["chatbot"]["lookups"] == 1 and figures.classes["default"]["lookups"] == 1
    assert figures.block_bytes_stored == 8 * 3000 and figures.swa_bytes_stored == STATE
    assert figures.extra["open_leases"] == 0 and figures.storage_nodes == 12


def test_release_gives_a_lease_back_once(parts: InProcessTier) -> None:
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    answer = tier.query_hit(HitRequest(token_ids=tokens))
    assert answer.lease_id and outstanding_leases(parts) == 4
    assert tier.release_lease(answer.lease_id) is True
    assert tier.release_lease(answer.lease_id) is False
    assert outstanding_leases(parts) == 0


def test_the_lease_table_is_bounded_and_swept_on_expiry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = InProcessTier(tmp_path, release_batch_s=0, max_open_leases=2, lease_seconds=30.0)
    tier = parts.tier
    tokens, keys = prompt(2)
    tier.put_blocks(keys, [payload(k) for k in keys])
    first, second, third = (tier.query_hit(HitRequest(token_ids=tokens)) for _ in range(3))
    # A third lease pushed the oldest out of the table, and it was given back in the cluster.
    assert tier.stats().extra["open_leases"] == 2 and outstanding_leases(parts) == 4
    assert tier.release_lease(first.lease_id or "") is False
    parts.clock.advance(31)  # past the lease end: the sweep drops and releases both
    assert tier.sweep_leases() == 2
    assert tier.stats().extra["open_leases"] == 0 and outstanding_leases(parts) == 0
    assert tier.release_lease(second.lease_id or "") is False
    assert tier.release_lease(third.lease_id or "") is False


def test_hit_keys_are_the_blocks_the_engine_loads_in_every_implementation(
    parts: InProcessTier, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """In standard mode with the SWA state missing the hit backs off one block: the engine loads
    ``hit_tokens`` worth of blocks and recomputes the last one, so the answer names exactly those
    (the gateway once answered the whole run, the engine-side tiers only the hit)."""
    tokens, keys = prompt(6)  # cap 834 → L1 = 768; no state: hit 640
    files = DirectoryTier(tmp_path / "files", GEOMETRY)
    for tier in (parts.tier, files):
        tier.put_blocks(keys, [payload(k) for k in keys])
        standard = tier.query_hit(HitRequest(token_ids=tokens, take_lease=False))
        assert (standard.plan.block_hit_tokens, standard.plan.hit_tokens) == (768, 640)
        assert list(standard.hit_block_keys) == keys[:5]
        assert standard.hit_keys_packed == b"".join(keys[:5])
        bounded = tier.query_hit(
            HitRequest(token_ids=tokens, mode="bounded-replay", take_lease=False)
        )
        assert bounded.plan.hit_tokens == 768 and list(bounded.hit_block_keys) == keys[:6]


def _by_role_of(parts: InProcessTier, keys: list[bytes], node: int) -> tuple[bytes, bytes]:
    """A key whose data shards avoid ``node`` (it holds parity) and one with a data shard there."""
    lookup = parts.blocks.client.lookup(keys)
    parts.blocks.client.release(lookup.lease)
    assert lookup.lease is not None
    parity = data = None
    for key, placement in zip(lookup.lease.keys, lookup.lease.placements.tolist(), strict=True):
        if node in placement[10:] and parity is None:
            parity = key
        if node in placement[:10] and data is None:
            data = key
    assert parity is not None and data is not None
    return parity, data


def test_a_reads_degraded_flag_is_its_own_under_concurrency(parts: InProcessTier) -> None:
    """Two reads at once, one degraded (a data shard's node is down) and one not: each request
    reports its own. The gateway's copy once diffed a counter all threads share, so the degraded
    read of one request was credited to whichever request was in flight."""
    tier = parts.tier
    _, keys = prompt(40, seed=3)
    tier.put_blocks(keys, [payload(k) for k in keys])
    healthy, degraded = _by_role_of(parts, keys, node=5)
    parts.blocks.fanout.dead.add((NODE, 5))
    fanout = parts.blocks.fanout
    inner: dict[str, object] = {}
    original = fanout.submit

    def submit(target, method, *args):  # type: ignore[no-untyped-def]
        # While the healthy read asks its first node, the degraded one runs to completion.
        if not inner and target[0] == NODE:
            inner["started"] = True
            inner["reads"] = tier.get_blocks([degraded])
        return original(target, method, *args)

    fanout.submit = submit  # type: ignore[method-assign]
    try:
        (outer,) = tier.get_blocks([healthy])
    finally:
        fanout.submit = original  # type: ignore[method-assign]
    (nested,) = inner["reads"]  # type: ignore[misc]
    assert outer.payload == payload(healthy) and nested.payload == payload(degraded)
    assert nested.degraded is True
    assert outer.degraded is False
    assert tier.stats().degraded_reads == 1


def test_a_miss_says_what_became_of_its_shards(parts: InProcessTier) -> None:
    """Through the tier seam a miss carries the block client's words: a key never stored is
    not in the index; a block with three of its nodes dead names them as failed; a read that
    came whole says nothing."""
    tier = parts.tier
    _, keys = prompt(40, seed=4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    (never,) = tier.get_blocks([bytes(32)])
    assert never.payload is None and never.miss_detail == "not in the index"
    assert all(r.payload is not None and r.miss_detail is None for r in tier.get_blocks(keys))
    dead = {int(n) for n in placements_of(parts.blocks, keys[:1])[0][:3]}
    parts.blocks.fanout.dead |= {(NODE, n) for n in dead}
    (read,) = tier.get_blocks(keys[:1])
    assert read.payload is None and read.miss_reason
    assert read.miss_detail == f"9 of 12 shards came (10 needed); failed: {sorted(dead)}"


def test_concurrent_hits_share_one_lookup_round(parts: InProcessTier) -> None:
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    barrier = threading.Barrier(8)
    answers = []

    def ask() -> None:
        barrier.wait()
        answers.append(tier.query_hit(HitRequest(token_ids=tokens, take_lease=False)))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 8 and all(a.plan.block_hit_tokens == 512 for a in answers)
    coalescing = tier.stats().extra["coalescing"]["lookups"]
    assert coalescing["requests"] == 8 and coalescing["batches"] <= 8


def test_bad_input_is_named_and_acquires_nothing(parts: InProcessTier) -> None:
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    with pytest.raises(InvalidArgument, match="traffic_class"):
        tier.query_hit(HitRequest(token_ids=tokens, traffic_class="nope"))
    with pytest.raises(InvalidArgument, match="mode"):
        tier.query_hit(HitRequest(token_ids=tokens, mode="sideways"))
    with pytest.raises(InvalidArgument, match="prompt_len"):
        tier.query_hit(HitRequest(token_ids=tokens, prompt_len=5))
    with pytest.raises(InvalidArgument, match="block_keys"):
        tier.query_hit(HitRequest(block_keys=keys, prompt_len=100))  # 4 keys cannot fit 100 tokens
    with pytest.raises(InvalidArgument, match="give token_ids or block_keys"):
        HitRequest()
    assert outstanding_leases(parts) == 0
    with pytest.raises(InvalidArgument, match="machine"):
        tier.put_swa_state(keys[0], BLOCK, bytes(STATE), machine="m9")
    with pytest.raises(InvalidArgument, match="position"):
        tier.put_swa_state(keys[0], 100, bytes(STATE))
    with pytest.raises(StateRejected, match="state"):
        tier.put_swa_state(keys[0], BLOCK, bytes(10))
    with pytest.raises(InvalidArgument, match="position"):
        tier.get_swa_state(keys[0], -128)


def test_an_unreachable_swa_tier_is_a_miss_not_an_error(parts: InProcessTier) -> None:
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    tier.put_swa_state(keys[3], 4 * BLOCK, bytes(STATE))  # on the local machine, m0
    parts.transport.down.update(parts.transport.shards)  # every directory shard gone
    answer = tier.query_hit(HitRequest(token_ids=tokens, take_lease=False))
    assert (answer.plan.hit_tokens, answer.plan.swa_hit, answer.swa_owner) == (384, False, None)
    assert tier.get_swa_state(keys[3], 4 * BLOCK).state is None


def test_a_reader_for_another_process_reads_with_a_lease_id_it_does_not_hold(
    parts: InProcessTier,
) -> None:
    """An engine's fetcher process reads with the lease its scheduler-side tier took (and will
    release): it must read, not refuse; the gateway refuses an unknown lease."""
    from kvstore.tier.cluster import ClusterTier

    tier = parts.tier
    tokens, keys = prompt(3)
    tier.put_blocks(keys, [payload(k) for k in keys])
    answer = tier.query_hit(HitRequest(token_ids=tokens))
    fetcher = ClusterTier(
        blocks=parts.blocks.client,
        swa=None,
        geometry=GEOMETRY,
        state_size=STATE,
        block_bytes=GEOMETRY.block_bytes,
        clock=parts.clock,
        foreign_leases=True,
    )
    reads = fetcher.get_blocks(list(answer.hit_block_keys), answer.lease_id)
    assert [r.payload for r in reads] == [payload(k) for k in keys[:2]]
    assert outstanding_leases(parts) == 3  # still the scheduler side's to release
    assert tier.release_lease(answer.lease_id or "") and outstanding_leases(parts) == 0
    with pytest.raises(LeaseError):
        tier.get_blocks(keys, "lease-of-someone-else")


def test_the_asyncio_path_plans_the_same_and_coalesces_concurrent_hits(
    parts: InProcessTier,
) -> None:
    """The gateway's ``query_hit_async``: the answers of ``query_hit``, and concurrent hits on
    the loop share their lookup rounds."""
    import asyncio

    tier = parts.tier
    tokens, keys = prompt(6)
    tier.put_blocks(keys, [payload(k) for k in keys])
    tier.put_swa_state(keys[5], 6 * BLOCK, bytes(STATE), machine="m2")
    expected = tier.query_hit(HitRequest(token_ids=tokens, take_lease=False))

    async def main() -> list:  # type: ignore[type-arg]
        return list(
            await asyncio.gather(
                *(
                    tier.query_hit_async(HitRequest(token_ids=tokens, take_lease=i % 2 == 0))
                    for i in range(8)
                )
            )
        )

    answers = asyncio.run(main())
    assert all(a.plan == expected.plan and a.swa_owner == "m2" for a in answers)
    assert all(list(a.hit_block_keys) == keys for a in answers)
    assert sum(a.lease_id is not None for a in answers) == 4 and outstanding_leases(parts) == 24
    for answer in answers:
        if answer.lease_id:
            assert tier.release_lease(answer.lease_id)
    assert outstanding_leases(parts) == 0
    coalescing = tier.stats().extra["coalescing"]["lookups"]
    assert coalescing["requests"] == 9 and coalescing["batches"] < 9


def test_a_granted_lease_mints_a_capability_for_exactly_its_shards(tmp_path) -> None:  # type: ignore[no-untyped-def]
    read_key = os.urandom(32)
    parts = InProcessTier(tmp_path, release_batch_s=0, read_key=read_key)
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys], "chatbot")
    holder = LeaseTag(tenant="alice")
    answer = tier.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot", holder=holder))
    assert answer.lease_id
    lease = tier._leases.peek(answer.lease_id)
    assert lease is not None
    capability = tier.read_capability(answer.lease_id)
    assert capability is not None
    assert (capability.lease_id, capability.tenant, capability.expires) == (
        answer.lease_id,
        "alice",
        lease.until,
    )
    now = parts.clock.now()
    placed = set()
    for key, row in zip(lease.block_keys, lease.placements.tolist(), strict=True):
        for node in row:
            verify(read_key, capability, node, key, now)
            placed.add((node, bytes(key)))
    named = {(n, k) for n, grant in capability.grants.items() for k in grant.keys}
    assert named == placed  # exactly the lease's shards, where the lookup placed them
    other = prompt(1, seed=9)[1][0]
    with pytest.raises(CapabilityRefused):
        verify(read_key, capability, 0, other, now)
    tier.release_lease(answer.lease_id)
    assert tier.read_capability(answer.lease_id) is None  # released: none minted any more


def test_a_tier_without_the_read_key_mints_nothing(parts: InProcessTier) -> None:
    tokens, keys = prompt(2)
    parts.tier.put_blocks(keys, [payload(k) for k in keys], "chatbot")
    answer = parts.tier.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot"))
    assert answer.lease_id is not None
    assert parts.tier.read_capability(answer.lease_id) is None


class _Sent:
    """A ``Revoker``'s ``send``: records each batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], float]] = []

    def __call__(self, ids: Sequence[str], until: float) -> None:
        self.batches.append((list(ids), until))

    @property
    def ids(self) -> list[str]:
        return [i for ids, _ in self.batches for i in ids]


def _granting(tmp_path, **overrides) -> tuple[InProcessTier, _Sent, Revoker]:  # type: ignore[no-untyped-def]
    sent = _Sent()
    revoker = Revoker(sent)
    endpoints = {node: ("127.0.0.1", 40000 + node) for node in range(12)}
    parts = InProcessTier(
        tmp_path,
        release_batch_s=0,
        read_key=os.urandom(32),
        read_endpoints=lambda: endpoints,
        revoker=revoker,
        **overrides,
    )
    return parts, sent, revoker


def test_a_direct_lease_comes_with_its_grant_and_its_release_revokes_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts, sent, revoker = _granting(tmp_path)
    tier = parts.tier
    tokens, keys = prompt(4)
    tier.put_blocks(keys, [payload(k) for k in keys])
    plain = tier.query_hit(HitRequest(token_ids=tokens))
    assert plain.lease_id and plain.direct is None  # not asked: not granted
    answer = tier.query_hit(HitRequest(token_ids=tokens, direct=True))
    grant = answer.direct
    assert answer.lease_id and grant is not None
    lease = tier._leases.peek(answer.lease_id)
    assert lease is not None
    hits = len(answer.hit_block_keys)
    assert len(grant) == hits and (grant.k, grant.m) == (10, 2) and len(grant.endpoints) == 12
    assert [key for key, _, _ in grant.blocks()] == list(answer.hit_block_keys)
    assert np.array_equal(grant.placements, lease.placements[:hits])
    capability = ReadCapability.decode(grant.capability)
    assert capability.lease_id == answer.lease_id
    assert tier.release_lease(plain.lease_id)
    assert tier.release_lease(answer.lease_id)
    assert revoker.flush()
    assert sent.ids == [answer.lease_id]  # only the granted lease is worth a revocation
    assert sent.batches[0][1] == lease.until

    # A read that ends the lease revokes it too; a lease swept past its end needs nothing.
    read = tier.query_hit(HitRequest(token_ids=tokens, direct=True))
    tier.get_blocks(list(read.hit_block_keys), read.lease_id)
    expired = tier.query_hit(HitRequest(token_ids=tokens, direct=True))
    assert expired.direct is not None
    parts.clock.advance(tier.lease_seconds + 1)  # type: ignore[attr-defined]
    assert tier.sweep_leases() == 1
    assert revoker.flush()
    assert sent.ids == [answer.lease_id, read.lease_id]
    tier.close()


def test_a_tier_that_cannot_revoke_grants_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = InProcessTier(
        tmp_path, release_batch_s=0, read_key=os.urandom(32), read_endpoints=lambda: {0: ("h", 1)}
    )
    tokens, keys = prompt(2)
    parts.tier.put_blocks(keys, [payload(k) for k in keys])
    answer = parts.tier.query_hit(HitRequest(token_ids=tokens, direct=True))
    assert answer.lease_id and answer.direct is None


def test_a_tenant_view_passes_the_grant_of_its_own_lease_with_its_stored_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts, _, _ = _granting(tmp_path)
    own, shared = salts(b"s" * 32, "alice")
    view = TenantView(parts.tier, Tenant(name="alice", salt=own, shared_salt=shared))
    tokens, keys = prompt(3)
    size = GEOMETRY.block_bytes
    view.put_blocks(keys, [payload(k, size) for k in keys])
    answer = view.query_hit(HitRequest(token_ids=tokens, direct=True))
    assert answer.direct is not None and answer.lease_id
    assert view.lease_tag(answer.lease_id) is not None
    stored = [key for key, _, _ in answer.direct.blocks()]
    hits = list(answer.hit_block_keys)
    assert len(stored) == len(hits) and not set(stored) & set(hits)  # renamed: its namespace
    read = view.get_blocks(hits, answer.lease_id, keep_lease=True)
    assert [r.payload for r in read] == [payload(k, size) for k in keys[: len(hits)]]
    capability = ReadCapability.decode(answer.direct.capability)
    assert capability.tenant == "alice"
