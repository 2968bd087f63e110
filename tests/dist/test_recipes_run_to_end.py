"""Every recipe in ``configs/`` runs to its end as a user runs it (``lightning-moe fit --config``).

Each keeps its layout (devices, tp/ep/etp, dispatcher, callbacks, model) and runs >= 100 optimizer
steps (the folded recipe its full ``max_steps``); only the data is made small (sequence length,
batch, bytes read) and validation short, so they fit the CI budget on 2 CPU cores. The run must
reach ``max_steps``, report a finite validation loss at the end, lower than at the start. The
full-size SFT recipes (``_tiny_hf_checkpoint.FULL_SIZE_RECIPES``: real checkpoints on 8 GPUs) run
tiny in ``test_hf_recipes_tiny.py``; every recipe is listed in one of the two places.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from _harness import run_cli_fit, validation_loss
from _tiny_hf_checkpoint import FULL_SIZE_RECIPES

pytestmark = pytest.mark.dist

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 100
_SMALL = ["--data.init_args.seq_len=32", "--data.init_args.batch_size=4", "--data.init_args.max_bytes=100000"]
# (recipe, extra overrides, timeout in seconds)
RECIPES = [
    ("tiny_moe.yaml", [], 300),
    ("tiny_moe_callbacks.yaml", [], 300),
    ("tiny_moe_folded.yaml", [], 400),
    ("hf_qwen3_moe_tiny.yaml", [], 400),
    ("tiny_moe_long_context.yaml", [], 400),
    ("tiny_moe_fp8.yaml", [], 400),
    ("tiny_moe_pipeline.yaml", [], 400),
]


def test_recipe_list_is_complete() -> None:
    listed = [r for r, _, _ in RECIPES] + list(FULL_SIZE_RECIPES)
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(listed)


@pytest.mark.parametrize("recipe,extra,timeout", RECIPES, ids=[r.removesuffix(".yaml") for r, _, _ in RECIPES])
def test_recipe_runs_to_its_configured_end(tmp_path: Path, recipe: str, extra: list[str], timeout: int) -> None:
    configured = yaml.safe_load((CONFIGS / recipe).read_text())["trainer"]["max_steps"]
    steps = min(configured, STEPS)
    args = [
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps // 2}", "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false", *_SMALL, *extra,
    ]  # fmt: skip
    out = run_cli_fit(recipe, args, tmp_path, timeout=timeout)
    assert f"`Trainer.fit` stopped: `max_steps={steps}` reached." in out, out[-3000:]
    loss = validation_loss(out)
    assert loss.last_step == steps and math.isfinite(loss.last) and loss.last < loss.first, loss
