"""The ``kvstore`` command line.

Each sub-command lives in its own module under ``kvstore/commands/`` and is discovered here, so
adding a command never edits this file. A command module defines:

    NAME: str                      the sub-command word
    HELP: str                      one line for ``kvstore --help``
    DESCRIPTION: str               the paragraph for ``kvstore NAME --help``
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int      exit status

Bad arguments print one line naming the argument and exit with status 2; a ``KVStoreError``
raised by a command is printed the same way (its message names the field).

A command run with ``--json`` prints exactly one JSON document on stdout and nothing else: it
runs inside ``kvstore.commands._output.json_stdout()``, which sends everything else (its own
progress, Ray's forwarded worker output and warnings, its child processes) to stderr and writes
the document the command handed to ``print_json`` / ``print_document`` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from kvstore import __version__
from kvstore.commands._output import json_stdout
from kvstore.errors import ConfigError, InvalidArgument, KVStoreError

USAGE_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (``kvstore CMD: error: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _command_modules() -> list[ModuleType]:
    import kvstore.commands as package

    modules = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda item: item.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            modules.append(module)
    return modules


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="kvstore",
        description=(
            "kvstore: an erasure-coded KV-cache storage tier for DeepSeek-V4-class inference "
            "fleets (block KV + sliding-window state), with exact prefix-hit planning."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineErrorParser
    )
    commands.required = True
    for module in sorted(_command_modules(), key=lambda m: m.NAME):
        sub = commands.add_parser(
            module.NAME,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run, _prog=sub.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with json_stdout() if getattr(args, "json", False) else contextlib.nullcontext():
            return int(args._run(args))
    except (InvalidArgument, ConfigError) as error:
        print(f"{args._prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KVStoreError as error:
        print(f"{args._prog}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{args._prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
