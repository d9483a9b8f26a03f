"""Serve prompts in one fresh vLLM engine and print what came out: a smoke test of a connector
configuration, and the engine half of the connector's tests and TTFT benchmark.

    python -m kvstore.engine.vllm_run SPEC.json

SPEC (JSON): ``model`` (directory or hub id), ``prompts`` (lists of token ids, served one
after another, each on its own), and optionally ``connector`` (the ``kv_connector_extra_config``
of ``kvstore.engine.vllm``; null = no connector), ``max_tokens`` (4), ``prefix_caching``
(false: vLLM's own cache off, so every reused token comes from kvstore), ``multiprocessing``
(false: one process), ``kv_cache_bytes`` (64 MiB), ``max_model_len``, ``dtype`` ("float32").

Prints one line ``RESULT {json}``: per prompt the greedy token ids, their logprobs,
``num_cached_tokens`` and the seconds ``generate`` took; with a connector in one process, the
worker's figures after each prompt (``kvstore.engine.worker.WorkerStats``), the key
fingerprints, the tier layout and the KV-cache groups the connector was given.
``fresh_engine`` runs it in a new process from Python (tests, benchmark).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.childenv import child_env
from kvstore.keys import BLOCK_TOKENS

_RESULT = "RESULT "


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") else "0"
    from vllm import LLM, SamplingParams

    transfer = None
    if spec.get("connector") is not None:
        transfer = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.engine.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    options: dict[str, Any] = {}
    if spec.get("max_model_len"):
        options["max_model_len"] = int(spec["max_model_len"])
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=BLOCK_TOKENS,
        enforce_eager=True,
        kv_cache_memory_bytes=int(spec.get("kv_cache_bytes", 64 << 20)),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        kv_transfer_config=transfer,
        seed=0,
        **options,
    )
    worker = None
    if transfer is not None and not spec.get("multiprocessing"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()
    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 4)), temperature=0.0, logprobs=1)
    results = []
    for prompt in spec["prompts"]:
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        completion = out.outputs[0]
        pairs = zip(completion.token_ids, completion.logprobs or [], strict=True)
        entry: dict[str, Any] = {
            "tokens": list(completion.token_ids),
            "logprobs": [step[token].logprob for token, step in pairs],
            "num_cached_tokens": out.num_cached_tokens,
            "seconds": seconds,
        }
        if worker is not None and worker.worker is not None:
            entry["worker"] = dict(vars(worker.worker.stats))
        results.append(entry)
    answer: dict[str, Any] = {"results": results, "worker": None, "fingerprint": None}
    if worker is not None:
        from kvstore.engine.settings import engine_fingerprint

        fingerprint = engine_fingerprint(worker.layout)
        answer["fingerprint"] = fingerprint.hex()
        answer["key_fingerprint"] = worker.groups.group_fingerprint(fingerprint).hex()
        answer["layout"] = {
            "block_bytes": worker.tier_layout.block_bytes,
            "state_bytes": worker.tier_layout.state_bytes,
        }
        answer["groups"] = [[g.kind, list(g.layers), g.window] for g in worker.groups.groups]
        if worker.worker is not None:
            worker.worker.flush(60.0)  # the saves reach the tier before this engine exits
            answer["worker"] = dict(vars(worker.worker.stats))
    return answer


@dataclass(frozen=True)
class FreshRun:
    """What a fresh engine process did: its answer (None when it failed) and its output."""

    returncode: int
    result: dict[str, Any] | None
    stdout: str
    stderr: str


def fresh_engine(
    spec: dict[str, Any],
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900.0,
    prefix: Sequence[str] = (),
) -> FreshRun:
    """Run ``spec`` in a new ``python -m kvstore.engine.vllm_run`` process (its spec file
    and working directory in ``workdir``), vLLM's sockets on loopback. ``prefix`` goes before
    the command (``ip netns exec HOST``: the engine on a testbed host of its own)."""
    path = workdir / f"engine-spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "kvstore.engine.vllm_run", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=child_env(env, VLLM_HOST_IP="127.0.0.1"),
        cwd=workdir,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    result = json.loads(lines[-1][len(_RESULT) :]) if done.returncode == 0 and lines else None
    return FreshRun(done.returncode, result, done.stdout, done.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    spec = json.loads(Path(args[0]).read_text())
    print(_RESULT + json.dumps(run(spec)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
