"""Block sizes belong to a model layout, not to the tier: one tier serves many models, each
request names its layout (``kvstore.tier.records.Layout``), and every layout's blocks and states
live apart, each of exactly its layout's size (docs/rules.md §11). Through ``TenantView`` over the
in-process cluster and over a directory of files, without Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tier_parts import GEOMETRY, InProcessTier

from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys
from kvstore.tenants import TenantDirectory
from kvstore.tier.files import DirectoryTier
from kvstore.tier.protocols import Tier
from kvstore.tier.records import HitRequest, Layout
from kvstore.tier.tenancy import TenantView

BLOCK = GEOMETRY.block_tokens
#: Two models' layouts: a dense one (no state) and a hybrid one, neither the tier's own size.
DENSE = Layout(b"dense-model".ljust(32, b"."), block_bytes=4096)
HYBRID = Layout(b"hybrid-model".ljust(32, b"."), block_bytes=8192, state_bytes=2048)


@pytest.fixture(params=["cluster", "files"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "cluster":
        return InProcessTier(tmp_path, release_batch_s=0).tier
    return DirectoryTier(tmp_path / "files", GEOMETRY)


def view(tier: Tier) -> TenantView:
    return TenantView(tier, TenantDirectory(b"s" * 32).make("alice"))


def tokens(seed: int, blocks: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * BLOCK + 1)


def blob(size: int, fill: int) -> bytes:
    return bytes([fill]) * size


def put_prompt(tenant: TenantView, layout: Layout, ids: np.ndarray, fill: int) -> list[bytes]:
    keys = [bytes(k) for k in block_keys(layout.fingerprint, ids)]
    answer = tenant.put_blocks(keys, [blob(layout.block_bytes, fill)] * len(keys), layout=layout)
    assert answer.committed == len(keys)
    return keys


def test_two_models_of_different_block_sizes_share_one_tier(tier: Tier) -> None:
    tenant = view(tier)
    ids = tokens(1)
    dense = put_prompt(tenant, DENSE, ids, 1)
    hybrid = put_prompt(tenant, HYBRID, ids, 2)
    for layout, keys, fill in ((DENSE, dense, 1), (HYBRID, hybrid, 2)):
        reads = tenant.get_blocks(keys, layout=layout)
        assert [r.payload for r in reads] == [blob(layout.block_bytes, fill)] * len(keys)
        answer = tenant.query_hit(
            HitRequest(token_ids=ids, mode="full-attention", take_lease=False, layout=layout)
        )
        assert answer.plan.hit_tokens == 3 * BLOCK
        assert [bytes(k) for k in answer.hit_block_keys] == keys


def test_the_same_keys_under_another_layout_are_another_block(tier: Tier) -> None:
    tenant = view(tier)
    keys = put_prompt(tenant, DENSE, tokens(2), 7)
    # The same key bytes asked under another layout, or under the tier's own, find nothing:
    # a model never reads a block of another size.
    for other in (HYBRID, None):
        assert [r.payload for r in tenant.get_blocks(keys, layout=other)] == [None] * 3
    same_fingerprint = Layout(DENSE.fingerprint, block_bytes=DENSE.block_bytes * 2)
    assert tenant.get_blocks(keys, layout=same_fingerprint)[0].payload is None


def test_a_payload_of_another_size_than_its_layouts_is_refused(tier: Tier) -> None:
    tenant = view(tier)
    keys = [bytes(k) for k in block_keys(DENSE.fingerprint, tokens(3))]
    with pytest.raises(InvalidArgument) as caught:
        tenant.put_blocks(keys[:1], [blob(HYBRID.block_bytes, 1)], layout=DENSE)
    assert caught.value.argument == "payloads[0]"
    assert f"({DENSE.block_bytes} bytes), got {HYBRID.block_bytes}" in str(caught.value)
    assert tenant.get_blocks(keys[:1], layout=DENSE)[0].payload is None  # nothing stored


def test_states_have_their_layouts_size_and_namespace(tier: Tier) -> None:
    tenant = view(tier)
    keys = put_prompt(tenant, HYBRID, tokens(4), 3)
    tenant.put_swa_state(keys[2], 3 * BLOCK, blob(HYBRID.state_bytes, 9), layout=HYBRID)
    read = tenant.get_swa_state(keys[2], 3 * BLOCK, layout=HYBRID)
    assert read.state == blob(HYBRID.state_bytes, 9)
    # Not under the tier's own layout (nor any other): another namespace.
    assert tenant.get_swa_state(keys[2], 3 * BLOCK).state is None
    with pytest.raises(InvalidArgument, match="exactly 2048 bytes"):
        tenant.put_swa_state(keys[1], 2 * BLOCK, blob(1000, 1), layout=HYBRID)
    with pytest.raises(InvalidArgument, match="keeps no SWA state"):
        tenant.put_swa_state(keys[1], 2 * BLOCK, blob(1000, 1), layout=DENSE)


def test_a_request_that_names_no_layout_is_made_under_the_tiers_own(tier: Tier) -> None:
    tenant = view(tier)
    own = Layout(GEOMETRY.fingerprint(), GEOMETRY.block_bytes, GEOMETRY.state_size_to_disk)
    assert tenant.default_layout == own
    keys = put_prompt(tenant, own, tokens(5), 4)
    assert tenant.get_blocks(keys)[0].payload == blob(GEOMETRY.block_bytes, 4)


@pytest.mark.parametrize(
    ("fields", "argument"),
    [
        ((b"", 10, 0), "layout.fingerprint"),
        ((b"x" * 1025, 10, 0), "layout.fingerprint"),
        ((b"x", 0, 0), "layout.block_bytes"),
        ((b"x", 10, -1), "layout.state_bytes"),
        ((b"x", True, 0), "layout.block_bytes"),
    ],
)
def test_a_malformed_layout_names_its_field(fields: tuple, argument: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        Layout(*fields)
    assert caught.value.argument == argument
