"""Planned drain of a storage node: every shard moved off it before it stops serving.

The repair actor does the moving (``RepairActor.drain``): it marks the node draining (on the
node itself, so the mark survives restarts of either), the node takes no new writes, and the
repair loop copies each of its shards to another node, committing the new shard before the
stripe's placement moves, so no stripe ever has fewer than its 12 shards. Once no stripe
references the node (``done``) it can be stopped without any stripe losing redundancy.

This module is the driver side of that: start a drain and watch it to the end
(``drain_node``), put a node back in service (``undrain_node``), see every drain
(``drain_status``), and find the repair actor of a running deployment (``attach``). A watch
that stops — a timeout, Ctrl-C, the driver exiting — leaves the drain running; calling
``drain_node`` again picks it up where it is (starting a drain twice is harmless).

Any handle works whose methods have a ``.remote()``: a Ray actor handle, or a stand-in whose
``.remote()`` answers the value itself (unit tests).
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from kvstore.blockstore.config import BlockStoreConfig
from kvstore.errors import InvalidArgument, KVStoreError, StoreError
from kvstore.runtime.blockstore_actors import find_actor, repair_actor_name

#: Seconds between two looks at a drain's progress while waiting for it.
DRAIN_POLL_S = 0.5
#: Seconds one call to the repair actor may take (it answers from memory, under its lock, which
#: a repair round holds for a moment).
CALL_TIMEOUT_S = 30.0
#: How long a watch tolerates a repair actor that does not answer, or does not list the node
#: (it restarted and has not yet read the drain marks back from the nodes), before giving up.
UNANSWERED_GRACE_S = 30.0
#: The window the drain's own rate is measured over (bytes left, seen falling).
RATE_WINDOW_S = 20.0

Status = dict[str, Any]


class DrainTimeout(StoreError):
    """A drain was not done within the caller's timeout; it goes on in the background.
    ``status``: its last figures."""

    def __init__(self, message: str, status: Status) -> None:
        super().__init__(message)
        self.status = status


# --- talking to the repair actor ------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _call(handle: Any, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """``handle.method(*args)``, its answer; a KVStoreError it raised is raised as itself, any
    other failure as a StoreError naming the call."""
    what = f"repair actor {method}()"
    try:
        remote = getattr(handle, method).remote
    except AttributeError:
        raise StoreError(
            f"the repair actor has no {method}(): it runs a kvstore without planned drains "
            "(restart the deployment on this version)"
        ) from None
    try:
        answer = remote(*args)
        if isinstance(answer, ray.ObjectRef):
            answer = ray.get(answer, timeout=timeout_s)
        return answer
    except RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, KVStoreError):
            raise cause from None
        raise StoreError(f"{what} failed: {_first_line(cause or error)}") from None
    except GetTimeoutError:
        raise StoreError(f"{what} did not answer within {timeout_s:.0f} s") from None
    except RayError as error:
        raise StoreError(
            f"{what}: the repair actor is unavailable ({_first_line(error)})"
        ) from None


def _node_id(node_id: Any) -> int:
    if isinstance(node_id, bool) or not isinstance(node_id, int) or node_id < 0:
        raise InvalidArgument(
            "node_id", f"must be a storage node id (an integer >= 0), got {node_id!r}"
        )
    return node_id


def _count(value: Any) -> int | None:
    """A figure of the repair actor as an int (None: absent or not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def _status(node_id: int, raw: Any, draining: bool = True) -> Status:
    """One drain's figures in one shape, whatever of them the repair actor reported."""
    raw = raw if isinstance(raw, Mapping) else {}
    return {
        "node": node_id,
        "draining": bool(raw.get("draining", draining)),
        "stripes_left": _count(raw.get("stripes_left")),
        "bytes_left": _count(raw.get("bytes_left")),
        "done": bool(raw.get("done", False)),
    }


# --- the API --------------------------------------------------------------------------------


class _RateMeter:
    """Bytes per second the drain moves, from its bytes left seen falling over the last
    ``RATE_WINDOW_S`` (the repair actor's own rate counts every repair, not this drain's)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, status: Status) -> None:
        left = status["bytes_left"]
        now = self._clock()
        if left is not None:
            self._samples.append((now, left))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        rate = None
        if len(self._samples) >= 2:
            (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
            if t1 > t0:
                rate = max(0.0, (b0 - b1) / (t1 - t0))
        status["rate_bytes_per_s"] = rate
        status["eta_s"] = left / rate if rate and left is not None else None


def drain_node(
    repair_actor: Any,
    node_id: int,
    *,
    wait: bool = True,
    timeout_s: float | None = None,
    on_progress: Callable[[Status], None] | None = None,
    poll_s: float = DRAIN_POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Status:
    """Start draining ``node_id`` (or pick up its drain) and, with ``wait``, watch it until no
    stripe references the node.

    Returns ``{"node", "draining", "stripes_left", "bytes_left", "done", "rate_bytes_per_s",
    "eta_s"}`` (a figure the repair actor does not report is None). ``on_progress`` gets that
    dict after every look, the first right after the drain started. Raises InvalidArgument for
    a node the deployment does not have, DrainTimeout when ``timeout_s`` passes first (the
    drain goes on), StoreError when the repair actor stops answering for
    ``UNANSWERED_GRACE_S`` or the node is undrained meanwhile."""
    node_id = _node_id(node_id)
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidArgument("timeout_s", f"must be > 0 seconds (None: no limit), got {timeout_s}")
    if not (math.isfinite(poll_s) and poll_s > 0):
        raise InvalidArgument("poll_s", f"must be > 0 seconds, got {poll_s}")
    started = clock()
    meter = _RateMeter(clock)
    status = _status(node_id, _call(repair_actor, "drain", node_id, True))
    meter.add(status)
    if on_progress is not None:
        on_progress(status)
    if not wait or status["done"]:
        return status
    deadline = None if timeout_s is None else started + timeout_s
    unanswered_since: float | None = None  # first of the looks in a row that told us nothing
    problem = ""
    while True:
        now = clock()
        if deadline is not None and now >= deadline:
            raise DrainTimeout(
                f"node {node_id} not drained after {timeout_s:g} s "
                f"({_left(status)} left); the drain goes on in the background",
                status,
            )
        sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - now)))
        entry: Any = None
        try:
            stats = _call(repair_actor, "stats")
        except StoreError as error:
            problem = str(error)
        else:
            draining = stats.get("draining") if isinstance(stats, Mapping) else None
            if not isinstance(draining, Mapping):
                raise StoreError(
                    "the repair actor reports no drain progress (stats() has no 'draining'): "
                    "it runs a kvstore without planned drains"
                )
            entry = draining.get(str(node_id))
            problem = (
                f"node {node_id} is not draining any more (undrained meanwhile, or declared "
                "dead: repair then restores its shards elsewhere)"
            )
        if entry is None:
            now = clock()
            unanswered_since = now if unanswered_since is None else unanswered_since
            if now - unanswered_since >= UNANSWERED_GRACE_S:
                raise StoreError(f"{problem}; gave up watching after {UNANSWERED_GRACE_S:g} s")
            continue
        unanswered_since = None
        status = _status(node_id, entry)
        meter.add(status)
        if on_progress is not None:
            on_progress(status)
        if status["done"]:
            return status


def _left(status: Status) -> str:
    stripes, size = status["stripes_left"], status["bytes_left"]
    if stripes is None:
        return "progress n/a"
    return f"{stripes} stripes" + ("" if size is None else f", {size / 1e6:.1f} MB")


def undrain_node(repair_actor: Any, node_id: int) -> Status:
    """Put ``node_id`` back in service: it takes new writes again and the repair loop stops
    moving its shards (those already moved stay where they went). Harmless on a node that is
    not draining. InvalidArgument for a node the deployment does not have."""
    node_id = _node_id(node_id)
    return _status(node_id, _call(repair_actor, "drain", node_id, False), draining=False)


def drain_status(repair_actor: Any) -> dict[int, Status]:
    """Every node draining (or drained and not yet undrained), by node id."""
    stats = _call(repair_actor, "stats")
    draining = stats.get("draining") if isinstance(stats, Mapping) else None
    if not isinstance(draining, Mapping):
        return {}
    out: dict[int, Status] = {}
    for key, entry in draining.items():
        try:
            node = int(key)
        except (TypeError, ValueError):
            continue  # not a node id: nothing this view can name
        out[node] = _status(node, entry)
    return dict(sorted(out.items()))


# --- finding a running deployment -----------------------------------------------------------


@dataclass(frozen=True)
class LiveRepair:
    """The repair actor of a running deployment and the storage nodes it has."""

    deployment: str
    actor: Any
    node_ids: tuple[int, ...]

    def check_node(self, node_id: int) -> None:
        """InvalidArgument naming ``NODE`` unless the deployment has a storage node ``node_id``."""
        if node_id not in self.node_ids:
            have = _ranges(self.node_ids) or "none"
            raise InvalidArgument(
                "NODE",
                f"no storage node {node_id} in deployment {self.deployment!r} (nodes: {have})",
            )

    def check_can_drain(self, node_id: int, draining: Mapping[int, Any]) -> None:
        """Refuse a drain that could never finish: the nodes left in service must still give
        every stripe its own failure domain per shard (an already draining node: resumed)."""
        if node_id in draining:
            return
        width = BlockStoreConfig().stripe_width
        in_service = set(self.node_ids) - set(draining) - {node_id}
        if len(in_service) < width:
            raise InvalidArgument(
                "NODE",
                f"draining node {node_id} would leave {len(in_service)} storage nodes in "
                f"service, fewer than the {width} shards of a stripe: add a node first "
                "(or undrain another)",
            )


def _ranges(ids: tuple[int, ...]) -> str:
    """``0-12, 14`` for (0, 1, ..., 12, 14)."""
    runs: list[list[int]] = []
    for value in sorted(ids):
        if runs and runs[-1][1] == value - 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _deployments(names: list[Any], suffix: str) -> list[str]:
    out = set()
    for entry in names:
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        if name.endswith(suffix):
            out.add(name[: -len(suffix)])
    return sorted(out)


def attach(address: str, deployment: str) -> LiveRepair:
    """Join the Ray cluster at ``address`` ("auto": the one on this machine) unless this process
    already is in one, and find ``deployment``'s repair actor and storage nodes."""
    from kvstore.runtime.cluster import connect
    from kvstore.runtime.gc_actors import check_address, check_reachable

    check_address(address)  # a malformed one is refused even in a process already joined
    if not ray.is_initialized():
        check_reachable(address)  # fail fast: ray.init retries an empty address for minutes
        try:
            connect(address)
        except KVStoreError:
            raise
        except Exception as error:  # Ray raises plain exceptions for a cluster it cannot join
            raise StoreError(f"Ray not reachable at {address} ({_first_line(error)})") from None
    names = ray.util.list_named_actors()
    actor = find_actor(repair_actor_name(deployment))
    if actor is None:
        running = _deployments(names, repair_actor_name(""))
        raise StoreError(
            f"no deployment {deployment!r} in the Ray cluster at {address} (no actor "
            f"{repair_actor_name(deployment)!r}); deployments running: "
            f"{', '.join(running) if running else 'none'}"
        )
    pattern = re.compile(rf"{re.escape(deployment)}-node-(\d+)")
    node_ids = set()
    for entry in names:
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        match = pattern.fullmatch(name)
        if match:
            node_ids.add(int(match.group(1)))
    return LiveRepair(deployment, actor, tuple(sorted(node_ids)))


__all__ = [
    "DrainTimeout",
    "LiveRepair",
    "attach",
    "drain_node",
    "drain_status",
    "undrain_node",
]
