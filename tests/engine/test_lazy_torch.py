"""torch is the ``gpu`` extra: importing kvstore, its CLI or the engine-side modules never loads
it (the fetcher process imports ``kvstore.engine.fetcher`` and must stay light)."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "kvstore.cli",
    "kvstore.engine",
    "kvstore.engine.scheduler",
    "kvstore.engine.worker",
    "kvstore.engine.groups",
    "kvstore.engine.settings",
    "kvstore.engine.tiny_model",
    "kvstore.engine.fetcher",
    "kvstore.engine.staging",
    "kvstore.engine.swapin",
    "kvstore.engine.save",
    "kvstore.engine.rows",
    "kvstore.tier.files",
    "kvstore.tier.cluster",
]


def test_importing_kvstore_and_its_engine_side_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in MODULES)
        + "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr


def test_cli_help_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom kvstore import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr
