"""Helpers of the vLLM connector tests: a real ``kvstore up``, a fresh engine process.

- ``start_tier``: a real ``kvstore up`` in its own process (embedded local Ray cluster, gRPC on
  port 0, 127.0.0.1); no size flag: each engine's connector names its model's layout.
- ``run_engine``: one vLLM engine in a fresh process (``python -m
  kvstore.engine.vllm_run``), its results as JSON.

These need vLLM (``.ci/run`` installs it in its own venv and runs ``-m vllm`` there); without
it the test modules skip themselves.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.blockstore.segments import find_shard_records
from kvstore.childenv import child_env as kvstore_child_env
from kvstore.engine.tiny_gemma import TinyGemma3
from kvstore.engine.tiny_model import TinyLlama
from kvstore.engine.vllm_run import fresh_engine
from kvstore.keys import block_keys
from kvstore.runtime.upprocess import TierProcess
from kvstore.tenants import DEFAULT_TENANT, namespaced_key, salts
from kvstore.tier.records import Layout

SHAPE = TinyLlama()
BLOCK_BYTES = SHAPE.block_bytes()
#: Every engine and server of these tests stays on loopback.
LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "WARNING"}


def child_env() -> dict[str, str]:
    """The environment of every child of these tests: kvstore importable, vLLM on loopback."""
    return kvstore_child_env(**LOOPBACK_ENV)


def start_tier(data_dir: Path, log: Path) -> TierProcess:
    """A real ``kvstore up`` taking the tiny model's blocks (shards are not fsynced: tests).
    The storage nodes run no background scrub: the corruption test damages shards behind the
    tier's back and needs the engine, not a scrub pass that may come first (a small tier's
    shards are all verified within a second at the default rate), to meet the damage."""
    env = dict(child_env(), KVSTORE_BLOCKSTORE_SCRUB_BYTES_PER_S="0")
    return TierProcess.start(data_dir, "--fsync", "never", env=env, log=log)


def run_engine(
    model: Path,
    prompts: list[list[int]],
    connector: dict[str, Any] | None,
    *,
    multiprocessing: bool = False,
    max_tokens: int = 4,
    timeout: float = 400.0,
    tmp: Path,
    expect_failure: bool = False,
    prefix: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Serve ``prompts`` one after another in a fresh engine process; its results (with
    ``expect_failure``: the engine must fail, and its ``stderr`` is all there is). ``prefix``
    goes before its command (``ip netns exec HOST``: on a testbed host), ``env`` is added to
    its environment; ``extra``: more of ``vllm_run``'s spec (``prefix_caching``, ...)."""
    spec = {
        "model": str(model),
        "prompts": prompts,
        "connector": connector,
        "multiprocessing": multiprocessing,
        "max_tokens": max_tokens,
        **(extra or {}),
    }
    done = fresh_engine(
        spec, tmp, env={**child_env(), **(env or {})}, timeout_s=timeout, prefix=prefix
    )
    if expect_failure:
        assert done.returncode != 0, "the engine started, and should not have"
        return {"stderr": done.stderr}
    assert done.result is not None, f"engine failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return {**done.result, "stderr": done.stderr}


RNG = np.random.default_rng(20261201)


def tokens(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(2, 1000, n)]


SHARED = tokens(256)
#: (prompt, tokens engine B must take from kvstore after engine A served them all)
CASES = [
    (tokens(100), 0),  # shorter than a block
    (tokens(256), 128),  # exactly 2 blocks: the last token is computed, so 1 block
    (SHARED + tokens(1), 256),  # 2 blocks + 1 token
    (SHARED + tokens(172), 384),  # shares 2 blocks with the one above, a third of its own
    (tokens(650), 640),  # 5 blocks + 10
]
PROMPTS = [prompt for prompt, _ in CASES]
EXPECTED = [hit for _, hit in CASES]


HYBRID_SHARED = tokens(600)
#: The hybrid model's prompts: below one block, whole blocks, whole blocks + 1, two sharing 600
#: tokens; and what vLLM's own prefix cache reuses of each when it served them all before (the
#: window must be there: whole blocks up to the prompt's store position).
HYBRID_CASES = [
    (tokens(100), 0),
    (tokens(512), 384),
    (tokens(513), 512),
    (HYBRID_SHARED + tokens(100), 640),
    (HYBRID_SHARED + tokens(300), 896),
]
HYBRID_PROMPTS = [prompt for prompt, _ in HYBRID_CASES]
HYBRID_EXPECTED = [hit for _, hit in HYBRID_CASES]
#: 6 layers (3 sliding, 3 full): blocks of 3 layers, not the tiny Llama's 2, so that the two
#: models sharing one tier differ in block size.
GEMMA = TinyGemma3(layers=6)


