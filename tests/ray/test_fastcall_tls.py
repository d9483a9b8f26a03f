"""fastcall TLS switched on the way an operator does it: the KVSTORE_FASTCALL_TLS_* variables in
the deploying process only (the session cluster's raylets were started without them), so the
actors serve TLS only if deploy handed the setting on. Loopback only."""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from certs import self_signed

from kvstore.blockstore.calls import meta_target, node_target
from kvstore.blockstore.config import BlockStoreConfig, StorageNodeConfig
from kvstore.fastcall.client import connect
from kvstore.fastcall.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_SERVER_NAME_ENV
from kvstore.runtime.cluster import LocalCluster
from kvstore.runtime.deploy import deploy_blockstore


def test_lookups_and_shard_bytes_go_over_tls_when_the_deployer_sets_it(
    ray_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv(TLS_CERT_ENV, cert)
    monkeypatch.setenv(TLS_KEY_ENV, key)
    monkeypatch.setenv(TLS_CA_ENV, cert)  # self-signed: its own CA
    monkeypatch.setenv(TLS_SERVER_NAME_ENV, "localhost")
    config = BlockStoreConfig(
        data_shards=4,
        parity_shards=2,
        storage_nodes=6,
        meta_shards=1,
        node=StorageNodeConfig(fsync="never"),
        data_root=str(tmp_path / "blocks"),
        deployment=f"tls{os.getpid()}",
    )
    handles = deploy_blockstore(config, ray_cluster, start_repair=False)
    try:
        host, port, authkey = ray.get(handles.metas[0].fast_endpoint.remote(), timeout=30)
        assert host == "127.0.0.1"
        with pytest.raises(TimeoutError):  # plaintext: the challenge never comes in clear
            connect((host, port, authkey), timeout_s=0.5)

        client = handles.client()
        fast = client._fanout._fast  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while True:  # the first lookups go through Ray while the endpoint is asked for
            assert client.lookup([os.urandom(32)]).hit_blocks == 0
            channel = fast._channels.get(meta_target(0))
            if channel is not None and channel._free:
                break
            assert time.monotonic() < deadline, "no lookup went over the direct socket"
            time.sleep(0.05)
        assert isinstance(channel._free[0]._sock, ssl.SSLSocket)
        assert channel._free[0]._sock.version() in ("TLSv1.2", "TLSv1.3")

        payload = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
        key = os.urandom(32)
        assert client.put_blocks([key], [payload]).stored == [key]
        got = client.get_blocks([key])[0]
        assert got is not None and got.tobytes() == payload.tobytes()
        nodes = [fast._channels.get(node_target(i)) for i in range(config.storage_nodes)]
        used = [conn for channel in nodes if channel is not None for conn in channel._free]
        assert len(used) >= config.storage_nodes  # every node took its shard over a socket
        assert all(isinstance(conn._sock, ssl.SSLSocket) for conn in used)
    finally:
        handles.shutdown()
