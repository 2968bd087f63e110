"""Every fenced code block in ``docs/*.md`` and ``README.md`` runs on CPU, so the docs cannot rot.

Per Markdown file, in document order, in one child process whose working directory is a fresh
temporary folder (holding a link to the repository's ``configs/``):

* ```` ```python ```` blocks run in one shared namespace (a later block sees an earlier one's names);
* ```` ```bash ```` blocks run through ``bash -e``: ``pip install`` steps are dropped (the package
  is installed already), and a ``lightning-moe fit`` gets :data:`FIT_OVERRIDES` appended for every
  option it does not set itself, so a recipe trains for two steps instead of hundreds;
* ```` ```yaml ```` blocks must parse; ```` ```text ```` blocks are output and are not run.

A block preceded by ``<!-- skip-test: reason -->`` is not run (a GPU, more than two ranks, the test
suite itself); :data:`MAX_SKIPPED` bounds how many there are. ``torchrun`` lines must carry the
marker, since a torchrun job of more than two CPU ranks does not fit the time of a unit test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

__all__: list[str] = []

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
LANGUAGES = ("python", "bash", "yaml", "text")
SKIP_MARKER = "<!-- skip-test"
MAX_SKIPPED = 8
FILE_TIMEOUT_S = 540  # below the suite's 600 s per-test timeout
FIT_OVERRIDES = {
    "--trainer.max_steps": "2",
    "--trainer.limit_val_batches": "1",
    "--trainer.val_check_interval": "2",
    "--trainer.enable_progress_bar": "false",
    "--data.max_bytes": "200000",
}

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts (1-based line of the opening fence) and its text."""

    path: str
    line: int
    lang: str
    text: str
    skip: str | None  # the marker's reason, or None when the block runs


def extract_blocks(markdown: str, path: str = "<doc>") -> list[Block]:
    """All fenced blocks of ``markdown``; a ``<!-- skip-test: why -->`` line just above marks one skipped."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: code block is never closed; add a closing ``` line.")
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = None
        if before.startswith(SKIP_MARKER):
            skip = before[len(SKIP_MARKER) :].removesuffix("-->").strip(" :") or "no reason given"
        blocks.append(Block(path, start + 1, opening.group(1), "\n".join(body) + "\n", skip))
        i += 1
    return blocks


def _logical_lines(script: str) -> list[str]:
    """Lines of a shell script with backslash continuations joined."""
    out, pending = [], ""
    for raw in script.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append(pending + raw)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a blank or at the start)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line


def _with_fit_overrides(command: str) -> str:
    words = shlex.split(command)
    if words[:2] != ["lightning-moe", "fit"] or "--print_config" in " ".join(words):
        return command
    given = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    extra = [f"{key}={value}" for key, value in FIT_OVERRIDES.items() if key not in given]
    return " ".join([command, *extra])


def shell_for_test(script: str, where: str = "<block>", seen: set[str] | None = None) -> str:
    """The shell text the test runs for a ```bash block (see the module docstring).

    ``seen`` collects the commands of earlier blocks of the same file; a command already run there
    is not run again (a page may repeat its first command where it explains it).
    """
    seen = set() if seen is None else seen
    out = []
    for line in _logical_lines(script):
        line = _strip_comment(line)
        if not line.strip():
            continue
        if line.split()[0] == "torchrun":
            raise ValueError(f"{where}: a torchrun line must be marked with {SKIP_MARKER}: reason --> above its block.")
        steps = [s.strip() for s in line.split("&&")]
        kept = [_with_fit_overrides(s) for s in steps if not re.match(r"^(python3? -m )?pip3? install\b", s)]
        kept = [s for s in kept if " ".join(s.split()) not in seen]
        seen.update(" ".join(s.split()) for s in kept)
        if kept:
            out.append(" && ".join(kept))
    return "\n".join(out) + "\n"


# Runs in the child: blocks from a JSON file, in order, in the current directory.
_RUNNER = r"""
import json, subprocess, sys, time, traceback
import yaml

blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
ran = 0
for b in blocks:
    where = f"{b['path']}:{b['line']}"
    print(f"--- {where} ({b['lang']})", flush=True)
    t0 = time.perf_counter()
    if b["lang"] == "python":
        try:
            exec(compile(b["text"], where, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: the python block at {where}", flush=True)
            sys.exit(1)
    elif b["lang"] == "bash":
        print(b["shell"], flush=True)
        rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b["shell"]]).returncode
        if rc != 0:
            print(f"FAILED: the bash block at {where} exited with {rc}", flush=True)
            sys.exit(1)
    elif b["lang"] == "yaml":
        yaml.safe_load(b["text"])
    ran += 1
    print(f"--- {where} done in {time.perf_counter() - t0:.1f} s", flush=True)
print(f"ran {ran} blocks", flush=True)
"""


def _doc_blocks() -> dict[Path, list[Block]]:
    return {p: extract_blocks(p.read_text(), str(p.relative_to(ROOT))) for p in DOC_FILES}


def test_every_block_names_a_known_language() -> None:
    bad = [f"{b.path}:{b.line} ```{b.lang}" for bs in _doc_blocks().values() for b in bs if b.lang not in LANGUAGES]
    assert not bad, f"tag every block with one of {LANGUAGES} (```text for output): {bad}"


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [b for bs in _doc_blocks().values() for b in bs if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.path}:{b.line} ({b.skip})" for b in skipped]
    assert all(b.skip != "no reason given" for b in skipped), [f"{b.path}:{b.line}" for b in skipped]


