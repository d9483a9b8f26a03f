"""``kvstore up`` as a child process: for tests, benchmarks and testbeds that need a real tier
in its own process (its embedded Ray cluster, its gRPC gateway) while they drive engines.

    with TierProcess.start(tmp / "data", "--block-bytes", "131072") as tier:
        client = KVStoreClient(tier.address)

The address is read from what ``kvstore up`` prints (it binds port 0 unless told otherwise);
``stop`` sends Ctrl-C (SIGINT), as a person would, and kills only if that is not heeded.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvstore.childenv import ROOT, child_env

_SERVING = re.compile(r"serving kvstore\.v1\.KVStore on (\S+:\d+)")


@dataclass
class TierProcess:
    process: subprocess.Popen[bytes]
    address: str
    data_dir: Path
    log: Path

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        timeout_s: float = 240.0,
        prefix: Sequence[str] = (),
    ) -> TierProcess:
        """Start ``kvstore up --port 0 --data-dir DATA_DIR ARGS...``; returns once it serves
        (raises ``RuntimeError`` with the end of its output when it does not). ``prefix`` goes
        before the command (``ip netns exec HOST``: a testbed host)."""
        data_dir = Path(data_dir)
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        log = log or data_dir / "kvstore-up.log"
        command = [*prefix, sys.executable, "-m", "kvstore.cli", "up", "--port", "0"]
        command += ["--data-dir", str(data_dir), *args]
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=child_env(env), cwd=ROOT
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = _SERVING.search(log.read_text(errors="replace"))
            if found:
                return cls(process, found.group(1), data_dir, log)
            if process.poll() is not None:
                break
            time.sleep(0.25)
        process.kill()
        process.wait(30)
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"kvstore up did not start within {timeout_s:.0f} s:\n{tail}")

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)

    def __enter__(self) -> TierProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
