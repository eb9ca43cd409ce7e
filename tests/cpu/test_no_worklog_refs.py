"""No tracked file cites an internal work-log reference: a numbered stop of the work log or a numbered issue of
the tracker the project was built against. A reader cannot look either up, so a comment, docstring or document
states the measured fact itself (its number, its GPU, and where a result lives under benchmarks/results/), and
file names carry no such number either.

Checked: every tracked file's path, and the text of every tracked file that is not binary. Needs git and the
repository's .git folder (an sdist has neither: the test is skipped there)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Built from parts so that this file holds no literal match of its own patterns.
# A word's start: no letter before it (an underscore may be: "h200_stopNN.json").
_START, _NUMBER = r"(?<![a-z])", r"[ _-]?#?\d+(?!\d)"
PATTERNS = {
    "work-log stop": re.compile(_START + "st" + "ops?" + _NUMBER, re.IGNORECASE),
    "issue number": re.compile(_START + "iss" + "ue" + _NUMBER + "|" + _START + "iss" + r"ues #\d+", re.IGNORECASE),
    # "#N" only where it reads as a reference: "(#N)", "see #N", "PR #N", "fixes #N"; never a "#222" colour
    "#N reference": re.compile(r"\(#\d+\)|\b(?:see|in|pr|pull|fixes|fixed|closes|closed)\s+#\d+\b", re.IGNORECASE),
}


def hits(text: str) -> list[tuple[int, str, str]]:
    """``(line number, pattern name, matched text)`` of every work-log reference in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in PATTERNS.items():
            found += [(number, name, m.group(0)) for m in pattern.finditer(line)]
    return found


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and the repository's .git folder (not there in an sdist)")
    run = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if run.returncode != 0:
        pytest.skip(f"git ls-files failed: {run.stderr.decode(errors='replace').strip()}")
    return [name for name in run.stdout.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file's text, or ``None`` for a binary file (a NUL byte, or not UTF-8) or one not in the work tree."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_cites_a_worklog_reference():
    problems = []
    for name in tracked_files():
        problems += [f"{name}: file name: {match!r} ({kind})" for _, kind, match in hits(name)]
        text = text_of(ROOT / name)
        if text is not None:
            problems += [f"{name}:{line}: {match!r} ({kind})" for line, kind, match in hits(text)]
    if problems:
        pytest.fail(f"{len(problems)} work-log references (state the fact itself, or drop the reference):\n"
                    + "\n".join(problems), pytrace=False)


def test_the_patterns_find_references_and_leave_prose_and_code_alone():
    stop, issue = "st" + "op", "iss" + "ue"
    cited = [f"(53 s, {stop} 48)", f"before {stop} 49", f"{stop.capitalize()} 36 (H200)", f"h200_{stop}36_run.json",
             f"{stop}s 40-41", f"({issue} 22)", f"{issue} #7", f"{issue}s #7", "fixed in #" + "12", "(#" + "12)"]
    plain = ["decode step 1", "a stop id", "stop_ids(eos)", f"it {issue}s 2 kernels", "color:#222", "&#9656;",
             "nonstop 5", "backstop 3", "step 31 of 40 ran", "# noqa: BLE001", "row #3 of the table"]
    assert [c for c in cited if not hits(c)] == []
    assert [p for p in plain if hits(p)] == []
