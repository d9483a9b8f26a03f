"""A stand-in repair actor for the drain tests (``kvstore.runtime.drain`` and the
``kvstore drain`` command): its ``.remote()`` answers the value itself."""

from __future__ import annotations

from typing import Any

from kvstore.errors import InvalidArgument, StoreError


class Remote:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def remote(self, *args: Any) -> Any:
        return self._answer(*args)


class FakeRepair:
    """A drained node holds ``stripes`` stripes of 1 MB; each look at ``stats()`` moves
    ``per_look`` of them. ``interrupt``: Ctrl-C at the first look while a drain runs."""

    def __init__(
        self,
        nodes: range = range(13),
        per_look: int = 25,
        stripes: int = 100,
        interrupt: bool = False,
    ) -> None:
        self.nodes = nodes
        self.left: dict[int, int] = {}
        self.per_look = per_look
        self.stripes = stripes
        self.interrupt = interrupt
        self.stats_failures = 0  # the next looks that raise (a restarting actor)
        self.forget = False  # stats() without the node (a restarted actor not caught up)
        self.drain = Remote(self._drain)
        self.stats = Remote(self._stats)

    def _drain(self, node: int, draining: bool = True) -> dict[str, Any]:
        if node not in self.nodes:
            raise InvalidArgument("node_id", f"no storage node {node}")
        if draining:
            self.left.setdefault(node, self.stripes)
        else:
            self.left.pop(node, None)
        left = self.left.get(node)
        return {
            "node": node,
            "draining": draining,
            "stripes_left": left,
            "bytes_left": None if left is None else left * 10**6,
            "done": left == 0,
        }

    def _stats(self) -> dict[str, Any]:
        if self.interrupt and self.left:
            raise KeyboardInterrupt
        if self.stats_failures:
            self.stats_failures -= 1
            raise StoreError("repair actor stats() did not answer")
        for node in self.left:
            self.left[node] = max(0, self.left[node] - self.per_look)
        entries = {
            str(n): {"stripes_left": v, "bytes_left": v * 10**6, "done": v == 0}
            for n, v in self.left.items()
        }
        return {"stripes": 0, "draining": {} if self.forget else entries}
