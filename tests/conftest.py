"""Session-wide fixtures shared by every test file.

``ray_cluster``: ONE real local Ray cluster per pytest process (head without CPUs + 3 machines,
loopback only; a machine removed without notice is declared dead in ~6 s).
It starts lazily, the first time a test asks for it, and stops at the end of the session. Tests
that remove machines must ``add_machine()`` their own first and remove only those; tests that
create actors should kill them when done (the cluster outlives the test).

It runs with Ray's token authentication on, as every cluster kvstore starts does (see
``kvstore.runtime.cluster``): this process's environment then names the token
(``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``), so the drivers tests start as subprocesses
(``kvstore up``, the engine's fetcher process) inherit it. A test that plays a driver without
the token builds its environment without those two (tests/security/test_ray_auth.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvstore.runtime.cluster import LocalCluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalCluster]:
    # Imported here so that suites without Ray (the GPU machine's `-m cuda`) can collect.
    from kvstore.runtime.cluster import LocalCluster

    cluster = LocalCluster.start(num_machines=3)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(autouse=True)
def _storage_nodes_closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every storage node a test makes in this process is closed when the test ends (closing
    twice is harmless). In-process tiers (``tests/unit/blockstore_tier.py``) are rarely closed
    by their tests, and each held its node's segment, lock and directory descriptors until the
    garbage collector came by: over 2,000 were open by the end of the unit tests, past what
    ``select.select`` takes. Nodes made before the test (a module's fixture) are left alone."""
    from kvstore.blockstore.node import StorageNode

    made: list[StorageNode] = []
    make = StorageNode.__init__

    def tracked(self: StorageNode, *args: object, **kwargs: object) -> None:
        make(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(StorageNode, "__init__", tracked)
    yield
    for node in made:
        node.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test that stands on the Ray cluster carries the `ray` marker (select with -m ray).
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
