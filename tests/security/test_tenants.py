"""Security review of ``kvstore up`` (issue 15), tenants: findings 1 (poisoning) and 2 (probing
and reading other tenants), plus the policy the operator sets per tenant (shared namespace,
classes, quotas, rates). Every attack is bob's, against alice, through the real gateway.

Block keys are a public function of the token ids (the model fingerprint is in the preset), so
bob computes the keys of any prompt he can guess. Namespacing makes them different keys in the
tier: never found, never read, never overwritten.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from conftest import BLOCK, Tenants

from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.keys import block_keys
from kvstore.tier.records import HitRequest


def prompt(tenants: Tenants, seed: int, blocks: int) -> tuple[np.ndarray, list[bytes]]:
    """A prompt of ``blocks`` full blocks inside the cap, and its (public) block keys."""
    tokens = np.random.default_rng(seed).integers(0, 128_000, blocks * 128 + 200, dtype=np.int64)
    keys = block_keys(tenants.running.tier.model_fingerprint, tokens)[:blocks]
    return tokens, [bytes(k) for k in keys]


def payloads(keys: list[bytes], tag: int = 0) -> list[bytes]:
    return [
        np.random.default_rng([tag, int.from_bytes(k[:8], "little")]).bytes(BLOCK) for k in keys
    ]


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


# --- finding 1: poisoning -------------------------------------------------------------------


def test_garbage_put_first_under_alices_keys_never_reaches_her_engine(tenants: Tenants) -> None:
    tokens, keys = prompt(tenants, 101, 3)
    with tenants.client("bob") as bob:
        bob.put_blocks(keys, [b"\x66" * BLOCK] * 3, "chatbot")  # the first writer
    honest = payloads(keys)
    with tenants.client("alice") as alice:
        put = alice.put_blocks(keys, honest, "chatbot")
        # Her blocks are new in her namespace: written by her, not "already there".
        assert (put.stored, put.existing) == (3, 0)
        hit = alice.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot"))
        assert hit.plan.block_hit_tokens == 3 * 128
        reads = alice.get_blocks(list(hit.hit_block_keys), hit.lease_id)
    assert [r.payload for r in reads] == honest[: len(reads)] and reads


def test_bob_cannot_replace_alices_swa_state(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 102, 3)
    size = tenants.running.tier.state_size
    mine = np.random.default_rng(1).bytes(size)
    with tenants.client("alice") as alice, tenants.client("bob") as bob:
        alice.put_swa_state(keys[2], 384, mine)
        bob.put_swa_state(keys[2], 384, b"\x66" * size)  # last writer, other namespace
        assert alice.get_swa_state(keys[2], 384).state == mine


def test_a_payload_that_is_not_one_block_is_refused(
    stub: pb_grpc.KVStoreStub, tenants: Tenants
) -> None:
    for size in (7, BLOCK - 1, BLOCK + 1):
        request = pb.PutBlocksRequest(
            blocks=[pb.Block(key=bytes([size % 251]) * 32, payload=bytes(size))]
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.PutBlocks(iter([request]), metadata=tenants.auth("alice"))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"blocks[0].payload: must be one block of its layout ({BLOCK} bytes)" in (
            error.value.details() or ""
        )


# --- finding 2: probing and reading ---------------------------------------------------------


def test_bob_cannot_tell_whether_alices_prompt_is_cached(tenants: Tenants) -> None:
    tokens, keys = prompt(tenants, 103, 4)
    with tenants.client("alice") as alice:
        alice.put_blocks(keys, payloads(keys), "chatbot")
        assert (
            alice.query_hit(HitRequest(token_ids=tokens, take_lease=False)).plan.block_hit_tokens
            == 512
        )
    with tenants.client("bob") as bob:
        # The whole prompt, and a guess extended one block at a time: never a hit.
        for blocks in range(1, 5):
            guess = tokens[: blocks * 128 + 200]
            answer = bob.query_hit(HitRequest(token_ids=guess, take_lease=False))
            assert answer.plan.block_hit_tokens == 0 and not answer.hit_keys
        packed = bob.query_hit(
            HitRequest(block_keys=keys, prompt_len=len(tokens), take_lease=False)
        )
        assert packed.plan.block_hit_tokens == 0


def test_bob_cannot_read_alices_blocks_or_states_with_keys_he_computed(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 104, 3)
    size = tenants.running.tier.state_size
    with tenants.client("alice") as alice:
        alice.put_blocks(keys, payloads(keys), "chatbot")
        alice.put_swa_state(keys[2], 384, bytes(size))
    with tenants.client("bob") as bob:
        assert [r.payload for r in bob.get_blocks(keys)] == [None, None, None]
        assert bob.get_swa_state(keys[2], 384).state is None


def test_bobs_figures_show_nothing_of_alices_traffic(tenants: Tenants) -> None:
    tokens, keys = prompt(tenants, 105, 2)
    with tenants.client("bob") as bob:
        before = bob.stats()
    with tenants.client("alice") as alice:
        alice.put_blocks(keys, payloads(keys), "chatbot")
        for _ in range(3):
            alice.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot", take_lease=False))
    with tenants.client("bob") as bob:
        after = bob.stats()
    assert after.classes == before.classes  # bob asked nothing; alice's lookups are hers
    assert after.block_bytes_stored == before.block_bytes_stored == 0
    with tenants.client("ops") as ops:  # the operator's admin sees the whole tier
        whole = ops.stats()
    assert whole.classes["chatbot"]["lookups"] >= 3 and whole.block_bytes_stored > 0


def test_a_lease_is_its_tenants_alone(tenants: Tenants) -> None:
    tokens, keys = prompt(tenants, 106, 2)
    with tenants.client("alice") as alice, tenants.client("bob") as bob:
        alice.put_blocks(keys, payloads(keys), "chatbot")
        lease = alice.query_hit(HitRequest(token_ids=tokens)).lease_id
        assert lease
        assert bob.release_lease(lease) is False
        with pytest.raises(grpc.RpcError) as error:
            bob.get_blocks(keys, lease)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert [r.payload for r in alice.get_blocks(keys, lease)] == payloads(keys)


# --- the shared namespace -------------------------------------------------------------------


def test_the_shared_namespace_is_read_by_tenants_allowed_and_written_by_the_trusted_writer(
    tenants: Tenants,
) -> None:
    # A public system prompt of 2 blocks, then alice's own 2 blocks after it.
    tokens, keys = prompt(tenants, 107, 4)
    system, own = keys[:2], keys[2:]
    with tenants.client("publisher") as publisher:
        assert publisher.put_blocks(system, payloads(system, 7), "chatbot", shared=True).stored == 2
    with tenants.client("alice") as alice:
        alice.put_blocks(own, payloads(own), "chatbot")
        hit = alice.query_hit(HitRequest(token_ids=tokens, traffic_class="chatbot"))
        assert hit.plan.block_hit_tokens == 4 * 128  # the shared run, then her own
        reads = alice.get_blocks(list(hit.hit_block_keys), hit.lease_id)
        assert [r.payload for r in reads] == (payloads(system, 7) + payloads(own))[: len(reads)]
        # Without a lease too (a block missing from her namespace may be a shared one).
        assert [r.payload for r in alice.get_blocks(system)] == payloads(system, 7)
        assert code_of(lambda: alice.put_blocks(system, payloads(system), shared=True)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    with tenants.client("bob") as bob:  # no shared access
        assert (
            bob.query_hit(HitRequest(token_ids=tokens, take_lease=False)).plan.block_hit_tokens == 0
        )
        assert code_of(lambda: bob.put_blocks(system, [b"\x66" * BLOCK] * 2, shared=True)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )


# --- the operator's policy: classes, quotas, rates -----------------------------------------


def test_classes_bytes_and_rate_are_the_operators_not_the_clients(tenants: Tenants) -> None:
    _, keys = prompt(tenants, 108, 5)
    with tenants.client("carol") as carol:
        # Only "agent" (its default): a client cannot pick a longer-lived class.
        assert code_of(lambda: carol.put_blocks(keys[:1], payloads(keys[:1]), "chatbot")) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert carol.put_blocks(keys[:3], payloads(keys[:3])).stored == 3  # into "agent"
        time.sleep(1.1)
        with pytest.raises(grpc.RpcError) as error:
            carol.put_blocks(keys[3:4], payloads(keys[3:4]))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "carol" in (error.value.details() or "")
        assert carol.stats().classes["agent"]["stored_bytes"] >= 3 * BLOCK
        time.sleep(1.1)
        codes = []
        for _ in range(20):  # 5 requests a second, with a one-second burst
            try:
                carol.stats()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as refused:
                codes.append(refused.code())
        assert codes.count(grpc.StatusCode.OK) <= 6
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
