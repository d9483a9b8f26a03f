"""A Ray shell's pure forwarders, generated from the Protocol of its remote calls.

A remote method is written twice, by design: its Protocol (``kvstore.blockstore.calls``: the
remote interface, what fanout call sites name and mypy checks) and the plain class's method
(the implementation). The Ray shell that holds the plain object should not write it a third
time just to take the lock and pass the call on, so ``forwards`` writes those methods::

    @ray.remote
    @forwards(StorageNodeCalls, to=StorageNode, held_as="_node", lock="_lock")
    class StorageNodeActor: ...

For every method of the Protocol the shell does not define itself it adds one that holds
``self.<lock>``, counts the call in ``self.<counter>`` when its name is in ``counted``, and
calls the same-named method of ``self.<held_as>``. The method carries the Protocol's
signature (``__signature__``, annotations, doc): Ray reads it when ``ray.remote`` wraps the
class (hence ``forwards`` below ``ray.remote``) and binds every ``.remote()`` call against it.

Checked once, when the shell's module is imported (so the three can never drift): every
Protocol method exists on the plain class with the same call shape (parameter names, order,
kinds and defaults), and a method the shell writes by hand (one that does more than forward)
has that shape too. Types are mypy's part: each Protocol module assigns the plain class to
``type[<Protocol>]``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any, TypeVar

_Shell = TypeVar("_Shell", bound=type)


def remote_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    """The methods a Protocol declares (its Protocol bases' too), by name, in declaration
    order; private names (``_x``) are not remote calls."""
    methods: dict[str, Callable[..., Any]] = {}
    for base in reversed(protocol.__mro__):
        if base is object or base.__module__ == "typing":  # Protocol, Generic: machinery
            continue
        for name, value in vars(base).items():
            if callable(value) and not name.startswith("_"):
                methods[name] = value
    return methods


def call_shape(method: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """What a call binds to: each parameter's name, kind and default (annotations left out:
    the plain class may take wider types than its Protocol promises, which mypy checks)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


def _check_same_shape(
    protocol: type, name: str, declared: Callable[..., Any], other: type, what: str
) -> None:
    implemented = getattr(other, name, None)
    if not callable(implemented):
        raise TypeError(
            f"{protocol.__name__}.{name} has no implementation: {other.__name__} lacks {name}"
        )
    if call_shape(implemented) != call_shape(declared):
        raise TypeError(
            f"{what} {other.__name__}.{name}{inspect.signature(implemented)} differs from "
            f"{protocol.__name__}.{name}{inspect.signature(declared)}"
        )


def _forwarder(
    shell: type,
    name: str,
    declared: Callable[..., Any],
    held_as: str,
    lock: str,
    counter: str | None,
) -> Callable[..., Any]:
    """``shell.<name>``: under the shell's lock, the held object's ``name`` with the same
    arguments (omitted ones take the plain method's defaults, which equal the Protocol's)."""
    if counter is None:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            with getattr(self, lock):
                return getattr(getattr(self, held_as), name)(*args, **kwargs)

    else:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            with getattr(self, lock):
                getattr(self, counter)[name] += 1
                return getattr(getattr(self, held_as), name)(*args, **kwargs)

    forward.__name__ = name
    forward.__qualname__ = f"{shell.__qualname__}.{name}"
    forward.__module__ = shell.__module__
    forward.__doc__ = declared.__doc__
    forward.__annotations__ = dict(getattr(declared, "__annotations__", {}))
    forward.__signature__ = inspect.signature(declared)  # type: ignore[attr-defined]
    return forward


def forwards(
    protocol: type,
    *,
    to: type,
    held_as: str,
    lock: str,
    counted: Collection[str] = (),
    counter: str | None = None,
) -> Callable[[_Shell], _Shell]:
    """Give a Ray shell a forwarder for each method of ``protocol`` it does not define (module
    doc). ``to``: the plain class the shell holds in ``self.<held_as>``; ``counted``: the names
    whose calls are counted in ``self.<counter>`` (a ``Counter``). Raises ``TypeError`` at
    import time when ``to`` or the shell does not answer the Protocol's calls as declared."""
    methods = remote_methods(protocol)
    if not methods:
        raise TypeError(f"{protocol.__name__} declares no remote method")
    if bool(counted) != (counter is not None):
        raise TypeError("forwards: counted names and a counter go together")
    unknown = sorted(set(counted) - set(methods))
    if unknown:
        raise TypeError(f"forwards: {unknown} counted but not methods of {protocol.__name__}")
    for name, declared in methods.items():
        _check_same_shape(protocol, name, declared, to, "the implementation")

    def add_forwarders(shell: _Shell) -> _Shell:
        for name, declared in methods.items():
            if name in vars(shell):  # written by hand: it does more than forward
                _check_same_shape(protocol, name, declared, shell, "the shell's")
                continue
            counts = counter if name in counted else None
            setattr(shell, name, _forwarder(shell, name, declared, held_as, lock, counts))
        return shell

    return add_forwarders


__all__ = ["call_shape", "forwards", "remote_methods"]
