"""``RayFanout`` hands a draining node's refusal back as ``NodeDraining`` (a writer places
around such a node instead of counting it failed), over the direct socket and through Ray; every
other remote error stays a plain ``NodeUnavailable``. Real sockets on 127.0.0.1, no Ray: the
Ray side is a fake handle and a stand-in for ``ray.get``."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import ray
from ray.exceptions import RayError, RayTaskError

from kvstore.blockstore.calls import StorageNodeCalls, node_target
from kvstore.blockstore.fanout import gather
from kvstore.errors import NodeDraining, NodeUnavailable, StoreError
from kvstore.fastcall.client import FastChannel
from kvstore.fastcall.server import FastCallServer
from kvstore.runtime.fanout import RayFanout

DRAINING_NODE = 3
BROKEN_NODE = 4


class Node:
    """Stands for a storage node's ``put``: node 3 is draining, node 4 fails otherwise."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id

    def put(
        self,
        token: int,
        keys: Sequence[bytes],
        shards: Sequence[np.ndarray],
        class_ids: Sequence[int],
        created: Sequence[float],
    ) -> list[bool]:
        if self.node_id == DRAINING_NODE:
            raise NodeDraining(f"storage node {self.node_id} is draining")
        if self.node_id == BROKEN_NODE:
            raise StoreError(f"storage node {self.node_id} broke")
        return [True] * len(keys)


class RayRefusing:
    """An actor handle whose every Ray call fails at once (the socket must carry the call)."""

    def __getattr__(self, method: str) -> Any:
        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                raise RayError(f"no Ray here ({method})")

        return Method()


@pytest.fixture
def socket_fanout() -> Iterator[RayFanout]:
    nodes = (2, DRAINING_NODE, BROKEN_NODE)
    handles = {node_target(i): RayRefusing() for i in nodes}
    fanout = RayFanout({}, resolve=handles.get, fast_methods=(StorageNodeCalls.put,))
    servers = []
    for i in nodes:
        server = FastCallServer(Node(i), ("put",), threading.Lock())
        servers.append(server)
        fanout._fast._channels[node_target(i)] = FastChannel(server.endpoint)
    yield fanout
    for server in servers:
        server.close()


def _put(fanout: RayFanout, node: int) -> Any:
    ticket = fanout.submit(
        node_target(node),
        StorageNodeCalls.put,
        7,
        [b"k" * 32],
        [np.zeros(16, np.uint8)],
        [0],
        [1.0],
    )
    return gather(fanout, [ticket], 2.0)[ticket]


def test_a_draining_refusal_over_the_socket_comes_back_as_node_draining(
    socket_fanout: RayFanout,
) -> None:
    assert _put(socket_fanout, 2) == [True]  # the socket path itself works
    refused = _put(socket_fanout, DRAINING_NODE)
    assert isinstance(refused, NodeDraining)
    assert "node 3" in str(refused) and "draining" in str(refused)
    broken = _put(socket_fanout, BROKEN_NODE)
    assert isinstance(broken, NodeUnavailable) and not isinstance(broken, NodeDraining)
    assert "StoreError" in str(broken)


class RayRef:
    """What a fake handle's ``remote`` answers: ``ray.get`` below raises ``error`` for it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class RayAnswering:
    """An actor handle whose calls are sent, and whose ``ray.get`` raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, method: str) -> Any:
        error = self.error

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> RayRef:
                return RayRef(error)

        return Method()


def _task_error(cause: Exception, as_cause: bool) -> RayTaskError:
    error = RayTaskError("put", "Traceback: (remote)", cause)
    # ``ray.get`` raises the form that is also an instance of the cause's class.
    return error.as_instanceof_cause() if as_cause else error


def _raise_for(ref: RayRef, timeout: float | None = None) -> Any:
    raise ref.error


@pytest.mark.parametrize("as_cause", [True, False])
def test_a_draining_refusal_through_ray_comes_back_as_node_draining(
    monkeypatch: pytest.MonkeyPatch, as_cause: bool
) -> None:
    monkeypatch.setattr(ray, "get", _raise_for)
    causes = {
        DRAINING_NODE: NodeDraining("storage node 3 is draining"),
        BROKEN_NODE: StoreError("storage node 4 broke"),
    }
    handles = {
        node_target(i): RayAnswering(_task_error(cause, as_cause)) for i, cause in causes.items()
    }
    fanout = RayFanout({}, resolve=handles.get)
    refused = fanout.submit(node_target(DRAINING_NODE), StorageNodeCalls.put, 7, [], [], [], [])
    with pytest.raises(NodeDraining, match="node 3 is draining"):
        fanout.result(refused)
    broken = fanout.submit(node_target(BROKEN_NODE), StorageNodeCalls.put, 7, [], [], [], [])
    with pytest.raises(NodeUnavailable) as failed:
        fanout.result(broken)
    assert not isinstance(failed.value, NodeDraining)
    assert "RayTaskError" in str(failed.value)
