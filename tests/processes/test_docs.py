"""The docs: the guide's runnable code blocks run, and nothing in them points outside the repository.

Which blocks run (README.md and docs/**/*.md):

* a fenced block with a title -- ```` ```python title="my_task.py" ````, ```` ```yaml title="config.yaml" ```` -- is a
  file: it is written under that name into the page's temporary directory;
* a ```` ```python ```` or ```` ```bash ```` block on the line after ``<!-- docs-test: run -->`` runs there, after the
  page's files above it are written: python as a program, bash one ``cadence ...`` command per line (the comment
  after ``#`` dropped), as ``python -m cadence ...``; each must exit 0.

Each page with runnable blocks is one test; its blocks run in page order in one directory, each in a fresh process.
The site itself (links, anchors, the API reference) is checked by ``make docs``, which builds it with
``mkdocs build --strict`` in CI after ``make lint``.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUN_MARKER = "<!-- docs-test: run -->"
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)(?P<attrs>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    file_name: str | None  # a titled block: written as this file
    run: bool  # marked runnable
    line: int


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for fence in _FENCE.finditer(text):
        before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        title = _TITLE.search(fence["attrs"])
        found.append(Block(fence["lang"], fence["body"], title["title"] if title else None, before == RUN_MARKER,
                           text.count("\n", 0, fence.start()) + 1))
    return found


def runnable_pages() -> list[Path]:
    return [page for page in PAGES if any(block.run for block in blocks(page))]


def runnable_groups() -> dict[str, Path]:
    """The pages with runnable blocks, one per distinct set of files and runs (the README's quick start is the
    guide's, run once), keyed by the pages that share it."""
    groups: dict[tuple[tuple[str | None, str, bool], ...], list[Path]] = {}
    for page in runnable_pages():
        key = tuple((block.file_name, block.body, block.run) for block in blocks(page) if block.file_name or block.run)
        groups.setdefault(key, []).append(page)
    return {" = ".join(str(page.relative_to(ROOT)) for page in pages): pages[0] for pages in groups.values()}


def _cadence_commands(body: str) -> list[list[str]]:
    commands = []
    for line in body.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        assert words[0] == "cadence", f"a runnable bash block holds cadence commands only, not {line!r}"
        commands.append([sys.executable, "-m", "cadence", *words[1:]])
    return commands


def _run(command: list[str], cwd: Path, where: str) -> tuple[int, str]:
    """The command's exit status, and what to say when it is not 0 (where, the command, its output). It runs
    as a user's would, forked from the tests' zygote (:func:`cli_run.run_python`: the same process, without
    importing torch again), with this checkout's sources on the path."""
    from cli_run import run_python

    done = run_python(command[1:], cwd=cwd, timeout=240)
    return done.returncode, (f"{where}: {shlex.join(command[2:])} exited {done.returncode}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def test_runnable_blocks_are_marked_and_found() -> None:
    """The convention holds: a marker is always followed by a python or bash block, and some pages use it."""
    for page in PAGES:
        text = page.read_text()
        marked = [block for block in blocks(page) if block.run]
        assert text.count(RUN_MARKER) == len(marked), f"{page}: a {RUN_MARKER} not right before a fenced block"
        for block in marked:
            assert block.lang in ("python", "bash"), f"{page}:{block.line}: runnable blocks are python or bash"
    assert {page.name for page in runnable_pages()} >= {"README.md", "quickstart.md", "loop-and-actions.md"}


# a process per block (the processes tier)
@pytest.mark.parametrize("pages", list(runnable_groups()))
def test_runnable_blocks_run(pages: str, tmp_path: Path) -> None:
    page = runnable_groups()[pages]
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if block.file_name:
            (tmp_path / block.file_name).write_text(block.body)
        if not block.run:
            continue
        commands = ([[sys.executable, "-c", block.body]] if block.lang == "python"
                    else _cadence_commands(block.body))
        for command in commands:
            code, report = _run(command, tmp_path, where)
            assert code == 0, report


def test_nothing_points_outside_the_repository() -> None:
    """The docs and the README send users to files a clone has: no shared folder, no DESIGN.md outside it, and
    every relative link of the README (which the site build does not check) names a file in the repository."""
    for page in PAGES:
        text = page.read_text()
        for outside in ("DESIGN.md", "shared folder", "/work/"):
            assert outside not in text, f"{page.relative_to(ROOT)} mentions {outside!r}"
    readme = (ROOT / "README.md").read_text()
    for link in _LINK.finditer(readme):
        target = link["target"].split("#", 1)[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which the repository does not have"
