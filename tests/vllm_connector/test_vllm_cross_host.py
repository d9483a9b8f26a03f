"""vLLM with kvstore across hosts: the engine on the testbed's client host, the tier on the others
(``kvstore up --address`` on the head host: the gateway with TLS and a bearer token, storage
nodes on 7 storage hosts), so every block an engine saves or loads crosses the test network.

The same engines and checks as the loopback module: engine A serves the prompts and saves
their blocks, engine B (fresh, vLLM's own prefix cache off) must report the expected whole-block
hits and produce exactly the tokens and logprobs of an engine without the connector. Needs root
(network namespaces) and vLLM; ``.ci/run`` runs it with the vLLM suite.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run: its own venv)")

from vllm_harness import (  # noqa: E402
    BLOCK_BYTES,
    EXPECTED,
    PROMPTS,
    assert_same_outputs,
    hits,
    run_engine,
)

from kvstore.testbed.testbed import CLIENT, Gateway, Testbed, TestbedConfig  # noqa: E402

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
    return testbed.kvstore_up("--block-bytes", str(BLOCK_BYTES), "--fsync", "never")


def test_an_engine_on_its_own_host_takes_the_prefix_over_the_network(
    tiny_model, baseline, testbed: Testbed, gateway: Gateway, tmp_path
) -> None:
    connector = {
        "address": gateway.address,
        "token_file": str(gateway.token_file),
        "tls_root_cert": str(gateway.tls_root_cert),
        "lookup_timeout_s": 20.0,
        "retry_after_s": 30.0,
    }
    on_client = dict(prefix=tuple(testbed.network.exec_prefix(CLIENT)), env=testbed.env())
    a = run_engine(tiny_model, PROMPTS, connector, tmp=tmp_path, **on_client)
    assert_same_outputs(a, baseline, "engine A on the client host")
    assert a["worker"]["saves_failed"] == 0 and a["worker"]["blocks_saved"] >= 10
    b = run_engine(tiny_model, PROMPTS, connector, multiprocessing=True, tmp=tmp_path, **on_client)
    assert hits(b) == EXPECTED
    assert_same_outputs(b, baseline, "engine B on the client host")
    # Nothing of the run spoke to an address outside the test range and loopback.
    assert testbed.foreign_sockets() == {}
