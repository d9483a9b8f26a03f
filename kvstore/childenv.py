"""The environment of a child Python process that must import this same kvstore (the fetcher
process, a ``kvstore up`` child, a fresh engine): this process's, with the directory holding
the ``kvstore`` package first on ``PYTHONPATH``, so the child finds it even when this process
found it through ``sys.path`` alone (a checkout, a test run)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The directory holding the ``kvstore`` package.
ROOT = Path(__file__).resolve().parents[1]


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) plus ``extra``, kvstore importable."""
    env = dict(os.environ if base is None else base, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
