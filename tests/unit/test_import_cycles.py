"""No import circles in ``kvstore/``: the modules import one another as a directed acyclic graph.

The graph: one node per module under ``kvstore/`` (a package's ``__init__`` is the package), one
edge per import statement naming another kvstore module, wherever it stands. Every import
counts, including those inside functions and under ``if TYPE_CHECKING:``: a lazy import is still
a dependency, it only hides a circle from the interpreter. (Imports by computed name, like
``kvstore.cli``'s discovery of its sub-commands, are not statements and do not count.)

- ``import kvstore.a.b`` is an edge to ``kvstore.a.b``.
- ``from kvstore.a import b`` is an edge to ``kvstore.a.b`` when that is a module, else to
  ``kvstore.a`` (``b`` is a name defined in ``kvstore/a.py`` or ``kvstore/a/__init__.py``).
- A package's own ``__init__``: a submodule that imports its package by name
  (``from kvstore.tier import Tier`` in ``kvstore.tier.cluster``) has an edge to the package like
  any other import, so it is a circle exactly when that ``__init__`` imports the submodule back,
  directly or not. Importing a submodule is *not* an edge to its parent packages, although Python
  runs their ``__init__`` first: the parent is initialised before the submodule's code runs, and
  counting it would make every package that re-exports its submodules (``kvstore.ec``,
  ``kvstore.tier``, ``kvstore.ledger``) a circle with each of them. So an ``__init__`` that
  imports nothing has no outgoing edge and can be on no circle.

A circle is a strongly connected component of more than one module, or a module importing
itself. Relative imports are refused (kvstore uses none): the helpers here would not see them.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Mapping

from test_import_rules import PACKAGE, imports_of, module_name, package_sources


def import_edges(source: str, modules: Collection[str]) -> set[str]:
    """The kvstore modules that ``source``'s import statements name, at any depth (the rules
    above); ``modules``: every module of the package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"relative import {ast.unparse(node)!r}: write it absolute")
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        names = imports_of(ast.unparse(node))  # what this one statement names
        if isinstance(node, ast.ImportFrom):
            # ``from p import a``: p.a when that is a module, else a name defined in p.
            found.update(name if name in modules else node.module for name in names - {node.module})
        else:
            found.update(names)
    return {name for name in found if name in modules}


def import_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """Module -> the modules it imports (``sources``: module name -> its source text)."""
    return {module: import_edges(source, sources) for module, source in sources.items()}


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, and every module that
    imports itself: each sorted, the list sorted (a few hundred modules: reachability from each
    is quick enough)."""
    reach = {module: _reachable(graph, module) for module in graph}
    found: list[list[str]] = []
    placed: set[str] = set()
    for module in sorted(graph):
        if module in placed or module not in reach[module]:  # on no circle
            continue
        component = sorted(other for other in reach[module] if module in reach[other])
        placed.update(component)
        found.append(component)
    return found


def describe(graph: Mapping[str, set[str]], circle: list[str]) -> str:
    """A circle and the imports that close it: ``a -> b, c`` for each module on it."""
    members = set(circle)
    return "; ".join(
        f"{module} -> {', '.join(sorted(graph[module] & members))}" for module in circle
    )


def test_no_module_of_kvstore_is_on_an_import_circle() -> None:
    sources = package_sources()
    assert len(sources) > 100  # the walk really found the package
    assert module_name(PACKAGE / "tier" / "__init__.py") == "kvstore.tier"
    graph = import_graph(sources)
    assert "kvstore.envconfig" in graph["kvstore.geometry"]  # the graph really has edges
    found = [describe(graph, circle) for circle in circles(graph)]
    assert found == [], "import circles:\n" + "\n".join(found)


def test_the_edges_follow_the_rules() -> None:
    modules = {"kvstore", "kvstore.a", "kvstore.a.b", "kvstore.c"}
    source = (
        "import os\n"
        "from kvstore.a import b, helper\n"  # a module, and a name of kvstore.a
        "def f():\n"
        "    import kvstore.c\n"  # lazy: still an edge
        "    from kvstore import a\n"
        "    return kvstore.c, a\n"
    )
    assert import_edges(source, modules) == {"kvstore.a", "kvstore.a.b", "kvstore.c"}
    # A submodule of a is not an edge to a; naming a's own definitions is.
    assert import_edges("from kvstore.a.b import x\n", modules) == {"kvstore.a.b"}
    assert import_edges("from kvstore.a import x\n", modules) == {"kvstore.a"}


def test_a_lazy_import_making_a_circle_is_found() -> None:
    sources = package_sources()
    lazy = "def f():\n    from kvstore.tier.cluster import ClusterTier\n    return ClusterTier\n"
    broken = import_graph({**sources, "kvstore.keys": sources["kvstore.keys"] + lazy})
    found = circles(broken)
    assert len(found) == 1
    assert {"kvstore.keys", "kvstore.tier.cluster"} <= set(found[0])
    # A self-loop is a circle too.
    assert circles({"kvstore.x": {"kvstore.x"}, "kvstore.y": set()}) == [["kvstore.x"]]


def test_a_package_init_is_on_a_circle_only_when_it_imports() -> None:
    quiet = {
        "kvstore.p": '"""A package that imports nothing."""\n',
        "kvstore.p.m": "from kvstore.p import __doc__\nimport kvstore.p.n\n",
        "kvstore.p.n": "from kvstore.p import m\n",
    }
    # m <-> n is a circle; the package's __init__ is on none.
    assert circles(import_graph(quiet)) == [["kvstore.p.m", "kvstore.p.n"]]
    reexports = {"kvstore.q": "from kvstore.q.m import X\n", "kvstore.q.m": "X = 1\n"}
    assert circles(import_graph(reexports)) == []  # a submodule's parent is not its import
    loop = {**reexports, "kvstore.q.m": "from kvstore.q import Y\nX = 1\n"}
    assert circles(import_graph(loop)) == [["kvstore.q", "kvstore.q.m"]]
