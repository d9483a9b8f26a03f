"""``kvstore.runtime.forwards``: a shell's forwarders generated from its Protocol (no Ray).

A generated forwarder holds the shell's lock around the call, passes positional, keyword and
omitted (default) arguments through, counts the calls it is asked to, and carries the
Protocol's signature (what Ray binds ``.remote()`` calls against). The decorator refuses, at
import time, a Protocol the plain class does not answer as declared, so the Protocol, the plain
class and the shell cannot drift apart. The real shells are checked the same way at the end.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any, Protocol

import pytest

from kvstore.blockstore.calls import MetaShardCalls, StorageNodeCalls
from kvstore.runtime.blockstore_actors import MetaShardActor, StorageNodeActor
from kvstore.runtime.forwards import call_shape, forwards, remote_methods
from kvstore.runtime.swa_actors import SWAEntrypointActor
from kvstore.swa.calls import DirectoryShardCalls


class RecordingLock:
    """A lock double: says whether it is held, and how often it was taken."""

    def __init__(self) -> None:
        self.held = False
        self.taken = 0

    def __enter__(self) -> RecordingLock:
        assert not self.held, "taken twice"
        self.held, self.taken = True, self.taken + 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.held = False


class EchoCalls(Protocol):
    def echo(self, a: int, b: str = "b", *, c: float = 1.5) -> tuple[Any, ...]:
        """Its arguments back, and whether the shell's lock was held."""
        ...

    def tally(self, n: int) -> int: ...


class Echo:
    """The plain object: records what it was called with, and the lock's state then."""

    def __init__(self, lock: RecordingLock) -> None:
        self.lock = lock

    def echo(self, a: int, b: str = "b", *, c: float = 1.5) -> tuple[Any, ...]:
        return (a, b, c, self.lock.held)

    def tally(self, n: int) -> int:
        if n < 0:
            raise ValueError("negative")
        return n + 1


@forwards(EchoCalls, to=Echo, held_as="_echo", lock="_lock", counted=("tally",), counter="_calls")
class EchoShell:
    def __init__(self) -> None:
        self._lock = RecordingLock()
        self._echo = Echo(self._lock)
        self._calls: Counter[str] = Counter()


def _shell() -> Any:
    return EchoShell()  # through Any: mypy does not see generated methods


def test_a_forwarder_calls_the_plain_object_holding_the_lock() -> None:
    shell = _shell()
    assert shell.echo(1)[-1] is True  # the plain method ran under the lock
    assert shell._lock.held is False and shell._lock.taken == 1
    with pytest.raises(ValueError, match="negative"):
        shell.tally(-1)
    assert shell._lock.held is False and shell._lock.taken == 2  # released on an error too


def test_arguments_pass_through_positional_keyword_and_defaulted() -> None:
    shell = _shell()
    assert shell.echo(1) == (1, "b", 1.5, True)
    assert shell.echo(2, "x") == (2, "x", 1.5, True)
    assert shell.echo(3, c=9.0) == (3, "b", 9.0, True)
    assert shell.echo(b="y", a=4) == (4, "y", 1.5, True)
    with pytest.raises(TypeError):
        shell.echo(1, 2, 3)  # c is keyword-only, on the shell as on the plain object


def test_only_the_counted_names_are_counted() -> None:
    shell = _shell()
    assert [shell.tally(n) for n in (1, 2, 3)] == [2, 3, 4]
    shell.echo(1)
    assert shell._calls == Counter({"tally": 3})


def test_a_forwarder_carries_the_protocols_signature_and_doc() -> None:
    echo = EchoShell.echo  # type: ignore[attr-defined]
    assert inspect.signature(echo) == inspect.signature(EchoCalls.echo)
    assert echo.__doc__ == EchoCalls.echo.__doc__
    assert (echo.__name__, echo.__qualname__) == ("echo", "EchoShell.echo")
    assert echo.__annotations__ == EchoCalls.echo.__annotations__


