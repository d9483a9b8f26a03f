"""CPU and time accounting of ``benchmarks/blockstore.py``: the CPU seconds of this run's
processes by role (``/proc/<pid>/stat``), the client's (``getrusage``), and the timed batches of
one case."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import statistics
import time
from collections.abc import Iterator
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                out[int(name)] = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def descendants(root: int) -> list[int]:
    """Processes below ``root`` (Ray's raylet/GCS are children of the driver that started the
    embedded instance, its workers children of the raylet): this run's, not another user's."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def this_runs_processes() -> list[int]:
    """This run's Ray processes: below this process (the embedded instance), or on a testbed
    (``--hosts``: Ray was started on its hosts, each process tagged with the testbed's name)."""
    from kvstore.testbed.netns import TAG_VARIABLE, tagged_processes

    tag = os.environ.get(TAG_VARIABLE)
    if not tag:
        return descendants(os.getpid())
    return [pid for pid, _ in tagged_processes(tag) if pid != os.getpid()]


class CpuGroups:
    """Pids of this run's processes by role, and their CPU seconds."""

    def __init__(self, handles: Any, exclude: set[int]) -> None:
        import ray

        stats = ray.get([h.stats.remote() for h in handles.nodes.values()], timeout=60)
        pids = [s.get("pid") for s in stats]
        below = [p for p in this_runs_processes() if p not in exclude]
        self.pid_source = "StorageNode.stats()['pid']"
        if not all(isinstance(p, int) for p in pids):
            self.pid_source = "/proc cmdline ray::StorageNodeActor"
            pids = [p for p in below if _cmdline(p).startswith("ray::StorageNodeActor")]
        nodes = {int(p) for p in pids}
        self.groups: dict[str, list[int]] = {
            "nodes": sorted(nodes),
            "meta": [p for p in below if _cmdline(p).startswith("ray::MetaShardActor")],
        }
        taken = nodes | set(self.groups["meta"])
        self.groups["ray"] = [p for p in below if p not in taken]

    def at_rest(self, seconds: float) -> dict[str, dict[int, float]]:
        """What each process spends with no request in flight: cores a pid, over ``seconds``
        (``/proc`` counts in 10 ms ticks: a few seconds make it good to a few hundredths)."""
        before = self.sample()
        started = time.monotonic()
        time.sleep(seconds)
        after, elapsed = self.sample(), time.monotonic() - started
        return {
            role: {
                p: (v - before[role][p]) / elapsed for p, v in values.items() if p in before[role]
            }
            for role, values in after.items()
        }

    def sample(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for role, pids in self.groups.items():
            seen = {}
            for pid in pids:
                value = proc_cpu(pid)
                if value is not None:
                    seen[pid] = value
            out[role] = seen
        return out


def client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclasses.dataclass
class Case:
    """Timed batches of one operation at one size in one phase, and the CPU they cost."""

    nbytes: int  # payload bytes per batch
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    #: (role, pid) -> CPU seconds of one process of a role of several (the storage nodes, the
    #: meta shards): the busiest process bounds the pace where each has a core of its own.
    by_process: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add_cpu(self, role: str, seconds: float) -> None:
        self.cpu[role] = self.cpu.get(role, 0.0) + seconds

    def add_process_cpu(self, role: str, pid: int, seconds: float) -> None:
        self.by_process[role, pid] = self.by_process.get((role, pid), 0.0) + seconds

    def busiest(self) -> dict[str, float]:
        """Per role, the CPU seconds of its busiest process (a role of one process, the client
        or redis-server: its own)."""
        most: dict[str, float] = {}
        for (role, _), seconds in self.by_process.items():
            most[role] = max(most.get(role, 0.0), seconds)
        return {role: most.get(role, total) for role, total in self.cpu.items()}

    def summary(self) -> dict[str, Any]:
        if not self.seconds:
            return {"batches": 0, "notes": self.notes}
        median = statistics.median(self.seconds)
        moved = self.nbytes * len(self.seconds) / 1e9
        return {
            "gbps": self.nbytes / median / 1e9,
            "p50_ms": median * 1e3,
            "p99_ms": percentile(self.seconds, 99) * 1e3,
            "batches": len(self.seconds),
            "gb_moved": moved,
            "cpu_s_per_gb": {role: s / moved for role, s in sorted(self.cpu.items())},
            "busiest_cpu_s_per_gb": {role: s / moved for role, s in self.busiest().items()},
            "notes": self.notes,
        }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@contextlib.contextmanager
def timed(case: Case) -> Iterator[None]:
    """Time one batch into ``case`` and charge this process's CPU time during it."""
    own = client_cpu()
    start = time.perf_counter()
    yield
    case.seconds.append(time.perf_counter() - start)
    case.add_cpu("client", client_cpu() - own)


class PhaseCpu:
    """CPU seconds of the server-side processes over one phase (its timed batches, kvstore's
    and Redis' alternating): storage-side roles are charged to kvstore's case, redis-server to
    Redis'. Work a node does after a call returned (a flush) still lands in its phase. What
    the storage processes spend at rest (``rest``: cores a pid, ``CpuGroups.at_rest``) while
    the phase is not in one of kvstore's batches (Redis' batches, the disk line's, the gaps)
    is taken off: Ray's actors wake ~100 times a second each, busy or not (about 0.15 of a
    core for this tier here), and that is not what kvstore's batches cost."""

    def __init__(
        self, groups: CpuGroups, redis_pid: int, rest: dict[str, dict[int, float]] | None = None
    ) -> None:
        self.groups = groups
        self.redis_pid = redis_pid
        self.rest = rest or {}
        self.before: dict[str, dict[int, float]] | None = None
        self.redis_before: float | None = None
        self.started = 0.0
        self.batches_before = 0

    def start(self, ours: Case) -> None:
        self.before = self.groups.sample()
        self.redis_before = proc_cpu(self.redis_pid)
        self.started = time.monotonic()
        self.batches_before = len(ours.seconds)

    def stop(self, ours: Case, peer: Case | None) -> None:
        if self.before is None:
            return
        after = self.groups.sample()
        elsewhere = time.monotonic() - self.started - sum(ours.seconds[self.batches_before :])
        for role, values in after.items():
            start, rest = self.before[role], self.rest.get(role, {})
            each = {
                p: v - start[p] - rest.get(p, 0.0) * elsewhere
                for p, v in values.items()
                if p in start
            }
            ours.add_cpu(role, max(0.0, sum(each.values())))
            for pid, seconds in each.items():  # a rest taken off may leave a hair below zero
                ours.add_process_cpu(role, pid, max(0.0, seconds))
        end = proc_cpu(self.redis_pid)
        if peer is not None and self.redis_before is not None and end is not None:
            peer.add_cpu("redis-server", end - self.redis_before)
        self.before = None
