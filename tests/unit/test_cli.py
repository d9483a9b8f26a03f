"""Generic ``kvstore`` command-line behaviour: help, discovery, one-line usage errors."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys

import pytest

import kvstore
import kvstore.commands
from kvstore.cli import build_parser, main


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: kvstore")
    names = [
        info.name
        for info in pkgutil.iter_modules(kvstore.commands.__path__)
        if not info.name.startswith("_")
    ]
    assert "plan" in names
    for name in names:
        module = importlib.import_module(f"kvstore.commands.{name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            assert module.NAME in result.stdout


def test_every_command_module_follows_the_protocol():
    for info in pkgutil.iter_modules(kvstore.commands.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvstore.commands.{info.name}")
        if not hasattr(module, "NAME"):
            continue
        assert isinstance(module.NAME, str) and module.NAME
        assert isinstance(module.HELP, str) and "\n" not in module.HELP
        assert callable(module.add_arguments) and callable(module.run)


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvstore {kvstore.__version__}"


def test_command_help_exits_0():
    result = run_cli("plan", "--help")
    assert result.returncode == 0
    assert "--prompt-len" in result.stdout
    assert "L − 134" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ("frobnicate",),
        (),
        ("--no-such-flag",),
        ("plan", "--no-such-flag"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv):
    result = run_cli(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvstore")
    assert "error:" in lines[0]


def test_unknown_command_names_it(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["frobnicate"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "frobnicate" in err and err.count("\n") == 1


def test_parser_is_built_fresh_each_time():
    # No module-level parser state: two builds are independent objects with the same commands.
    first, second = build_parser(), build_parser()
    assert first is not second
    choices = [
        action.choices
        for action in first._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    assert choices and "plan" in choices[0]


@pytest.mark.parametrize(
    ("cpus", "shards"), [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (96, 8)]
)
def test_up_sizes_its_meta_shards_to_the_cluster(cpus: int, shards: int) -> None:
    from kvstore.commands.up import meta_shards_for

    assert meta_shards_for(cpus) == shards
