"""Worker: several dist-test parts in one torchrun job, one process group for all of them.

``python worker_suite.py OUT_DIR PART...`` on W gloo ranks. On 2 CPU cores starting W Python
processes that import torch and Lightning costs more than most parts themselves, so the
fixtures in ``conftest.py`` (one per pytest run) collect the parts the selected tests need and launch one job
per world size. Parts run in the order given; each one ends with a barrier and rank 0 prints
``PART OK <part> <seconds>s``. An exception ends the job (torchrun stops the other ranks), so
the parts that finished before it still report OK.

Parts:

* ``dispatch:<kind>:<tp>:<ep>:<etp>`` — ``worker_dispatch.main`` (dispatchers vs one process);
* ``fit:<layout>`` — ``worker_fit.fit_one`` (Trainer.fit vs one process), e.g. ``fit:tp=2,ep=4``;
* ``fabric:<string|layout>`` — ``worker_fabric.run`` (Fabric vs one process);
* ``ckpt:<layout>`` — ``worker_ckpt.run`` (identical resume, reshard on load); ``ckpt:etp`` —
  ``worker_ckpt.run_etp`` (saved at etp2, loaded at etp1 and other layouts);
* ``echo`` — ``worker_echo.run`` (ECHO expert cloning: plain, echo, resumed); ``echo:<dispatcher>``:
  plain and echo over that dispatcher;
* ``replay:<layout>[+recompute]`` — ``worker_replay.main`` (RouterReplay record, then replay);
* ``resume:<layout>`` — ``worker_resume.main`` (crashed mid-epoch and resumed vs uninterrupted).

Every Lightning part finds the default process group made here and reuses it (Lightning skips
``init_process_group`` when one exists); each part builds its own ``FoldedMesh`` groups.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def run_part(part: str, out: Path) -> None:
    kind, _, arg = part.partition(":")
    if kind == "dispatch":
        import worker_dispatch

        dkind, tp, ep, etp = arg.split(":")
        worker_dispatch.main(dkind, int(tp), int(ep), int(etp))
    elif kind == "fit":
        import worker_fit

        worker_fit.fit_one(arg, out, dist.get_world_size())
    elif kind == "fabric":
        import worker_fabric

        worker_fabric.run(out, arg)
    elif kind == "ckpt":
        import worker_ckpt

        worker_ckpt.run_etp(out) if arg == "etp" else worker_ckpt.run(out, arg)
    elif kind == "echo":
        import worker_echo

        worker_echo.run(out, arg)
    elif kind == "replay":
        import worker_replay

        spec_text, _, flag = arg.partition("+")
        worker_replay.main(out, spec_text, flag == "recompute")
    elif kind == "resume":
        import worker_resume

        worker_resume.main(out, arg)
    else:
        raise ValueError(
            f"worker_suite: part={part!r} is not known; use dispatch:…, fit:…, fabric:…, ckpt:…, echo, replay:… or resume:…."
        )


def main(out: Path, parts: list[str]) -> None:
    torch.set_num_threads(1)
    # LIGHTNING_MOE_TEST_ACCELERATOR=gpu: NCCL on one GPU per rank (the fit parts run there too).
    backend = "nccl" if os.environ.get("LIGHTNING_MOE_TEST_ACCELERATOR") == "gpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=int(os.environ.get("SUITE_PG_TIMEOUT", "120")))
    dist.init_process_group(backend, timeout=timeout)
    for part in parts:
        start = time.perf_counter()
        run_part(part, out)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"PART OK {part} {time.perf_counter() - start:.1f}s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
