"""Ray's token authentication guards every cluster kvstore starts or joins.

The finding this closes: with token auth off, any local user who reached the GCS port ran a task
as the service user and read the keys kvstore hands out through Ray (the fastcall socket keys).
Here a driver without the cluster's token tries exactly that against the session cluster, and
``kvstore up --address`` joins a separate token-auth cluster (``ray start``) with the right token
and refuses a missing or wrong token, or a cluster that takes callers without one, in one line.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from ray.core.generated import (
    core_worker_pb2,
    core_worker_pb2_grpc,
    gcs_service_pb2,
    gcs_service_pb2_grpc,
    node_manager_pb2,
    node_manager_pb2_grpc,
)

from kvstore.api.client import KVStoreClient
from kvstore.runtime.cluster import LocalCluster, pin_to_machine
from kvstore.runtime.swa_actors import SWAEntrypointActor
from kvstore.tier.records import HitRequest

# What a driver without the cluster's token tries: join, run a task, read an actor's key.
_INTRUDER = """
import os, sys, ray
ray.init(address=sys.argv[1], namespace="kvstore", log_to_driver=False)
uid = ray.get(ray.remote(lambda: os.getuid()).remote(), timeout=60)
print("ran a task as uid", uid, flush=True)
actor = ray.get_actor(sys.argv[2])
print("key", ray.get(actor.fast_endpoint.remote(), timeout=60)[2].hex(), flush=True)
"""


def _without_ray_credentials(home: Path) -> dict[str, str]:
    """This process's environment minus every Ray credential, with a HOME holding none either
    (so neither ~/.ray/auth_token nor kvstore's own token file can be found)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("RAY_AUTH") and name != "RAY_ADDRESS"
    }
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    return env


def _token_metadata() -> tuple[tuple[str, str], ...]:
    # The header this process's Ray sends (empty when Ray runs without token auth).
    from ray._raylet import AuthenticationTokenLoader

    return tuple(AuthenticationTokenLoader.instance().get_token_for_http_header().items())


#: One cheap call to each kind of Ray server: (stub, method, request).
_GCS_CALL = (
    gcs_service_pb2_grpc.NodeInfoGcsServiceStub,
    "GetClusterId",
    gcs_service_pb2.GetClusterIdRequest(),
)
_RAYLET_CALL = (
    node_manager_pb2_grpc.NodeManagerServiceStub,
    "GetNodeStats",
    node_manager_pb2.GetNodeStatsRequest(),
)
_WORKER_CALL = (
    core_worker_pb2_grpc.CoreWorkerServiceStub,
    "NumPendingTasks",
    core_worker_pb2.NumPendingTasksRequest(),
)


def _status(target: str, call: tuple[Any, str, Any], metadata: tuple[tuple[str, str], ...]) -> Any:
    """The status code ``call`` to the Ray server at ``target`` gets (OK when it answers)."""
    stub, method, request = call
    with grpc.insecure_channel(target) as channel:
        try:
            getattr(stub(channel), method)(request, metadata=metadata, timeout=15)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.fixture
def keyed_actor(ray_cluster: LocalCluster) -> Iterator[tuple[str, Any, bytes]]:
    """A named actor with a fastcall key (an SWA entrypoint, as kvstore deploys them)."""
    name = f"auth-probe-{secrets.token_hex(4)}"
    actor = SWAEntrypointActor.options(name=name, **pin_to_machine(ray_cluster.machines[0])).remote(
        "probe", 5.0
    )
    key = ray.get(actor.fast_endpoint.remote(), timeout=60)[2]
    try:
        yield name, actor, key
    finally:
        ray.kill(actor)


