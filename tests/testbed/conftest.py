"""Tests on the multi-host testbed (``kvstore.testbed``): network namespaces, so root and
iproute2 are required. They carry the ``hosts`` marker and stay out of the default run;
``.ci/run`` (root) runs ``-m "hosts and not slow and not vllm"`` (the network layer and the
partition scenario) on every submission, and the slow ones with the other slow suites."""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/testbed/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.hosts)


@pytest.fixture(autouse=True)
def _root_and_iproute2() -> None:
    # Not a skip: a run that selected these tests without root is a broken set-up, said so.
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("the testbed tests need root and iproute2 (`ip`): see .ci/run", False)
