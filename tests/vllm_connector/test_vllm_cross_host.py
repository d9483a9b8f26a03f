"""vLLM with kvstore across hosts: the engine on the testbed's client host, the tier on the others
(``kvstore up --address`` on the head host: the gateway with TLS and a bearer token, storage
nodes on 7 storage hosts), so every block an engine saves or loads crosses the test network.

The same engines and checks as the loopback module: engine A serves the prompts and saves
their blocks, engine B (fresh, vLLM's own prefix cache off) must report the expected whole-block
hits and produce exactly the tokens and logprobs of an engine without the connector. Needs root
(network namespaces) and vLLM; ``.ci/run`` runs it with the vLLM suite.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run: its own venv)")

from vllm_harness import (  # noqa: E402
    EXPECTED,
    HYBRID_EXPECTED,
    HYBRID_PROMPTS,
    PROMPTS,
    assert_same_outputs,
    hits,
    run_engine,
)

from kvstore.testbed.testbed import CLIENT, Gateway, Testbed, TestbedConfig  # noqa: E402

#: Asks the tier, from a host of the testbed, which machine holds the window state of each
#: prompt and which machine a put from an address is kept on (argv: a JSON spec).
WHERE_STATES_ARE = """
import json, sys
from kvstore.api.client import KVStoreClient
from kvstore.keys import block_keys
from kvstore.tier.records import HitRequest, Layout
spec = json.loads(sys.argv[1])
layout = Layout(bytes.fromhex(spec["fingerprint"]), *spec["sizes"])
chain = bytes.fromhex(spec["key_fingerprint"])
with KVStoreClient(spec["address"], token=spec["token"], tls_root_cert=spec["cert"],
                   layout=layout) as client:
    owners = []
    for prompt in spec["prompts"]:
        full = (len(prompt) - 1) // 128
        if not full:
            continue
        keys = block_keys(chain, prompt[: full * 128])
        answer = client.query_hit(HitRequest(block_keys=keys, prompt_len=len(prompt),
                                             mode="exact-window", take_lease=False))
        owners.append(answer.swa_owner)
    machines = client.stats().extra["machines_by_address"]
print(json.dumps({"owners": owners, "machines": machines}))
"""

pytestmark = [pytest.mark.vllm, pytest.mark.hosts, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    bed = Testbed.up(TestbedConfig())
    try:
        yield bed
    finally:
        left = bed.down()
    assert left == [], f"the testbed left {left}"


@pytest.fixture(scope="module")
def gateway(testbed: Testbed) -> Gateway:
    return testbed.kvstore_up("--fsync", "never")


def connector_config(gateway: Gateway) -> dict:
    # The tiny test models compute a block in milliseconds, faster than a fresh engine's
    # probe reads one: it would (rightly) recompute its first hit. These tests are about the
    # hits and the bytes loaded; test_vllm_slow_tier.py is about load or recompute.
    return {
        "load_only_if_faster": False,
        "address": gateway.address,
        "token_file": str(gateway.token_file),
        "tls_root_cert": str(gateway.tls_root_cert),
        "lookup_timeout_s": 20.0,
        "retry_after_s": 30.0,
    }


def test_an_engine_on_its_own_host_takes_the_prefix_over_the_network(
    tiny_model, baseline, testbed: Testbed, gateway: Gateway, tmp_path
) -> None:
    connector = connector_config(gateway)
    on_client = dict(prefix=tuple(testbed.network.exec_prefix(CLIENT)), env=testbed.env())
    a = run_engine(tiny_model, PROMPTS, connector, tmp=tmp_path, **on_client)
    assert_same_outputs(a, baseline, "engine A on the client host")
    assert a["worker"]["saves_failed"] == 0 and a["worker"]["blocks_saved"] >= 10
    b = run_engine(tiny_model, PROMPTS, connector, multiprocessing=True, tmp=tmp_path, **on_client)
    assert hits(b) == EXPECTED
    assert_same_outputs(b, baseline, "engine B on the client host")
    # Nothing of the run spoke to an address outside the test range and loopback.
    assert testbed.foreign_sockets() == {}


def test_a_hybrid_models_window_states_stay_on_the_machine_that_made_them(
    tiny_gemma, hybrid_oracle, testbed: Testbed, gateway: Gateway, tmp_path
) -> None:
    """Engine A on storage host s1 saves a hybrid model's window states: they are kept in s1's
    memory (its SWA store), found through the directory; engine B on the client host takes the
    full-attention blocks from the block tier and the window from s1, across the network."""
    connector = connector_config(gateway)

    def on(host: str) -> dict:
        return dict(prefix=tuple(testbed.network.exec_prefix(host)), env=testbed.env())

    a = run_engine(tiny_gemma, HYBRID_PROMPTS, connector, tmp=tmp_path, **on("s1"))
    assert_same_outputs(a, hybrid_oracle["cold"], "engine A on s1")
    b = run_engine(tiny_gemma, HYBRID_PROMPTS, connector, tmp=tmp_path, **on(CLIENT))
    assert hits(b) == HYBRID_EXPECTED
    assert_same_outputs(b, hybrid_oracle["cold"], "engine B on the client host")
    assert b["worker"]["states_loaded"] == 4

    spec = {
        "address": gateway.address,
        "token": gateway.token_file.read_text().strip(),
        "cert": str(gateway.tls_root_cert),
        "fingerprint": a["fingerprint"],
        "key_fingerprint": a["key_fingerprint"],
        "sizes": [a["layout"]["block_bytes"], a["layout"]["state_bytes"]],
        "prompts": HYBRID_PROMPTS,
    }
    asked = testbed.run(CLIENT, [sys.executable, "-c", WHERE_STATES_ARE, json.dumps(spec)])
    assert asked.returncode == 0, asked.stderr[-3000:]
    where = json.loads(asked.stdout.strip().splitlines()[-1])
    s1 = where["machines"][testbed.network.address("s1")]
    assert where["owners"] == [s1] * 4, where
    assert testbed.foreign_sockets() == {}