def test_extract_blocks_honours_the_skip_marker() -> None:
    md = "x\n```python\na = 1\n```\n<!-- skip-test: needs 8 GPUs -->\n\n```bash\ntorchrun x\n```\n"
    blocks = extract_blocks(md)
    assert [(b.line, b.lang, b.skip) for b in blocks] == [(2, "python", None), (7, "bash", "needs 8 GPUs")]
    assert blocks[0].text == "a = 1\n"
    with pytest.raises(ValueError, match="never closed"):
        extract_blocks("```python\nx = 1\n")


def test_shell_for_test_drops_installs_and_shortens_fits() -> None:
    script = (
        "pip install torch==2.13.0 && pip install -e . && lightning-moe fit --config c.yaml  # one process\n"
        "lightning-moe fit --config c.yaml --trainer.max_steps=4 \\\n  --print_config\n"
        "lightning-moe fit --config c.yaml --trainer.max_steps=4\n"
    )
    lines = shell_for_test(script).splitlines()
    assert lines[0] == "lightning-moe fit --config c.yaml " + " ".join(f"{k}={v}" for k, v in FIT_OVERRIDES.items())
    assert lines[1].split() == "lightning-moe fit --config c.yaml --trainer.max_steps=4 --print_config".split()
    assert "--trainer.max_steps=2" not in lines[2] and "--trainer.limit_val_batches=1" in lines[2]
    with pytest.raises(ValueError, match="torchrun"):
        shell_for_test("torchrun --nproc_per_node=8 x.py\n")
    seen: set[str] = set()
    assert shell_for_test("lightning-moe recipes\n", seen=seen) == "lightning-moe recipes\n"
    assert shell_for_test("lightning-moe  recipes  # again\n", seen=seen) == "\n"


def _run_file(doc: Path, blocks: list[Block], tmp_path: Path) -> None:
    todo, seen = [], set()
    for b in blocks:
        if b.skip is not None or b.lang == "text":
            continue
        entry = asdict(b)
        if b.lang == "bash":
            entry["shell"] = shell_for_test(b.text, f"{b.path}:{b.line}", seen)
        todo.append(entry)
    if not todo:
        pytest.skip(f"{doc.name} has no block to run")
    (tmp_path / "blocks.json").write_text(json.dumps(todo))
    (tmp_path / "runner.py").write_text(_RUNNER)
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    # A page runs as a user's fresh process: an earlier in-process fit of this pytest run leaves
    # Lightning's MASTER_PORT (and friends) in os.environ, on a port that may still be held here.
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        env.pop(name, None)
    try:
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=FILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"{doc.name}: blocks ran past {FILE_TIMEOUT_S} s\n{out[-6000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{doc.name}: a code block failed\n{out[-8000:]}"
    assert f"ran {len(todo)} blocks" in proc.stdout, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_code_blocks_run(doc: Path, tmp_path: Path) -> None:
    _run_file(doc, _doc_blocks()[doc], tmp_path)
