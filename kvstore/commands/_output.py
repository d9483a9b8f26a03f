"""What a command run with ``--json`` prints: one JSON document on stdout, and nothing else.

``kvstore.cli`` runs every command whose arguments have ``json`` set inside ``json_stdout()``.
While the command runs, everything that would reach stdout goes to stderr instead, at both
levels it can take:

- Python's ``sys.stdout`` is ``sys.stderr``: ``print``, progress lines, and what Ray's driver
  threads print (they look ``sys.stdout`` up at each call: ``listen_error_messages`` prints the
  raylet's warnings, "N PYTHON worker processes have been started ...", and with
  ``log_to_driver`` the workers' forwarded output; ``ray.shutdown`` flushes the deduplicated
  "[repeated Nx across cluster]" lines);
- file descriptor 1 is a duplicate of descriptor 2 (``dup2``): whatever writes to the
  descriptor itself (C++ code, ``os.write(1, ...)``) and every process the command starts
  (Ray's GCS, raylets and workers, benchmarks, ``subprocess``), which inherits descriptor 1 as
  it is at fork. A child that got the real stdout would also hold the pipe open after the
  command ended (``kvstore replay --json | jq`` waiting on Ray's processes), so it must not get
  it: the real stdout is kept in a descriptor of its own, which ``os.dup`` makes
  non-inheritable (close-on-exec), so no child ever has it.

The command hands its document to ``print_json`` / ``print_document``, which keep it; when the
command is done, Ray is shut down if the command connected it (so nothing Ray flushes at exit
reaches stdout), stdout is put back and the document is written to it, once. A second document
is a bug of the command (``RuntimeError``). A command that streams (``status --watch --json``,
one JSON document per line) writes each line at once with ``print_json_line``.

Without ``json_stdout()`` (a command without ``--json``, or called outside the CLI) these print
to ``sys.stdout`` as ``print`` does.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from typing import Any, TextIO


class _Session:
    """The real stdout while a ``--json`` command runs, and the document it printed."""

    def __init__(self, stdout: TextIO) -> None:
        self.stdout = stdout
        self.document: str | None = None
        self.streamed = False


_session: _Session | None = None


def print_document(text: str) -> None:
    """``text`` (JSON already serialized) is the command's one document on stdout."""
    if _session is None:
        print(text)
        return
    if _session.document is not None or _session.streamed:
        raise RuntimeError("a --json command printed a second JSON document on stdout")
    _session.document = text


def print_json(value: Any) -> None:
    """``value`` as the command's one JSON document (indented, keys sorted)."""
    print_document(json.dumps(value, indent=2, sort_keys=True, default=str))


def print_json_line(value: Any) -> None:
    """One JSON document on one line of stdout, now (a stream of updates: JSON Lines)."""
    line = json.dumps(value, sort_keys=True, default=str)
    if _session is None:
        print(line, flush=True)
        return
    if _session.document is not None:
        raise RuntimeError("a --json command printed a JSON line after its document")
    _session.streamed = True
    _session.stdout.write(line + "\n")
    _session.stdout.flush()


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # never imported: never connected (and not imported here)
    return ray is not None and bool(ray.is_initialized())


def _shutdown_ray() -> None:
    """Disconnect Ray while stdout still goes to stderr: it prints the deduplicated worker
    lines it held back, and its atexit hook would otherwise do it after the document."""
    import ray

    try:
        ray.shutdown()
    except Exception as error:  # the command's result stands; say why Ray did not stop
        print(f"kvstore: Ray did not shut down cleanly: {error}", file=sys.stderr)


@contextmanager
def json_stdout() -> Iterator[None]:
    """Run a ``--json`` command: stdout (``sys.stdout`` and descriptor 1, for this process and
    every child it starts) goes to stderr until the end, then the one document to stdout.

    Ray is shut down at the end if the command connected it: in ``kvstore`` that is always the
    case, and only then is nothing left to print afterwards. A caller already connected to Ray
    (a test process running commands in-process) stays connected, and what Ray prints later is
    the caller's."""
    global _session
    if _session is not None:  # nested (a command running another): the outer one owns stdout
        yield
        return
    real_stdout = sys.stdout
    real_stdout.flush()
    sys.stderr.flush()
    saved_fd = os.dup(1)  # non-inheritable: no child gets the real stdout
    was_connected = _ray_connected()
    session = _Session(real_stdout)
    _session = session
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            try:
                yield
            finally:
                if not was_connected and _ray_connected():
                    _shutdown_ray()
                sys.stderr.flush()
    finally:
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        _session = None
        if session.document is not None:
            real_stdout.write(session.document + "\n")
            real_stdout.flush()
