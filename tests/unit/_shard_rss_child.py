"""Child process of the corpus-size memory test: shard a text corpus, iterate the train loader, report.

``python _shard_rss_child.py TOKENIZER_DIR CORPUS CACHE_DIR BATCHES`` builds ``TextDataModule`` with
``cache_dir`` over ``CORPUS`` (one document per line), runs ``prepare_data`` and ``setup``, draws
``BATCHES`` batches from the train loader and prints one JSON line: the peak resident memory
(``VmHWM`` of ``/proc/self/status``, kB), the tokens and rows, and the seconds each part took.
"""

from __future__ import annotations

import json
import sys
import time

from lightning_moe.data.text_datamodule import TextDataModule


def _peak_rss_kb() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(tokenizer_dir: str, corpus: str, cache_dir: str, batches: int) -> None:
    dm = TextDataModule(tokenizer_dir, corpus, format="text", text_unit="line", seq_len=1024, batch_size=8,
                        val_fraction=0.001, cache_dir=cache_dir)  # fmt: skip
    start = time.perf_counter()
    dm.prepare_data()
    built = time.perf_counter()
    dm.setup("fit")
    loader = dm.train_dataloader()
    labelled = 0
    for step, batch in enumerate(loader):
        labelled += int((batch["labels"] != -100).sum())
        if step + 1 == batches:
            break
    done = time.perf_counter()
    shards = dm.train_dataset.shards  # type: ignore[union-attr]
    print(json.dumps({"peak_rss_kb": _peak_rss_kb(), "tokens": shards.tokens, "documents": shards.documents,
                      "rows": len(dm.train_dataset), "labelled": labelled, "build_s": built - start,
                      "iterate_s": done - built}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
