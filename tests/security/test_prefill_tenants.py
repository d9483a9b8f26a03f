"""The prefill rates engines report with QueryHit, end to end: a real gateway on port 0 in front
of a real deployment, tenants from a tokens file (``conftest``). What one engine of a layout
reports is answered to the next engine of that layout and tenant, which has none; another
layout, or another tenant, hears nothing of it (a tenant cannot steer another's engines into
loading or recomputing); a request that says nothing changes nothing; a bad rate is refused."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from conftest import Tenants

from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from kvstore.tier.records import HitRequest, Layout

MODEL = Layout(b"prefill-model".ljust(32, b"."), block_bytes=4096, state_bytes=0)
OTHER = Layout(b"prefill-other".ljust(32, b"."), block_bytes=4096, state_bytes=0)


def ask(tenants: Tenants, who: str, layout: Layout, rate: float = 0.0) -> float:
    """One lookup of ``who``'s engine of ``layout`` reporting ``rate``; the tier's figure."""
    tokens = np.random.default_rng(7).integers(0, 1000, 3 * 128 + 5, dtype=np.uint32)
    keys = block_keys(layout.fingerprint, tokens)
    with tenants.client(who, layout=layout) as client:
        answer = client.query_hit(
            HitRequest(
                block_keys=keys,
                prompt_len=int(tokens.size),
                mode="full-attention",
                take_lease=False,
                prefill_tokens_per_s=rate,
            )
        )
    return answer.prefill_tokens_per_s


def test_a_layouts_prefill_rate_reaches_the_next_engine_of_its_tenant_only(
    tenants: Tenants,
) -> None:
    assert ask(tenants, "alice", MODEL) == 0.0  # nobody reported yet
    for rate in (3000.0, 4000.0, 5000.0):  # engines of alice's fleet, each with its figure
        ask(tenants, "alice", MODEL, rate)
    assert ask(tenants, "alice", MODEL) == 4000.0  # the median; a fresh engine reports 0
    assert ask(tenants, "alice", OTHER) == 0.0  # another model: not its figure
    assert ask(tenants, "bob", MODEL) == 0.0  # another tenant hears nothing of alice's
    ask(tenants, "bob", MODEL, 1.0)  # nor can bob's reports move alice's figure
    assert ask(tenants, "alice", MODEL) == 4000.0
    assert ask(tenants, "bob", MODEL) == 1.0


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_a_bad_rate_is_invalid_argument(tenants: Tenants, rate: float) -> None:
    with grpc.insecure_channel(tenants.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        request = pb.QueryHitRequest(
            block_keys=[bytes(32)], prompt_len=200, prefill_tokens_per_s=rate
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.QueryHit(request, metadata=tenants.auth("alice"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill_tokens_per_s" in (refused.value.details() or "")
    with pytest.raises(InvalidArgument, match="prefill_tokens_per_s"):
        HitRequest(block_keys=[bytes(32)], prompt_len=200, prefill_tokens_per_s=rate)
