"""The documents a user of the repository reads hold together: a short README with the two
commands, links that resolve inside the repository, no path to a file the repository does not
have, and every rules citation of the code naming a section docs/rules.md has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RULES = ROOT / "docs" / "rules.md"

#: The two commands, exactly (.ci/run runs the second one as it is written here).
INSTALL_AND_DEMO = "pip install torch==2.13.0 && pip install -e '.[dev,gpu]' && kvstore demo"
TESTS = "python3 -m pytest -q"

#: Names of files outside the repository, which no document may send a reader to.
FOREIGN = ("SPEC.md", "DESIGN.md", "MEASURED.md", "../shared", "/work/")

_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SECTION = re.compile(r"^## §(\d+)\b", re.MULTILINE)
_CITED = re.compile(r"§(\d+)")


def _linked_documents() -> list[Path]:
    """README.md, docs/**/*.md and the READMEs of the folders these pages link to."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [README, *docs, ROOT / "benchmarks" / "README.md", ROOT / "gpu" / "README.md"]


def _repository_files() -> list[Path]:
    """Every file of the repository that git does not ignore (a walk without hidden folders when
    this is not a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return [
            path
            for path in ROOT.rglob("*")
            if path.is_file() and not any(part.startswith(".") for part in path.parts)
        ]
    return [ROOT / name for name in listed.decode().split("\0") if name and (ROOT / name).is_file()]


def _without_code_blocks(text: str) -> str:
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def relative_links(text: str) -> list[str]:
    """The relative link targets of markdown ``[text](target)`` outside fenced code, without
    their ``#anchor``; web and mail links and in-page anchors are left out."""
    targets = []
    for _, target in _LINK.findall(_without_code_blocks(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def dead_links(document: Path, root: Path = ROOT) -> list[str]:
    """Links of ``document`` that name no file or folder under ``root`` (the repository)."""
    dead = []
    for target in relative_links(document.read_text(encoding="utf-8")):
        resolved = (document.parent / target).resolve()
        if not resolved.exists() or not resolved.is_relative_to(root):
            dead.append(target)
    return dead


def rules_sections() -> set[int]:
    return {int(number) for number in _SECTION.findall(RULES.read_text(encoding="utf-8"))}


def test_readme_is_short_and_has_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert INSTALL_AND_DEMO in text
    assert TESTS in text
    # .ci/run runs the README's test command, exactly.
    assert f"\n{TESTS}\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.parametrize("document", _linked_documents(), ids=lambda path: path.name)
def test_every_relative_link_resolves_in_the_repository(document: Path) -> None:
    assert document.is_file(), document
    assert dead_links(document) == [], document.relative_to(ROOT)


def test_the_link_check_finds_a_dead_link(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "elsewhere.md").touch()  # exists, but outside the repository
    page = repo / "page.md"
    page.write_text(
        "[ok](page.md#top) [web](https://example.com) [in page](#x) [gone](no/such/file.md)\n"
        "```\n[in code](not/checked.md)\n```\n[outside](../elsewhere.md)\n",
        encoding="utf-8",
    )
    assert dead_links(page, root=repo) == ["no/such/file.md", "../elsewhere.md"]


def test_no_document_and_no_product_file_names_a_file_outside_the_repository() -> None:
    files = _repository_files()
    checked = [path for path in files if path.suffix == ".md"]
    checked += [path for path in files if path.is_relative_to(ROOT / "kvstore")]
    assert len(checked) > 10
    found = []
    for path in checked:
        data = path.read_bytes()
        found += [f"{path.relative_to(ROOT)}: {name}" for name in FOREIGN if name.encode() in data]
    assert found == []


def test_rules_sections_are_numbered_from_one() -> None:
    sections = rules_sections()
    assert sections == set(range(1, max(sections) + 1))
    assert {2, 3, 4, 5, 6, 7, 8, 9, 10, 11} <= sections


def test_every_rules_citation_names_a_section_of_docs_rules() -> None:
    sections = rules_sections()
    citing = [path for path in _repository_files() if path.suffix in (".py", ".pyi", ".proto")]
    citing += _linked_documents()
    bad, citations = [], 0
    for path in citing:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "SPEC §" in text:
            bad.append(f"{path.relative_to(ROOT)}: SPEC §")
        cited = [int(number) for number in _CITED.findall(text)]
        if not cited:
            continue
        citations += len(cited)
        if path != RULES and "rules.md" not in text:
            bad.append(f"{path.relative_to(ROOT)}: cites § without naming docs/rules.md")
        bad += [f"{path.relative_to(ROOT)}: §{n}" for n in cited if n not in sections]
    assert citations > 50
    assert bad == []
