"""Mooncake Store as the same-run peer of ``vllm_ttft.py``: its servers and its engines, all in
a private network namespace.

``MooncakeStore.start`` brings up Mooncake's metadata/master server (``mooncake_master``) and a
standalone pool (``mooncake_client``, 2 GB) that outlives the engine that saves into it, then
``engine`` runs one fresh vLLM engine with vLLM's ``MooncakeStoreConnector`` (TCP, standalone
store) and returns the same answer as ``kvstore.engine.vllm_run`` does for kvstore's engines:
the engine child runs that very module, so both peers are set up and timed by one piece of code.

Mooncake's servers and transfer engines bind 0.0.0.0 whatever address they are given, and
nothing this project runs may listen beyond loopback. So a holder process (``unshare -n
sleep``) owns a fresh network namespace with only ``lo`` up, and master, pool and every
Mooncake engine join it with ``nsenter``: they see loopback and nothing else, and the
namespace's fixed ports cannot collide with another run's. Every process started here is
stopped on exit and, should this process die without cleaning up, killed by the kernel
(``PR_SET_PDEATHSIG``).

Needs root (a network namespace) and, in the vLLM venv,
``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` plus the system's libibverbs
(``apt-get install -y libibverbs1``; its transport library loads it even over TCP).

    python benchmarks/mooncake_peer.py engine SPEC.json   # the engine child (run by ``engine``)
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: How to install the peer, for the message when it is missing.
INSTALL = (
    f"{sys.executable} -m pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
    "(into the vLLM venv) and apt-get install -y libibverbs1 (loaded even over TCP); run as "
    "root (Mooncake runs in a network namespace of its own)"
)

#: The ports inside the namespace (private to it, so fixed ports cannot collide across runs).
MASTER_PORT = 50051
METADATA_PORT = 8080
METRICS_PORT = 9003
POOL_PORT = 50052

#: The engines' store configuration: they own no memory of the pool (standalone-store: the
#: ``mooncake_client`` pool holds the KV), only a 512 MB buffer to transfer through.
STORE_CONFIG = {
    "metadata_server": f"http://127.0.0.1:{METADATA_PORT}/metadata",
    "master_server_address": f"127.0.0.1:{MASTER_PORT}",
    "protocol": "tcp",
    "device_name": "",
    "mode": "standalone-store",
    "global_segment_size": 0,
    "local_buffer_size": "512MB",
}

TRANSFER = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}

#: The namespace's holder sleeps at most this long: a backstop should both the parent and the
#: kernel's parent-death signal miss it.
HOLDER_LIFETIME_S = 4 * 3600

_RESULT = "RESULT "


def missing() -> str | None:
    """Why the peer cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "not root (Mooncake runs in a network namespace of its own)"
    for tool in ("unshare", "nsenter", "ip", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} not found (util-linux / iproute2)"
    for binary in ("mooncake_master", "mooncake_client"):
        if _binary(binary) is None:
            return f"{binary} not found next to {sys.executable} nor on PATH"
    # In a child: loading Mooncake's transfer library is slow, and this process has no use
    # for it. It fails without libibverbs, which is the other half of the install.
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"cannot import mooncake.store ({last})"
    return None


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (no orphan servers)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class MooncakeStore:
    """Mooncake's master and pool, running in a network namespace of their own."""

    scratch: Path
    holder: subprocess.Popen[bytes]
    config: Path
    servers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(cls, scratch: Path, timeout_s: float = 60.0) -> MooncakeStore:
        """Master and pool up and serving; raises ``RuntimeError`` (their logs' ends) if not."""
        scratch.mkdir(parents=True, exist_ok=True)
        config = scratch / "mooncake.json"
        config.write_text(json.dumps(STORE_CONFIG))
        holder = subprocess.Popen(
            ["unshare", "-n", "sleep", str(HOLDER_LIFETIME_S)], preexec_fn=_die_with_parent
        )
        store = cls(scratch, holder, config)
        try:
            store._up(timeout_s)
        except BaseException:
            store.close()
            raise
        return store

    @property
    def prefix(self) -> list[str]:
        """What runs a command inside the namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-n"]

    def _up(self, timeout_s: float) -> None:
        # unshare has made the namespace once its child (sleep) runs in it; until then nsenter
        # would join the parent's namespace, so wait until the two differ.
        deadline = time.monotonic() + timeout_s
        own = os.readlink("/proc/self/ns/net")
        while os.readlink(f"/proc/{self.holder.pid}/ns/net") == own:
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("unshare -n did not make a network namespace")
            time.sleep(0.05)
        subprocess.run([*self.prefix, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        self._serve(
            "master",
            [
                _binary("mooncake_master") or "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={MASTER_PORT}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={METADATA_PORT}",
                f"--metrics_port={METRICS_PORT}",
            ],
            (MASTER_PORT, METADATA_PORT),
            deadline,
        )
        self._serve(
            "pool",
            [
                _binary("mooncake_client") or "mooncake_client",
                "--host=127.0.0.1",
                f"--port={POOL_PORT}",
                "--global_segment_size=2 GB",
                f"--master_server_address=127.0.0.1:{MASTER_PORT}",
                f"--metadata_server=http://127.0.0.1:{METADATA_PORT}/metadata",
                "--protocol=tcp",
            ],
            (POOL_PORT,),
            deadline,
        )

    def _serve(
        self, name: str, command: list[str], ports: tuple[int, ...], deadline: float
    ) -> None:
        """Start ``command`` in the namespace; return once it listens on ``ports``."""
        log = self.scratch / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*self.prefix, *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                # Without it the pool's transfer engine finds no "LAN address" in a namespace
                # that has only loopback, and gives up.
                env=dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1"),
                cwd=self.scratch,
                preexec_fn=_die_with_parent,
            )
        self.servers.append(process)
        while time.monotonic() < deadline and process.poll() is None:
            if all(port in self._listening() for port in ports):
                return
            time.sleep(0.2)
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"Mooncake {name} is not serving on {ports}:\n{tail}")

    def _listening(self) -> set[int]:
        listed = subprocess.run(
            [*self.prefix, "ss", "-Htln"], capture_output=True, text=True, timeout=10
        ).stdout
        return {int(line.split()[3].rsplit(":", 1)[1]) for line in listed.splitlines()}

    def engine(self, spec: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
        """One fresh engine with the Mooncake connector serving ``spec`` (``vllm_run``'s spec,
        without ``connector``) in the namespace; its ``vllm_run`` answer. Raises
        ``RuntimeError`` with the end of its output when it fails."""
        from kvstore.childenv import child_env

        path = self.scratch / f"engine-spec-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(spec))
        env = child_env(
            None,
            VLLM_HOST_IP="127.0.0.1",
            VLLM_LOGGING_LEVEL="WARNING",
            MC_TCP_BIND_ADDRESS="127.0.0.1",
            MOONCAKE_CONFIG_PATH=str(self.config),
        )
        done = subprocess.run(
            [*self.prefix, sys.executable, str(Path(__file__).resolve()), "engine", str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=self.scratch,
            preexec_fn=_die_with_parent,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
        if done.returncode or not lines:
            raise RuntimeError(
                f"Mooncake engine failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        return json.loads(lines[-1][len(_RESULT) :])

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop the pool, the master and the namespace's holder (SIGTERM, then SIGKILL)."""
        for process in [*reversed(self.servers), self.holder]:
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_engine(spec_path: str) -> int:
    """The engine child: ``kvstore.engine.vllm_run`` with vLLM's Mooncake connector."""
    import torch
    import vllm

    class _NoEvent:
        """``torch.cuda.Event`` for CPU torch. Mooncake's worker records one after each
        forward and waits on it before copying the KV out, but on CPU there is no CUDA and
        ``torch.cuda.Event()`` raises. CPU ops run synchronously, so the forward is done when
        the event would be recorded, and waiting on nothing is exact."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def record(self, *args: object) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def wait(self, *args: object) -> None:
            pass

        def query(self) -> bool:
            return True

    if not torch.cuda.is_available():
        torch.cuda.Event = _NoEvent  # type: ignore[misc,assignment]

    engine_class = vllm.LLM

    def with_mooncake(*args: Any, **kwargs: Any) -> Any:
        # vllm_run sets every other option as for kvstore's engines; only the connector is
        # Mooncake's (vllm_run gives none: its spec has no "connector").
        return engine_class(*args, **{**kwargs, "kv_transfer_config": TRANSFER})

    vllm.LLM = with_mooncake  # type: ignore[misc,assignment]
    from kvstore.engine import vllm_run

    return vllm_run.main([spec_path])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "engine":
        print(__doc__)
        return 2
    # Run as a script, this directory is first on sys.path, where benchmarks/grpc.py would
    # shadow the grpc package vLLM imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(ROOT))
    return serve_engine(args[1])


if __name__ == "__main__":
    raise SystemExit(main())
