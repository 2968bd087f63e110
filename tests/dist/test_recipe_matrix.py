"""Every packaged recipe x every precision a user would pick x every AdamW kernel, through the CLI.

A cell is one recipe (trimmed: its layout, strategy and callbacks kept, its data made small, a few
steps, no validation) at one of {its own precision, ``bf16-mixed``, ``32-true``} with one
``optimizer_impl`` (every value of :data:`lightning_moe.optimizer.OPTIMIZER_IMPLS`), gradient
clipping as the recipe sets it. Each must train to its last step. ``optimizer_impl="fused"`` under
``bf16-mixed`` is what ``auto`` picks on a GPU: before the AdamW kernels and clipping agreed, every
recipe crashed there at the first step (Lightning refused to clip a fused optimizer).

The cells of one world size run in one job (``worker_recipe_matrix.py``): starting processes that
import torch and Lightning costs more on 2 cores than the few steps themselves. The full-size SFT
recipes run on a tiny checkpoint of their family on 2 ranks (EP2; the long-context one on 4, its
TP2 x CP2 kept), as in ``test_hf_recipes_tiny.py``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from _harness import Launch, launch_torchrun, selected_tests
from _tiny_hf_checkpoint import FULL_SIZE_RECIPES, save_tiny_checkpoint, write_chats

from lightning_moe.optimizer import OPTIMIZER_IMPLS

pytestmark = pytest.mark.dist

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 3
PRECISIONS = ("bf16-mixed", "32-true")  # besides each recipe's own
_SMALL_DATA = {"seq_len": 32, "batch_size": 4, "max_bytes": 100_000}
# recipe -> ranks it runs on here (its own layout; the full-size ones cut to EP2 as in test_hf_recipes_tiny.py)
WORLD = {
    "tiny_moe": 1, "tiny_moe_callbacks": 1, "tiny_moe_fp8": 1, "hf_qwen3_moe_tiny": 2, "tiny_moe_folded": 4,
    "tiny_moe_long_context": 4, "tiny_moe_pipeline": 4, **{r.removesuffix(".yaml"): 2 for r in FULL_SIZE_RECIPES},
    "hf_qwen3_moe_long_context": 4,  # full size, cut to EP2 but keeping its TP2 x CP2 attention
}  # fmt: skip
_JOB_TIMEOUT_S = 560.0


def _precisions(recipe: str) -> list[str]:
    own = str(yaml.safe_load((CONFIGS / f"{recipe}.yaml").read_text())["trainer"].get("precision", "32-true"))
    own = "32-true" if own in ("32", "32-true") else own
    return list(dict.fromkeys([own, *PRECISIONS]))


CELLS = [(r, p, impl) for r in sorted(WORLD) for p in _precisions(r) for impl in OPTIMIZER_IMPLS]


def _cell_id(recipe: str, precision: str, impl: str) -> str:
    return f"{recipe}-{precision}-{impl}"


def test_matrix_covers_every_recipe_and_every_optimizer_impl() -> None:
    """A new recipe, or a new ``optimizer_impl`` value, must be placed in the matrix."""
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(WORLD)
    assert {impl for _, _, impl in CELLS} == set(OPTIMIZER_IMPLS) == {"auto", "fused", "foreach"}
    assert {p for _, p, _ in CELLS} >= {"bf16-mixed", "32-true"}


def _set_optimizer_impl(model_args: dict[str, Any], impl: str) -> None:
    if isinstance(model_args.get("optimizer"), dict):
        model_args["optimizer"]["optimizer_impl"] = impl
    else:
        model_args["optimizer_impl"] = impl


def _trimmed(recipe: str, precision: str, impl: str, hf: dict[str, Path]) -> dict[str, Any]:
    config = copy.deepcopy(yaml.safe_load((CONFIGS / f"{recipe}.yaml").read_text()))
    trainer, model, data = config["trainer"], config["model"]["init_args"], config["data"]["init_args"]
    trainer.update(precision=precision, max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0,
                   enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=1)  # fmt: skip
    _set_optimizer_impl(model, impl)
    if f"{recipe}.yaml" in FULL_SIZE_RECIPES:
        family, _ = FULL_SIZE_RECIPES[f"{recipe}.yaml"]
        trainer.update(accelerator="cpu", devices=WORLD[recipe])
        trainer["strategy"]["init_args"]["ep"] = 2
        model.update(pretrained=str(hf[family]))
        data.update(tokenizer_dir=str(hf[family]), train_files=str(hf["chats"]), val_fraction=0.1, seq_len=32,
                    batch_size=4, num_workers=0)  # fmt: skip
    else:
        data.update(_SMALL_DATA)
    return config


@dataclass
class _Matrix:
    jobs: dict[int, Launch]

    def line(self, cell: str, world: int) -> str:
        job = self.jobs[world]
        found = re.search(rf"^CELL (OK|FAIL) {re.escape(cell)}\b.*$", job.output, re.M)
        if found is None:
            pytest.fail(f"cell {cell} did not report (the job of world {world} ended early):\n{job.failure()}")
        return found.group(0)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> _Matrix:
    """Trim every selected cell's recipe into its own folder, then one job per world size."""
    selected = {item.callspec.params["cell"] for item in selected_tests(request.config) if hasattr(item, "callspec")
                and "cell" in item.callspec.params and item.module is request.module}  # fmt: skip
    root = tmp_path_factory.mktemp("matrix")
    hf: dict[str, Path] = {"chats": write_chats(root / "chats.jsonl", 128)}
    cells_by_world: dict[int, list[str]] = {}
    for recipe, precision, impl in CELLS:
        cell = _cell_id(recipe, precision, impl)
        if cell not in selected:
            continue
        if f"{recipe}.yaml" in FULL_SIZE_RECIPES:
            family = FULL_SIZE_RECIPES[f"{recipe}.yaml"][0]
            if family not in hf:
                hf[family] = save_tiny_checkpoint(root / "hf" / family, family)
        folder = root / cell
        folder.mkdir()
        (folder / "recipe.yaml").write_text(yaml.safe_dump(_trimmed(recipe, precision, impl, hf), sort_keys=False))
        (folder / "steps").write_text(str(STEPS))
        cells_by_world.setdefault(WORLD[recipe], []).append(str(folder))
    jobs = {world: launch_torchrun("worker_recipe_matrix.py", world, cells, timeout=_JOB_TIMEOUT_S)
            for world, cells in sorted(cells_by_world.items())}  # fmt: skip
    return _Matrix(jobs)


@pytest.mark.parametrize("cell", [_cell_id(*c) for c in CELLS])
def test_recipe_trains_at_every_precision_with_every_adamw_kernel(matrix: _Matrix, cell: str) -> None:
    recipe = next(r for r, p, i in CELLS if _cell_id(r, p, i) == cell)
    line = matrix.line(cell, WORLD[recipe])
    assert line.startswith("CELL OK"), line
