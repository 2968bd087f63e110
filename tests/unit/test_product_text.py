"""Product text describes the software: no development-process talk, no commit hashes.

Code, comments, docstrings, tests and docs say what the software does and what was measured (date,
machine, command). They never name work sessions, issue numbers, "device time" budgets or closing
notes, never point at files outside the repository, and never cite commit hashes. pytest's own
session scope (``scope="session"``, ``request.session``, "session-scoped fixture") is allowed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[2]
SCOPE = ("lightning_moe", "csrc", "tests", "docs", "benchmarks", "README.md")
SELF = Path(__file__).resolve()

PROCESS = re.compile(r"\bsessions?\b|device time|issue [0-9]|closing note", re.IGNORECASE)
PYTEST_SESSION = re.compile(r"""scope=["']session["']|request\.session|session-scoped""")
OUTSIDE_FILES = re.compile(r"\b(DESIGN|BENCHMARKS|ARCHITECTURE|STYLE)\.md\b|\.\./shared\b|\bSTYLE (rule|convention)\b")
# A commit hash: 7-12 lowercase hex characters with at least one digit and one letter.
HEX = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")


def _tracked_files() -> list[Path]:
    """The tracked text files in scope (``git ls-files``); a walk of the tree when git is absent."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *SCOPE], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for s in SCOPE for p in ([ROOT / s] if (ROOT / s).is_file() else (ROOT / s).rglob("*"))]
    return [p for p in paths if p.is_file() and "__pycache__" not in p.parts and p.resolve() != SELF]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary


def process_talk(text: str) -> list[str]:
    """The lines of ``text`` that talk about the development process rather than the software."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        rest = PYTEST_SESSION.sub("", line)
        if PROCESS.search(rest) or OUTSIDE_FILES.search(rest) or HEX.search(rest):
            hits.append(f"{number}: {line.strip()[:160]}")
    return hits


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("# measured in the twelfth session (2026-11-30)", True),
        ("Not yet measured: the device time ran out.", True),
        ("see issue 8 for the protocol", True),
        ("the closing note lists the GPU tests", True),
        ("reverted next (ce7c893)", True),
        ("the protocol of ../shared/BENCHMARKS.md", True),
        ("the only place that builds groups (STYLE rule 2)", True),
        ('@pytest.fixture(scope="session")', False),
        ("for item in request.session.items:", False),
        ("takes the session-scoped fixture of that world size", False),
        ("Per-kernel GPU time over 2 steps (2026-11-30, 1x H200)", False),
        ("mask = 0x0000000000000004; max_bytes: 4000000; shape 16384", False),
    ],
)
def test_the_rules_flag_process_talk_and_leave_product_text(line: str, flagged: bool) -> None:
    assert bool(process_talk(line)) is flagged


def test_no_process_talk_or_commit_hashes_in_the_repository() -> None:
    files = _tracked_files()
    assert len(files) > 50, f"found only {len(files)} files under {SCOPE}; the walk is broken"
    hits = {}
    for path in files:
        text = _text(path)
        if text is not None and (found := process_talk(text)):
            hits[str(path.relative_to(ROOT))] = found
    assert not hits, "process talk or commit hashes (describe the software instead):\n" + "\n".join(
        f"{path}:{line}" for path, lines in sorted(hits.items()) for line in lines
    )
