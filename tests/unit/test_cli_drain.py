"""`kvstore drain` / `undrain` and `kvstore status --watch` / `stats` at the command line:
help that explains what a drain does, one-line errors for bad input (nothing started), an
unreachable cluster named, and the watch / stats output against a stand-in gateway client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from fake_repair import FakeRepair

from kvstore.cli import build_parser, main
from kvstore.tier.records import Stats

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


def help_of(*argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_drain_help_says_what_a_drain_does(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of("drain", capsys=capsys)
    for words in (
        "moves every shard it holds to other nodes",
        "keeps all 12 of its shards",
        "stops taking new writes",
        "safe to stop it",
        "kvstore undrain NODE",
        "Ctrl-C here only stops watching",
        "--no-wait",
        "--timeout S",
        "--address ADDR",
        "--deployment NAME",
        "--json",
    ):
        assert words in text, words
    assert "back in service" in help_of("undrain", capsys=capsys)
    status = help_of("status", capsys=capsys)
    assert "--watch" in status and "--interval S" in status and "--count N" in status


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (("drain",), "NODE"),
        (("drain", "three"), "NODE"),
        (("drain", "-1"), "NODE"),
        (("undrain", "x"), "NODE"),
        (("drain", "3", "--timeout", "0"), "--timeout"),
        (("drain", "3", "--timeout", "nan"), "--timeout"),
        (("drain", "3", "--timeout", "5", "--no-wait"), "--timeout"),
        (("drain", "3", "--address", "nohostport"), "--address"),
        (("undrain", "3", "--address", "nohostport"), "--address"),
        (("status", "--watch", "--interval", "0"), "--interval"),
        (("status", "--watch", "--count", "0"), "--count"),
        (("status", "--interval", "2"), "--interval"),
        (("status", "--count", "2"), "--count"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else value,
)
def test_bad_input_is_one_line_naming_it(
    argv: tuple[str, ...], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(list(argv))
    except SystemExit as error:  # argparse's own errors
        code = int(error.code or 0)
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "error" in lines[0] and word in lines[0], captured.err


def test_an_unreachable_cluster_is_named() -> None:
    # Port 1 on loopback: nothing listens (a fresh process, not connected to Ray).
    for command in ("drain", "undrain"):
        result = run_cli(command, "3", "--address", "127.0.0.1:1")
        assert result.returncode == 1, result.stderr
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "no kvstore cluster at 127.0.0.1:1" in lines[0], result.stderr


# --- status --watch and stats against a stand-in client --------------------------------------


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def stats_with(repair: dict[str, Any] | None, live: int = 13) -> Stats:
    extra = {} if repair is None else {"repair": repair}
    return Stats(storage_nodes=13, live_storage_nodes=live, repairs_done=7, extra=extra)


class FakeClient:
    def __init__(self, answers: list[Stats | Exception]) -> None:
        self.answers = answers

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def serving(self) -> bool:
        return True

    def stats(self) -> Stats:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def progress(left: int, moving: int = 0) -> dict[str, Any]:
    return {
        "stripes": 1,
        "progress": {
            "stripes_left": left,
            "bytes_left": left * 1_000_000,
            "lost_2": 0,
            "lost_1": left - moving,
            "moving": moving,
            "rate_bytes_per_s": 20e6,
            "eta_s": left / 20,
        },
        "draining": {"4": {"stripes_left": moving, "bytes_left": moving * 10**6, "done": False}},
        "scrub": {"shards": 10, "bytes": 5_000_000, "corrupt": 0, "rate_bytes_per_s": 1e6},
    }


def use(monkeypatch: pytest.MonkeyPatch, module: str, client: FakeClient) -> None:
    monkeypatch.setattr(f"kvstore.commands.{module}.connect", lambda args: client)


def test_status_watch_prints_count_updates_with_a_progress_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(
        monkeypatch,
        "status",
        FakeClient([stats_with(progress(100, 40)), stats_with(progress(50, 20))]),
    )
    assert main(["status", "--watch", "--count", "2", "--interval", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "13/13 storage nodes live" in lines[0] and "[----------" in lines[0]
    assert "100 stripes / 100.0 MB left" in lines[0] and "draining node 4: 40 stripes" in lines[0]
    assert "[##########----------]  50%" in lines[1] and "ETA 2 s" in lines[1]


def test_status_watch_json_lines_and_a_gateway_lost_mid_watch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, "status", FakeClient([stats_with(None, live=9), Unavailable()]))
    assert main(["status", "--watch", "--count", "3", "--interval", "0.01", "--json"]) == 1
    lines = capsys.readouterr().out.splitlines()
    first = json.loads(lines[0])
    assert first["healthy"] is False and first["repair"] is None and first["draining"] == {}
    assert "not answering" in lines[1] and "connection refused" in lines[1]
    assert len(lines) == 3


def test_status_watch_refuses_a_gateway_that_never_answered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, "status", FakeClient([Unavailable()]))
    assert main(["status", "--watch", "--count", "5", "--interval", "0.01"]) == 1
    err = capsys.readouterr().err
    assert "no kvstore gateway answering at 127.0.0.1:50051" in err


def test_status_watch_stops_cleanly_on_ctrl_c(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, "status", FakeClient([stats_with(progress(0))]))

    def interrupt(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvstore.commands.status.time.sleep", interrupt)
    assert main(["status", "--watch"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1 and "nothing to restore or move" in captured.out
    assert "Traceback" not in captured.err


def test_stats_prints_repair_drain_and_scrub_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, "stats", FakeClient([stats_with(progress(30, 10))]))
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert (
        "repair progress    30 stripes / 30.0 MB left (lost 2: 0, lost 1: 20, moving: 10), "
        "20.0 MB/s, ETA 2 s"
    ) in out
    assert "draining           node 4: 10 stripes / 10.0 MB left" in out
    assert "scrub              10 shards / 5.0 MB verified, 0 corrupt, 1.0 MB/s" in out


def test_stats_without_repair_figures_shows_n_a(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use(monkeypatch, "stats", FakeClient([stats_with(None)]))
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert "repair progress    n/a" in out and "scrub              n/a" in out
    assert "draining" not in out


# --- drain / undrain against a stand-in repair actor ------------------------------------------


def fake_cluster(monkeypatch: pytest.MonkeyPatch, repair: FakeRepair) -> None:
    from kvstore.runtime import drain

    live = drain.LiveRepair("kvstore", repair, tuple(range(13)))
    monkeypatch.setattr(drain, "attach", lambda address, deployment: live)
    monkeypatch.setattr(drain, "DRAIN_POLL_S", 0.01)  # the command reads it per call


def test_drain_watches_to_done_with_a_bar_on_stderr_and_json_on_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repair = FakeRepair(stripes=40, per_look=20)
    fake_cluster(monkeypatch, repair)
    assert main(["drain", "3", "--json"]) == 0
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    assert status["node"] == 3 and status["done"] and status["stripes_left"] == 0
    assert "draining node 3" in captured.err and "40/40 stripes" in captured.err
    assert main(["undrain", "3"]) == 0
    assert "node 3 back in service" in capsys.readouterr().out
    assert repair.left == {}


def test_ctrl_c_stops_watching_and_says_how_to_resume(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repair = FakeRepair(stripes=40, per_look=20, interrupt=True)
    fake_cluster(monkeypatch, repair)
    assert main(["drain", "3", "--deployment", "prod", "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "goes on draining in the background" in captured.err
    assert "kvstore drain 3 --deployment prod" in captured.err
    assert "kvstore undrain 3 --deployment prod" in captured.err
    assert repair.left == {3: 40}  # nothing undone


def test_no_wait_returns_at_once_and_a_bad_node_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_cluster(monkeypatch, FakeRepair(stripes=40, per_look=20))
    assert main(["drain", "3", "--no-wait"]) == 0
    assert "node 3 draining: 40 stripes" in capsys.readouterr().out
    assert main(["drain", "13"]) == 2
    err = capsys.readouterr().err
    assert "NODE: no storage node 13 in deployment 'kvstore' (nodes: 0-12)" in err
