"""One result row per chaos scenario, and the table / JSON that ``kvstore chaos`` prints.

Columns (the promise each scenario is held to is in ``violations``):

- faults: faults injected (kills, crashes, corrupted files, ...);
- ops: block/state operations issued while the scenario ran (puts, gets, lookups);
- reads ok: reads of committed data that came back bit-exact;
- failed: reads of committed data that missed although the promise covers them (must be 0);
- wrong: reads that returned bytes other than those committed (must be 0, always);
- misses: reads that missed by design (a 3rd machine of a stripe lost, a machine's SWA states,
  blocks expired by GC) — expected, never errors;
- lost: committed blocks the promise covers that were not readable at the end (must be 0);
- detect s / repair s: fault to detection, detection (or restart) to full health.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ScenarioResult:
    name: str
    summary: str
    faults: int = 0
    operations: int = 0
    reads_ok: int = 0
    failed_reads: int = 0
    wrong_bytes: int = 0
    expected_misses: int = 0
    blocks_lost: int = 0
    detect_s: float | None = None
    repair_s: float | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and self.wrong_bytes == 0
            and self.blocks_lost == 0
            and self.failed_reads == 0
        )

    def require(self, condition: bool, message: str) -> bool:
        """Record a broken promise unless ``condition`` holds; returns ``condition``."""
        if not condition:
            self.violations.append(message)
        return condition

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        for name in ("detect_s", "repair_s", "seconds"):
            if data[name] is not None:
                data[name] = round(float(data[name]), 3)
        return data


_COLUMNS = (
    ("scenario", 14, "<"),
    ("faults", 6, ">"),
    ("ops", 7, ">"),
    ("reads ok", 9, ">"),
    ("failed", 6, ">"),
    ("wrong", 5, ">"),
    ("misses", 6, ">"),
    ("lost", 4, ">"),
    ("detect s", 8, ">"),
    ("repair s", 8, ">"),
    ("result", 6, "<"),
)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(results: list[ScenarioResult]) -> str:
    header = " ".join(f"{title:{align}{width}}" for title, width, align in _COLUMNS)
    lines = [header, "-" * len(header)]
    for row in results:
        cells = (
            row.name,
            row.faults,
            row.operations,
            row.reads_ok,
            row.failed_reads,
            row.wrong_bytes,
            row.expected_misses,
            row.blocks_lost,
            _seconds(row.detect_s),
            _seconds(row.repair_s),
            "PASS" if row.ok else "FAIL",
        )
        lines.append(
            " ".join(
                f"{str(cell):{align}{width}}"
                for cell, (_, width, align) in zip(cells, _COLUMNS, strict=True)
            )
        )
    total_wrong = sum(r.wrong_bytes for r in results)
    total_lost = sum(r.blocks_lost for r in results)
    lines.append("-" * len(header))
    lines.append(
        f"wrong bytes {total_wrong}, committed blocks lost {total_lost}, "
        f"{sum(r.ok for r in results)}/{len(results)} scenarios kept every promise"
    )
    for row in results:
        for violation in row.violations:
            lines.append(f"  {row.name}: BROKEN: {violation}")
    return "\n".join(lines)


def to_json(results: list[ScenarioResult], extra: dict[str, Any] | None = None) -> str:
    document = {
        "scenarios": [r.as_dict() for r in results],
        "wrong_bytes": sum(r.wrong_bytes for r in results),
        "committed_blocks_lost": sum(r.blocks_lost for r in results),
        "ok": all(r.ok for r in results),
        **(extra or {}),
    }
    return json.dumps(document, indent=2, default=str)
