"""The Ray boundary, checked: product code outside ``kvstore/runtime/`` imports no ``ray``; and
only the vLLM connector (``kvstore.engine.vllm``) and its runner import vLLM.

Logic packages (``tier``, ``blockstore``, ``swa``, ``gc``, ``api``, ``gpu``, ``ec``, ``ledger``,
``verify``, ...) reach the cluster only through injected seams (a ``Fanout``, an ``SWATransport``,
a ``TierControl``), so they run — and are unit-tested — without Ray. Only the wiring may reach Ray
or ``kvstore.runtime``: ``runtime`` itself, the CLI and its sub-commands (they start services),
the demo's runner (it starts a cluster), the multi-host ``testbed`` (it starts Ray on its hosts),
and ``chaos`` — failure injection kills actors and machines, which only the runtime can name.

Every import counts, including those inside functions: a lazy ``import ray`` is still a
dependency on Ray.

The block tier's client side imports no server module: the client, its reads, the repair loop
and the GC worker reach storage nodes and meta shards only through a ``Fanout`` and the
``calls.py`` protocols, and share with the servers only the values of ``records.py``; so a
client process never loads the node's log, its index or a meta shard, and a server module can
change without its clients importing it. Checked through every chain of kvstore imports (a
shared module importing a server module would bring it into every client), ``if
TYPE_CHECKING:`` imports included: each server module checks itself against ``calls.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kvstore"

#: Modules (and packages, by prefix) allowed to import ``ray`` or ``kvstore.runtime``.
WIRING = (
    "kvstore.runtime",
    "kvstore.cli",
    "kvstore.commands",
    "kvstore.demo.runner",
    "kvstore.trace.replay",  # like the demo's runner: starts the embedded tier it replays into
    "kvstore.chaos",  # failure injection: kills actors and machines by their Ray handles
    "kvstore.testbed",  # the multi-host testbed: starts Ray on its hosts, like the runtime
)
FORBIDDEN = ("ray", "kvstore.runtime")
#: The modules that may import vLLM: the connector vLLM loads by name, and the runner that
#: serves prompts in one engine (tests, benchmark, a user's smoke test).
VLLM_GLUE = "kvstore.engine.vllm"
VLLM_MODULES = (VLLM_GLUE, "kvstore.engine.vllm_run")

#: The block tier's client side: what reaches nodes and meta shards through a ``Fanout``, and
#: the modules it shares with the servers.
CLIENT_SIDE = (
    "kvstore.blockstore.client",
    "kvstore.blockstore.core",
    "kvstore.blockstore.reads",
    "kvstore.blockstore.fanout",
    "kvstore.blockstore.calls",
    "kvstore.blockstore.placement",
    "kvstore.blockstore.records",
    # An engine's direct reads: the reader, the capability it carries, their wire format.
    "kvstore.blockstore.direct",
    "kvstore.blockstore.capability",
    "kvstore.blockstore.readproto",
    "kvstore.blockstore.repair",
    "kvstore.blockstore.repairloop",
    "kvstore.gc.worker",
    "kvstore.tier.cluster",
)
#: The servers' own modules: a storage node (its log, index, compaction) and a meta shard.
SERVER_SIDE = (
    "kvstore.blockstore.node",
    "kvstore.blockstore.meta",
    "kvstore.blockstore.compaction",
    "kvstore.blockstore.segmentlog",
    "kvstore.blockstore.segments",
    "kvstore.blockstore.shardindex",
    "kvstore.blockstore.logfiles",
    "kvstore.blockstore.readserver",  # a node's engine read socket
)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str) -> set[str]:
    """Every module an (absolute) import statement in ``source`` names, at any depth."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(modules: dict[str, str]) -> list[str]:
    """``module imports name`` for every logic module importing Ray, the runtime or wiring."""
    found = []
    for module, source in sorted(modules.items()):
        if _within(module, WIRING) or module.startswith("kvstore.api.v1"):
            continue
        for name in sorted(imports_of(source)):
            if _within(name, FORBIDDEN) or (_within(name, WIRING) and name.startswith("kvstore")):
                found.append(f"{module} imports {name}")
    return found