def assert_same_outputs(got: dict, want: dict, what: str) -> None:
    pairs = list(zip(got["results"], want["results"], strict=True))
    differ = [
        index
        for index, (mine, theirs) in enumerate(pairs)
        if mine["tokens"] != theirs["tokens"]
        or mine["logprobs"] != pytest.approx(theirs["logprobs"], abs=1e-4)
    ]
    # On a failure, every prompt's outcome: which differ, by how much, and what the worker had
    # done by the end of each (a prompt without a hit that differs points outside its own load).
    assert not differ, f"{what}: prompts {differ} differ\n" + "\n".join(
        f"  prompt {index}: tokens {mine['tokens']} vs {theirs['tokens']}, logprobs off by "
        f"{[round(a - b, 6) for a, b in zip(mine['logprobs'], theirs['logprobs'], strict=False)]}"
        f", cached {mine['num_cached_tokens']}, worker {mine.get('worker')}"
        for index, (mine, theirs) in enumerate(pairs)
    )


def shard_records(tier: TierProcess, engine: dict, key: bytes) -> list[tuple[str, int, int]]:
    """Where one block's 12 shards are in the nodes' segment files (the key as the default
    tenant's namespace for ``engine``'s layout stores it): (file, record offset, bytes) each."""
    secret = (tier.data_dir / "tenant.secret").read_bytes()
    layout = Layout(
        bytes.fromhex(engine["fingerprint"]),
        engine["layout"]["block_bytes"],
        engine["layout"]["state_bytes"],
    )
    stored = namespaced_key(layout.salt(salts(secret, DEFAULT_TENANT)[0]), key)
    return [
        record
        for node_dir in sorted(tier.data_dir.glob("node-*"))
        for record in find_shard_records(node_dir, stored)
    ]


def damage_prompts(tier: TierProcess, engine: dict, prompts: list[list[int]]) -> int:
    """Flip a byte in 3 of the 12 shards (more than 10+2 survives) of every full block of
    ``prompts`` that ``engine`` saved; returns the blocks damaged."""
    damaged = 0
    for prompt in prompts:
        full = (len(prompt) - 1) // 128
        for key in block_keys(bytes.fromhex(engine["key_fingerprint"]), prompt[: full * 128]):
            records = shard_records(tier, engine, key)
            assert len(records) == 12, f"block {key.hex()[:12]}: {len(records)} shard records"
            for path, offset, size in records[:3]:
                with open(path, "r+b") as segment:  # in place, in the middle of the shard
                    segment.seek(offset + size // 2)
                    byte = segment.read(1)[0]
                    segment.seek(offset + size // 2)
                    segment.write(bytes([byte ^ 0xFF]))
            damaged += 1
    return damaged


def hits(result: dict) -> list[int]:
    return [r["num_cached_tokens"] for r in result["results"]]


def actor_pids(actor_class: str, tier: TierProcess) -> list[int]:
    """The processes of ``tier``'s Ray actors of ``actor_class``, by process title, among the
    tier process's descendants (its embedded Ray's raylet starts them): another tier on the
    machine, a chaos run's beside this suite, has actors of the same titles. Ray titles an
    idle actor ``ray::Class`` and one running a method ``ray::Class.method``: a storage node
    in the middle of a scrub or a heartbeat is still a storage node."""
    listing = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    parents: dict[int, int] = {}
    titled = []
    for line in listing.splitlines()[1:]:
        pid, ppid, *title = line.split(maxsplit=2)
        parents[int(pid)] = int(ppid)
        name = title[0].split(" ", 1)[0] if title else ""
        if name == f"ray::{actor_class}" or name.startswith(f"ray::{actor_class}."):
            titled.append(int(pid))

    def under_tier(pid: int) -> bool:
        for _ in range(64):  # a chain of parents, bounded
            if pid == tier.process.pid:
                return True
            if pid not in parents or pid <= 1:
                return False
            pid = parents[pid]
        return False

    return [pid for pid in titled if under_tier(pid)]
