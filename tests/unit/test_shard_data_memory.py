"""A corpus ten times larger costs no more memory: TextDataModule(cache_dir=...) over 200 MB and 2 GB of text.

Each size is written to ``tmp_path`` (random words, one document a line, from a few 1 MiB blocks),
tokenized into shards by a byte-level tokenizer (ByT5's, on the numpy fast path) and iterated for
300 batches of 8 rows of 1024 tokens, in a child process whose peak resident set (``VmHWM``) is
the measure, so this process's own history does not count. The corpus and its shards are deleted
before the next size; the disk holds at most 2 GB of text and 4 GB of uint16 ids at once.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SIZES = (200 * 10**6, 2 * 10**9)
MAX_GROWTH_KB = 16 * 1024  # the 2 GB run's peak may exceed the 200 MB run's by this much at most
_WORDS = ("the quick brown fox jumps over a lazy dog while experts route tokens to gates and routers learn "
          "which one fits each token best").split()  # fmt: skip


def _write_corpus(path: Path, size: int) -> None:
    rng = random.Random(0)
    blocks = []
    for _ in range(8):
        lines, total = [], 0
        while total < 1 << 20:
            line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(50, 700)))
            lines.append(line)
            total += len(line) + 1
        blocks.append(("\n".join(lines) + "\n").encode())
    with path.open("wb") as fh:
        written = 0
        while written < size:
            block = blocks[rng.randrange(len(blocks))]
            fh.write(block)
            written += len(block)


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    from transformers import ByT5Tokenizer

    if shutil.disk_usage(tmp_path).free < 9 * 2**30:
        pytest.skip("needs 9 GiB of free disk for 2 GB of text and its 4 GB of token ids")
    tok_dir = tmp_path / "tok"
    ByT5Tokenizer().save_pretrained(tok_dir)
    reports = {}
    for size in SIZES:
        corpus, cache = tmp_path / "corpus.txt", tmp_path / "cache"
        _write_corpus(corpus, size)
        run = subprocess.run(
            [sys.executable, str(HERE / "_shard_rss_child.py"), str(tok_dir), str(corpus), str(cache), "300"],
            capture_output=True, text=True, timeout=540,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        reports[size] = json.loads(run.stdout.strip().splitlines()[-1])
        assert reports[size]["tokens"] >= size and reports[size]["labelled"] > 0.9 * 300 * 8 * 1024
        corpus.unlink()
        shutil.rmtree(cache)
    print(json.dumps(reports))  # the sizes, peaks and timings, shown with -s
    small, large = (reports[s] for s in SIZES)
    assert large["rows"] > 9 * small["rows"]
    growth = large["peak_rss_kb"] - small["peak_rss_kb"]
    assert growth <= MAX_GROWTH_KB, f"peak resident memory grew by {growth} kB from 200 MB to 2 GB: {reports}"