def package_sources() -> dict[str, str]:
    return {module_name(path): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_no_logic_module_imports_ray_or_the_runtime() -> None:
    sources = package_sources()
    assert len(sources) > 100  # the walk really found the package
    assert violations(sources) == []


def test_the_rule_catches_an_import_of_ray_anywhere_in_a_logic_module() -> None:
    sources = package_sources()
    lazy = "def f():\n    import ray\n    return ray\n"
    for module, extra in [
        ("kvstore.tier.cluster", "import ray\n"),
        ("kvstore.swa.client", lazy),
        ("kvstore.api.servicer", "from ray.util import ActorPool\n"),
        ("kvstore.blockstore.client", "from kvstore.runtime.deploy import BlockStoreHandles\n"),
        ("kvstore.engine.fetcher", "from kvstore.chaos.tier import ChaosTier\n"),
    ]:
        broken = {**sources, module: sources[module] + extra}
        assert violations(broken) == [
            f"{module} imports {name}"
            for name in sorted(imports_of(extra))
            if name.startswith(("ray", "kvstore"))
        ], module
    # Wiring may: the runtime and the commands import Ray and the runtime freely.
    assert violations({"kvstore.runtime.x": "import ray\n", "kvstore.commands.y": lazy}) == []


def test_importing_the_logic_packages_loads_no_ray() -> None:
    """The same rule, as the interpreter sees it (third-party imports included)."""
    logic = sorted(
        module
        for module in package_sources()
        if not _within(module, WIRING)
        and not module.startswith("kvstore.api.v1")
        and module not in VLLM_MODULES  # need vLLM, which has a venv of its own
    )
    code = "import sys\n" + "".join(f"import {m}\n" for m in logic)
    code += "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def vllm_importers(modules: dict[str, str]) -> list[str]:
    return sorted(
        module
        for module, source in modules.items()
        if module not in VLLM_MODULES and any(_within(n, ("vllm",)) for n in imports_of(source))
    )


def test_only_the_connector_imports_vllm() -> None:
    sources = package_sources()
    assert VLLM_GLUE in sources and "vllm" in {
        n.split(".")[0] for n in imports_of(sources[VLLM_GLUE])
    }
    assert vllm_importers(sources) == []
    lazy = "def f():\n    from vllm import LLM\n    return LLM\n"
    broken = {
        **sources,
        "kvstore.engine.worker": sources["kvstore.engine.worker"] + lazy,
    }
    assert vllm_importers(broken) == ["kvstore.engine.worker"]


def server_imports(modules: dict[str, str]) -> list[str]:
    """``client -> ... -> server`` for each client-side module that reaches a server module
    through kvstore imports (the shortest chain)."""
    found = []
    for start in CLIENT_SIDE:
        came_from: dict[str, str] = {start: ""}
        queue = [start]
        while queue:
            module = queue.pop(0)
            if module in SERVER_SIDE:
                chain = [module]
                while came_from[chain[-1]]:
                    chain.append(came_from[chain[-1]])
                found.append(" -> ".join(reversed(chain)))
                break
            for name in sorted(imports_of(modules.get(module, ""))):
                if name in modules and name not in came_from:
                    came_from[name] = module
                    queue.append(name)
    return found


def test_the_block_clients_import_no_server_module() -> None:
    sources = package_sources()
    assert set(CLIENT_SIDE + SERVER_SIDE) <= set(sources)  # the names are the modules'
    assert server_imports(sources) == []


def test_the_rule_catches_a_client_reaching_a_server_module() -> None:
    sources = package_sources()
    checked = "if TYPE_CHECKING:\n    from kvstore.blockstore.node import StorageNode\n"
    lazy = "def f():\n    from kvstore.blockstore import segmentlog\n    return segmentlog\n"
    for module, extra, chain in [
        (
            "kvstore.blockstore.client",
            "from kvstore.blockstore.meta import MetaShard\n",
            "kvstore.blockstore.client -> kvstore.blockstore.meta",
        ),
        (
            "kvstore.blockstore.calls",
            checked,
            "kvstore.blockstore.calls -> kvstore.blockstore.node",
        ),
        (
            "kvstore.blockstore.reads",
            lazy,
            "kvstore.blockstore.reads -> kvstore.blockstore.segmentlog",
        ),
        (
            "kvstore.blockstore.repair",
            "import kvstore.blockstore.compaction\n",
            "kvstore.blockstore.repair -> kvstore.blockstore.compaction",
        ),
    ]:
        broken = {**sources, module: sources[module] + extra}
        assert chain in server_imports(broken), module
    # Through a shared module: every client importing it reaches the server module.
    broken = {
        **sources,
        "kvstore.blockstore.records": sources["kvstore.blockstore.records"]
        + "from kvstore.blockstore.shardindex import ShardIndex\n",
    }
    assert (
        "kvstore.blockstore.client -> kvstore.blockstore.records -> kvstore.blockstore.shardindex"
        in server_imports(broken)
    )
    assert len(server_imports(broken)) > 5