def test_every_ray_listener_refuses_a_call_without_the_token(
    ray_cluster: LocalCluster, keyed_actor: tuple[str, Any, bytes]
) -> None:
    """The GCS, each machine's raylet and the worker of an actor holding a key all answer the
    cluster's token and refuse a call without it (or with a guessed one)."""
    _, actor, _ = keyed_actor
    worker = ray._private.state.actors(actor._actor_id.hex())["Address"]
    targets = [
        (ray_cluster.address, _GCS_CALL),
        (f"{worker['IPAddress']}:{worker['Port']}", _WORKER_CALL),
    ] + [
        (f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", _RAYLET_CALL)
        for node in ray.nodes()
        if node["Alive"]
    ]
    guessed = (("authorization", f"Bearer {secrets.token_hex(32)}"),)
    for target, call in targets:
        assert target.startswith("127.0.0.1:"), target
        assert _status(target, call, _token_metadata()) == grpc.StatusCode.OK, target
        assert _status(target, call, ()) == grpc.StatusCode.UNAUTHENTICATED, target
        assert _status(target, call, guessed) == grpc.StatusCode.UNAUTHENTICATED, target


def test_a_driver_without_the_token_runs_no_task_and_reads_no_key(
    ray_cluster: LocalCluster, keyed_actor: tuple[str, Any, bytes], tmp_path: Path
) -> None:
    name, _, key = keyed_actor
    argv = [sys.executable, "-c", _INTRUDER, ray_cluster.address, name]
    # The same script with this process's credentials reads the key: the script works, and
    # only the token stands between it and the key.
    trusted = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert f"key {key.hex()}" in trusted.stdout, trusted.stderr[-2000:]
    stranger = _without_ray_credentials(tmp_path / "home")
    # Ray's own retry budget for reaching the GCS (20 s by default), shortened: the intruder
    # chooses its own environment, and a refused driver need not take 20 s to show it.
    stranger["RAY_gcs_server_port_wait_time_s"] = "2"
    guesser = {**stranger, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for env in (stranger, guesser):
        intruder = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert intruder.returncode != 0
        assert "ran a task" not in intruder.stdout
        assert key.hex() not in intruder.stdout + intruder.stderr


# --- kvstore up --address against a separate Ray cluster -------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lines(process: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's output, line by line, read by a thread (None once it closes)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str | None], needle: str, timeout_s: float) -> str:
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no {needle!r} within {timeout_s} s: {''.join(seen)}") from None
        if line is None:
            raise AssertionError(f"exited before {needle!r}: {''.join(seen)}")
        seen.append(line)
        if needle in line:
            return line


def _stop(process: subprocess.Popen[str], sig: int) -> None:
    process.send_signal(sig)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: only what it started
        process.wait(timeout=30)


@contextmanager
def _ray_head(env: dict[str, str]) -> Iterator[str]:
    """``ray start --head`` on 127.0.0.1 in the foreground (``--block``: SIGTERM stops every
    process it started; ``ray stop`` would stop every Ray on the machine); its GCS address."""
    port = _free_port()
    # Short: Ray's unix socket paths under it must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")
    process = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
        + ["--node-ip-address=127.0.0.1", f"--port={port}", f"--temp-dir={temp_dir}"]
        + ["--include-dashboard=false", "--disable-usage-stats", "--num-cpus=2"]
        + ["--object-store-memory=300000000"]
        # Ports Ray would otherwise take fixed (10001, 8265, 52365, 44217): free ones, so this
        # head never collides with another Ray on the machine.
        + [f"--ray-client-server-port={_free_port()}", f"--dashboard-port={_free_port()}"]
        + [f"--dashboard-agent-listen-port={_free_port()}"],
        env={**env, "AUTOSCALER_METRIC_PORT": str(_free_port())},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(_lines(process), "Ray runtime started", 120)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(process, signal.SIGTERM)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Ray cluster with token auth that kvstore did not start; its address and token file."""
    root = tmp_path_factory.mktemp("token-cluster")
    token = root / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {
        **_without_ray_credentials(root / "home"),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
    }
    with _ray_head(env) as address:
        yield address, token


def _kvstore_up(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """``kvstore up ARGS`` in its own session, output and errors on one pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "up", "--port", "0", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _join(address: str, data_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return _kvstore_up(
        env, "--address", address, "--no-gc", "--fsync", "never", "--data-dir", str(data_dir)
    )


def _one_line_error(process: subprocess.Popen[str]) -> str:
    """What ``process`` (a ``kvstore up`` that must fail, not serve or hang) printed: one line."""
    try:
        output, _ = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        _stop(process, signal.SIGINT)
        raise AssertionError("kvstore up is still running after 90 s") from None
    assert process.returncode == 2, output
    lines = output.splitlines()
    assert len(lines) == 1, output  # nothing deployed, nothing started, no traceback
    return lines[0]


def _refused(address: str, data_dir: Path, env: dict[str, str]) -> str:
    line = _one_line_error(_join(address, data_dir, env))
    assert line.startswith("kvstore up: error: ray token: "), line
    return line


def test_kvstore_up_joins_a_token_cluster_with_its_token(
    token_cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, token = token_cluster
    env = {**_without_ray_credentials(tmp_path / "home"), "RAY_AUTH_TOKEN_PATH": str(token)}
    process = _join(address, tmp_path / "data", env)
    try:
        line = _wait_for(_lines(process), "serving kvstore.v1.KVStore on ", 240)
        gateway = line.split(" on ", 1)[1].split()[0]
        assert gateway.startswith("127.0.0.1:")
        with KVStoreClient(gateway) as client:
            assert client.serving()
            answer = client.query_hit(HitRequest(token_ids=list(range(1024)), take_lease=False))
            assert answer.plan.prompt_len == 1024 and answer.plan.hit_tokens == 0
    finally:
        _stop(process, signal.SIGINT)
    assert process.returncode == 0


def test_kvstore_up_without_the_token_or_with_a_wrong_one_fails_in_one_line(
    token_cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, _ = token_cluster
    none = _refused(address, tmp_path / "data", _without_ray_credentials(tmp_path / "a"))
    assert f"none to join {address}" in none
    wrong = {**_without_ray_credentials(tmp_path / "b"), "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    assert "refused the token from RAY_AUTH_TOKEN" in _refused(address, tmp_path / "data", wrong)


def test_kvstore_up_refuses_a_cluster_that_takes_callers_without_a_token(
    tmp_path: Path,
) -> None:
    # `ray start` with no token anywhere starts a cluster without auth (Ray 2.60 turns it on by
    # default only for ray.init()): what an operator gets by not asking for auth.
    with _ray_head(_without_ray_credentials(tmp_path / "head-home")) as address:
        token = tmp_path / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {**_without_ray_credentials(tmp_path / "home"), "RAY_AUTH_TOKEN_PATH": str(token)}
        assert "accepts callers without a token" in _refused(address, tmp_path / "data", env)


# --- what kvstore refuses before any Ray process starts ---------------------------------------


def _up_fails_at_once(env: dict[str, str], data_dir: Path) -> str:
    return _one_line_error(_kvstore_up(env, "--data-dir", str(data_dir)))


def test_kvstore_up_refuses_to_start_ray_with_auth_turned_off(tmp_path: Path) -> None:
    env = {**_without_ray_credentials(tmp_path / "home"), "RAY_AUTH_MODE": "disabled"}
    line = _up_fails_at_once(env, tmp_path / "data")
    assert line.startswith("kvstore up: error: RAY_AUTH_MODE: is 'disabled'"), line


def test_kvstore_up_refuses_a_token_file_others_can_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    token = home / ".kvstore" / "ray_auth_token"
    token.parent.mkdir(parents=True)
    token.write_text(secrets.token_hex(32))
    token.chmod(0o644)
    line = _up_fails_at_once(_without_ray_credentials(home), tmp_path / "data")
    assert line.startswith(f"kvstore up: error: {token}: "), line
    assert "chmod 600" in line