def test_a_method_the_shell_writes_itself_is_kept() -> None:
    @forwards(EchoCalls, to=Echo, held_as="_echo", lock="_lock")
    class Shell(EchoShell):
        def tally(self, n: int) -> int:
            return -n

    shell: Any = Shell()
    assert shell.tally(5) == -5
    assert shell.echo(1) == (1, "b", 1.5, True)


class MissingCalls(Protocol):
    def echo(self, a: int, b: str = "b", *, c: float = 1.5) -> tuple[Any, ...]: ...

    def vanished(self) -> None: ...


def test_a_protocol_method_the_plain_class_lacks_is_refused() -> None:
    with pytest.raises(TypeError, match=r"MissingCalls\.vanished has no implementation"):
        forwards(MissingCalls, to=Echo, held_as="_echo", lock="_lock")


class RenamedCalls(Protocol):
    def echo(self, a: int, bee: str = "b", *, c: float = 1.5) -> tuple[Any, ...]: ...


class OtherDefaultCalls(Protocol):
    def echo(self, a: int, b: str = "B", *, c: float = 1.5) -> tuple[Any, ...]: ...


class PositionalCCalls(Protocol):
    def echo(self, a: int, b: str = "b", c: float = 1.5) -> tuple[Any, ...]: ...


class ExtraCalls(Protocol):
    def echo(self, a: int, b: str = "b", *, c: float = 1.5, d: int = 0) -> tuple[Any, ...]: ...


@pytest.mark.parametrize(
    "protocol", [RenamedCalls, OtherDefaultCalls, PositionalCCalls, ExtraCalls]
)
def test_a_signature_that_differs_from_the_plain_class_is_refused(protocol: type) -> None:
    message = rf"the implementation Echo\.echo\(.* differs from {protocol.__name__}\.echo\("
    with pytest.raises(TypeError, match=message):
        forwards(protocol, to=Echo, held_as="_echo", lock="_lock")


def test_a_hand_written_method_that_differs_from_the_protocol_is_refused() -> None:
    with pytest.raises(TypeError, match=r"the shell's Shell\.tally\(self, count\) differs"):

        @forwards(EchoCalls, to=Echo, held_as="_echo", lock="_lock")
        class Shell:
            def tally(self, count):  # type: ignore[no-untyped-def]
                return count


def test_counting_a_name_outside_the_protocol_is_refused() -> None:
    with pytest.raises(TypeError, match="counted but not methods"):
        forwards(EchoCalls, to=Echo, held_as="_e", lock="_l", counted=("ech",), counter="_c")
    with pytest.raises(TypeError, match="go together"):
        forwards(EchoCalls, to=Echo, held_as="_e", lock="_l", counted=("echo",))


def test_a_protocols_methods_include_its_protocol_bases() -> None:
    assert list(remote_methods(DirectoryShardCalls)) == ["lookup", "sync"]
    assert "echo" in remote_methods(EchoCalls) and "__init__" not in remote_methods(EchoCalls)


def _shape_as_ray_binds(method: Any) -> list[tuple[str, Any, Any]]:
    # Ray adds a keyword-only ``_ray_trace_ctx`` to every actor method it wraps.
    return [entry for entry in call_shape(method) if not entry[0].startswith("_ray_")]


@pytest.mark.parametrize(
    ("actor", "protocol"),
    [
        (StorageNodeActor, StorageNodeCalls),
        (MetaShardActor, MetaShardCalls),
        (SWAEntrypointActor, DirectoryShardCalls),
    ],
)
def test_the_ray_shells_answer_every_call_of_their_protocol(actor: Any, protocol: type) -> None:
    shell = actor.__ray_actor_class__  # the class as written, before Ray's wrapping
    for name, declared in remote_methods(protocol).items():
        assert _shape_as_ray_binds(getattr(shell, name)) == call_shape(declared), name
