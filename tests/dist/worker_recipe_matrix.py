"""Worker: the cells of the recipe matrix of one world size, each through the ``lightning-moe`` CLI class.

``python worker_recipe_matrix.py CELL_DIR...`` (world 1) or under torchrun on W gloo ranks. Each
``CELL_DIR`` holds ``recipe.yaml`` (a packaged recipe trimmed by ``test_recipe_matrix.py``) and
``steps``; the cell runs ``MoECLI`` (what ``lightning-moe fit --config recipe.yaml`` builds) in that
folder, in this process: under torchrun, Lightning finds the ranks' environment and launches
nothing, so every cell of the job shares the process start. Rank 0 prints ``CELL OK <dir>`` when
the fit reached its steps, or ``CELL FAIL <dir>: <error>``; a failing cell does not stop the next.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import lightning_moe  # noqa: F401 - registers folded_moe before the CLI parses the recipes
from lightning_moe.cli import MoECLI
from lightning_moe.data import MoEDataModule
from lightning_moe.lit import MoELanguageModelBase


def run_cell(cell: Path) -> str | None:
    """``None`` when the fit in ``cell`` reached its steps, else the error."""
    steps = int((cell / "steps").read_text())
    os.chdir(cell)
    try:
        cli = MoECLI(
            MoELanguageModelBase, MoEDataModule, subclass_mode_model=True, subclass_mode_data=True,
            save_config_kwargs={"overwrite": True}, args=["fit", "--config", "recipe.yaml"],
        )  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - SystemExit from the parser counts as a failure too
        return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"
    if cli.trainer.global_step != steps:
        return f"stopped at step {cli.trainer.global_step} of {steps}"
    return None


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    for cell in [Path(arg).resolve() for arg in sys.argv[1:]]:
        error = run_cell(cell)
        if rank == 0:
            print(f"CELL OK {cell.name}" if error is None else f"CELL FAIL {cell.name}: {error}", flush=True)


if __name__ == "__main__":
    main()
