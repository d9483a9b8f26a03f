"""The vLLM-shaped connector, end to end: a toy engine prefills and saves, another loads.

Two (or three) engines share one real file tier; each has its own fetcher process, staging area,
swap-in thread and pools. The toy engine "computes" recognisable bytes: a block row is a pure
function of the block's key and layer, a ring slot holds a pure function of its token and layer,
so every engine can check what it loaded without trusting the code under test.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.geometry import GeometryConfig
from kvstore.gpu.connector import ConnectorConfig, EngineRequest, KVConnector
from kvstore.gpu.pools import DevicePools
from kvstore.keys import block_keys

PROMPT = np.arange(5 * 128 + 50) * 31 % 50_000  # 690 tokens: prefill stores its state at 640


def block_row(key: bytes, layer: int, nbytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key + bytes([layer]), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def token_bytes(layer: int, tokens: np.ndarray) -> np.ndarray:
    marks = (np.asarray(tokens, dtype=np.int64) * 7 + layer) % 256
    return np.broadcast_to(marks[:, None, None], (len(marks), 1, 528)).astype(np.uint8)


class ToyEngine:
    """Just enough of an engine to drive the connector: ledgers, a forward pass, decode steps."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.pools = connector.pools
        self.geometry = connector.pools.geometry
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}

    # scheduler -----------------------------------------------------------------------------

    def admit(self, request: EngineRequest) -> int:
        external, load_async = self.connector.get_num_new_matched_tokens(request, 0)
        assert load_async is False
        rid = request.request_id
        blocks = -(-request.num_tokens // 128)
        self.pools.blocks.allocate(rid, blocks)
        self.tables[rid] = self.pools.blocks.block_table(rid)
        self.slots[rid] = self.pools.slots.allocate(rid)
        self.connector.update_state_after_alloc(
            request, self.tables[rid], self.slots[rid], external
        )
        return external

    # worker --------------------------------------------------------------------------------

    def forward(self, work: list[tuple[EngineRequest, int, int]], check_loaded=None) -> None:
        """One step computing tokens [start, end) of each request, with layer-wise load/save."""
        connector = self.connector
        connector.bind_connector_metadata(connector.build_connector_meta())
        connector.start_load_kv()
        for layer in range(self.geometry.num_layers):
            connector.wait_for_layer_load(layer)
            if check_loaded is not None:
                check_loaded(layer)
            for request, start, end in work:
                self.compute(request, layer, start, end)
            connector.save_kv_layer(layer)
        connector.wait_for_save()
        connector.clear_connector_metadata()

    def compute(self, request: EngineRequest, layer: int, start: int, end: int) -> None:
        rid, pools = request.request_id, self.pools
        slot = self.slots[rid]
        tokens = np.arange(start, end)
        positions = pools.ring_slots(slot, tokens[-pools.ring :])
        pools.swa[layer][slot][positions] = torch.from_numpy(
            token_bytes(layer, tokens[-pools.ring :])
        )
        if layer not in pools.block_kv:
            return
        keys = block_keys(self.geometry.fingerprint(), request.token_ids[:end])
        for index in range(start // 128, end // 128):
            row = block_row(keys[index], layer, pools.kv.layers[layer].block_nbytes)
            pools.block_kv[layer][self.tables[rid][index]] = torch.from_numpy(row)

    def finish(self, request: EngineRequest, timeout: float = 60.0) -> None:
        rid = request.request_id
        slot = self.slots[rid]
        pending = self.connector.request_finished(request, self.tables[rid], slot)
        deadline = time.monotonic() + timeout
        while pending:
            sending, _ = self.connector.get_finished({rid})
            if rid in sending:
                break
            assert time.monotonic() < deadline, "save never finished"
            time.sleep(0.01)
        self.pools.blocks.free(rid)
        self.pools.slots.free(rid)


def make_connector(tier, geometry: GeometryConfig, num_blocks: int = 16) -> KVConnector:
    pools = DevicePools(geometry, num_blocks=num_blocks)
    return KVConnector(
        pools,
        reader_factory=tier.factory(),
        writer=tier,
        hit_source=tier,
        config=ConnectorConfig(staging_bytes=32 << 20, layer_timeout_s=60),
    )


@pytest.fixture
def prefill_engine(tier) -> Iterator[ToyEngine]:
    pe = GeometryConfig(
        role="prefill", extra_state=True, truncation="mask", yoco_keep=134, num_state_seqs=2
    )
    connector = make_connector(tier, pe)
    yield ToyEngine(connector)
    connector.shutdown()


@pytest.fixture
def decode_engine(tier) -> Iterator[ToyEngine]:
    connector = make_connector(tier, GeometryConfig(num_state_seqs=2))
    yield ToyEngine(connector)
    connector.shutdown()


def prefill_and_save(engine: ToyEngine, tokens: np.ndarray, rid: str = "a") -> EngineRequest:
    request = EngineRequest(rid, tuple(int(t) for t in tokens))
    assert engine.admit(request) == 0  # nothing cached yet
    engine.connector.schedule_prefill_save(request, engine.tables[rid], engine.slots[rid])
    engine.forward([(request, 0, request.num_tokens)])
    engine.finish(request)
    results = [r for r in engine.connector.save_results if r.request_id == rid]
    assert results and all(r.error is None for r in results)
    assert any(r.state_saved for r in results)
    return request


def expect_loaded(engine: ToyEngine, request: EngineRequest, hit: int, layer: int) -> bool:
    """Whether ``layer`` of ``request``'s first ``hit`` tokens holds the toy engine's bytes."""
    pools, rid = engine.pools, request.request_id
    keys = block_keys(engine.geometry.fingerprint(), request.token_ids)
    if layer in pools.block_kv:
        for index in range(hit // 128):
            row = pools.block_kv[layer][engine.tables[rid][index]].numpy()
            if not np.array_equal(row, block_row(keys[index], layer, row.size)):
                return False
    if layer in pools.snapshot:  # a stored SWA layer: the window anchored at the hit
        window = pools.gather_window(layer, engine.slots[rid], hit, written=hit).numpy()
        return bool(np.array_equal(window, token_bytes(layer, np.arange(hit - 134, hit))))
    return True


def test_prefill_save_then_decode_engine_loads_the_same_bytes(
    tier, prefill_engine, decode_engine
) -> None:
    prefill_and_save(prefill_engine, PROMPT)
    longer = EngineRequest("b", tuple(int(t) for t in PROMPT) + tuple(range(200)))
    assert decode_engine.admit(longer) == 640  # cap 890 − 134 = 756 → 5 blocks, state at 640
    seen: dict[int, bool] = {}
    # Each layer is checked right after its wait: usable then, whatever later layers are doing.
    decode_engine.forward(
        [(longer, 640, longer.num_tokens)],
        check_loaded=lambda layer: seen.__setitem__(
            layer, expect_loaded(decode_engine, longer, 640, layer)
        ),
    )
    assert all(seen.values()) and len(seen) == decode_engine.geometry.num_layers
    assert decode_engine.connector.get_block_ids_with_load_errors() == set()
    _, received = decode_engine.connector.get_finished(set())
    assert received == {"b"}
    table = decode_engine.tables["b"]
    assert all(decode_engine.pools.is_loaded(b) for b in table[:5])
    assert not any(decode_engine.pools.is_loaded(b) for b in table[5:])


def test_blocks_that_fail_to_load_are_reported_for_recompute(
    tier, prefill_engine, decode_engine
) -> None:
    prefill_and_save(prefill_engine, PROMPT)
    request = EngineRequest("b", tuple(int(t) for t in PROMPT) + tuple(range(200)))
    # The plan is made while everything is there; then a block and the state vanish.
    assert decode_engine.connector.get_num_new_matched_tokens(request, 0) == (640, False)
    keys = block_keys(decode_engine.geometry.fingerprint(), request.token_ids)
    tier.block_path(keys[2]).unlink()
    tier.state_path(keys[4], 640).unlink()
    decode_engine.admit(request)
    decode_engine.forward([(request, 640, request.num_tokens)])
    table = decode_engine.tables["b"]
    # Block 2 is a miss; the state miss backs off one block (SPEC §5): block 4 is recomputed.
    assert decode_engine.connector.get_block_ids_with_load_errors() == {table[2], table[4]}
    assert decode_engine.connector.get_block_ids_with_load_errors() == set()  # drained
    assert decode_engine.connector.get_requests_with_state_errors() == {"b"}
    assert not decode_engine.pools.is_loaded(table[2])
    assert decode_engine.pools.state_loaded_at(decode_engine.slots["b"]) is None


def test_decode_snapshot_is_stored_at_request_end_and_loads_again(
    tier, prefill_engine, decode_engine
) -> None:
    prefill_and_save(prefill_engine, PROMPT)
    engine, connector = decode_engine, decode_engine.connector
    tokens = [int(t) for t in PROMPT] + list(range(200))  # 890 tokens
    request = EngineRequest("b", tuple(tokens))
    engine.admit(request)
    # This engine prefills the rest itself and saves block 5; its state at 768 is out of its
    # 134-slot ring by then, so that part is skipped (and says why).
    connector.schedule_prefill_save(request, engine.tables["b"], engine.slots["b"])
    engine.forward([(request, 640, 890)])
    # Decode with speculative steps of 3, 2 and 4 tokens: 890 → 893 → 895 → 899, so the step
    # that crosses the 896 boundary lands 3 tokens past it.
    length = 890
    for accepted in (3, 2, 4):
        new_tokens = [10_000 + length + i for i in range(accepted)]
        tokens += new_tokens
        request = EngineRequest("b", tuple(tokens))
        grown = -(-len(tokens) // 128) - len(engine.tables["b"])
        if grown > 0:
            engine.pools.blocks.allocate("b", grown)
            engine.tables["b"] = engine.pools.blocks.block_table("b")
        if len(tokens) // 128 > length // 128:
            connector.schedule_decode_snapshot(request, engine.tables["b"], engine.slots["b"])
        engine.forward([(request, length, len(tokens))])
        length = len(tokens)
    assert length == 899 and engine.pools.snapshot_position(engine.slots["b"]) == 899
    engine.finish(request)
    (prefill_save,) = [r for r in connector.save_results if r.state_error]
    assert "not in a 134-slot ring" in prefill_save.state_error
    keys = block_keys(engine.geometry.fingerprint(), request.token_ids)
    assert prefill_save.saved_keys == (keys[5],)
    assert tier.get_blocks([keys[6]])[0].payload is not None  # the block completed in decode
    assert tier.get_swa_state(keys[6], 896).state is not None  # stored at the boundary below

    # A third engine asking for the conversation so far resumes exactly at 896.
    third = make_connector(tier, GeometryConfig(num_state_seqs=2))
    try:
        other = ToyEngine(third)
        follow_up = EngineRequest("c", tuple(tokens) + tuple(range(300)))
        assert other.admit(follow_up) == 896
        seen: dict[int, bool] = {}

        def check(layer: int) -> None:  # right after the layer's wait, before its compute
            pools, ok = other.pools, True
            if layer in pools.block_kv:
                for index in range(7):
                    row = pools.block_kv[layer][other.tables["c"][index]].numpy()
                    ok &= np.array_equal(row, block_row(keys[index], layer, row.size))
            if layer in pools.snapshot:
                window = pools.gather_window(layer, other.slots["c"], 896, written=896).numpy()
                # [768, 896) is the window; 3 spare slots hold the overrun 896..898 (SPEC §6).
                ok &= np.array_equal(window[6:], token_bytes(layer, np.arange(768, 896)))
                ok &= np.array_equal(window[:3], token_bytes(layer, np.arange(896, 899)))
            seen[layer] = bool(ok)

        other.forward([(follow_up, 896, follow_up.num_tokens)], check_loaded=check)
        assert all(seen.values()) and len(seen) == other.geometry.num_layers
        assert third.get_block_ids_with_load_errors() == set()
    finally:
        third.shutdown()


def test_hit_query_is_made_once_per_request(tier, decode_engine) -> None:
    request = EngineRequest("z", tuple(range(300)))
    connector = decode_engine.connector
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    tier.put_blocks(block_keys(decode_engine.geometry.fingerprint(), range(300))[:1], [b"x"])
    # Side-effect free and stable: the cached answer is reused within the request's life.
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)


def test_connector_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="mode"):
        ConnectorConfig(mode="fast")
    with pytest.raises(ConfigError, match="staging_bytes"):
        ConnectorConfig(staging_bytes=10)
    config = ConnectorConfig.from_env({"KVSTORE_GPU_MODE": "bounded-replay"})
    assert config.mode == "bounded-replay"
    with pytest.raises(ConfigError, match="KVSTORE_GPU_STAGING_BYTES"):
        ConnectorConfig.from_env({"KVSTORE_GPU_STAGING_BYTES": "lots"})
    with pytest.raises(InvalidArgument, match="request_id"):
        EngineRequest("", ())


def test_a_request_dropped_before_its_step_gives_its_staging_back(
    tier, prefill_engine, decode_engine
) -> None:
    prefill_and_save(prefill_engine, PROMPT)
    connector = decode_engine.connector
    request = EngineRequest("gone", tuple(int(t) for t in PROMPT) + tuple(range(200)))
    assert decode_engine.admit(request) == 640
    assert connector.area.used_regions == 1  # the fetch started at allocation time
    assert connector.request_finished(request, decode_engine.tables["gone"], None) is False
    assert connector.build_connector_meta().loads == []
    deadline = time.monotonic() + 60
    while connector.area.used_regions and time.monotonic() < deadline:
        time.sleep(0.01)  # handed back once the fetcher is done writing into it
    assert connector.area.free_bytes == connector.area.capacity
