"""The full-size SFT recipes of ``configs/`` run, tiny, through command-line overrides only.

Per recipe (``FULL_SIZE_RECIPES``): a random 2-layer checkpoint of its family built with
transformers' own classes (sharded safetensors, the tiny tokenizer, ``_tiny_hf_checkpoint.py``) and a
jsonl chat file; ``lightning-moe fit --config configs/<recipe>`` with ``tiny_run_overrides`` and the
layout cut to 2 CPU ranks (EP2; the long-context recipe keeps TP2 x CP2 with sequence parallel
on 4 ranks, EP2), fp32, 100 steps. The recipe's own loading (``load_sharded``), data
(``TextDataModule`` SFT with packing) and callbacks (checkpointing, the LR and MoE monitors,
``CPUOffload``, which does nothing without CUDA) stay; the run must reach ``max_steps`` with the
validation loss falling and leave its DCP checkpoint. The full-size settings are checked from the
files: 8 GPUs, ``folded_moe`` EP8, bf16-mixed, sharded load, SFT with packing, checkpoints.

On one process, the checkpoint of every recipe that loads sharded, read by ``load_hf_checkpoint_sharded``,
gives the logits of transformers' ``from_pretrained`` (Mixtral's checkpoint names its MoE blocks
``block_sparse_moe``; gpt-oss interleaves its gate and up columns).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from _harness import run_cli_fit, validation_loss
from _tiny_hf_checkpoint import FULL_SIZE_RECIPES, save_tiny_checkpoint, tiny_run_overrides, write_chats

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 100
_IDS = [r.removesuffix(".yaml") for r in FULL_SIZE_RECIPES]
_UNSHARDED: set[str] = set()  # every recipe reads its checkpoint sharded
SHARDED_FAMILIES = list(dict.fromkeys(family for recipe, (family, _) in FULL_SIZE_RECIPES.items() if recipe not in _UNSHARDED))


@pytest.mark.parametrize("recipe", list(FULL_SIZE_RECIPES), ids=_IDS)
def test_full_size_recipe_is_one_node_of_eight_gpus_with_ep8(recipe: str) -> None:
    config = yaml.safe_load((CONFIGS / recipe).read_text())
    trainer, model, data = config["trainer"], config["model"]["init_args"], config["data"]["init_args"]
    assert (trainer["accelerator"], trainer["devices"], trainer["num_nodes"]) == ("gpu", 8, 1)
    assert trainer["strategy"]["class_path"] == "lightning_moe.strategies.FoldedMoEStrategy"
    assert trainer["strategy"]["init_args"]["ep"] == 8 and trainer["precision"] == "bf16-mixed"
    assert model["load_sharded"] is (recipe not in _UNSHARDED) and model["pretrained"] == data["tokenizer_dir"]
    assert (data["task"], data["packing"]) == ("sft", "pack")
    callbacks = [c["class_path"].rsplit(".", 1)[-1] for c in trainer["callbacks"]]
    assert "ModelCheckpoint" in callbacks and "MoEMonitor" in callbacks
    header = (CONFIGS / recipe).read_text().split("seed_everything")[0]
    assert f"lightning-moe fit --config configs/{recipe}" in header and "Edit before running" in header


@pytest.mark.parametrize("family", SHARDED_FAMILIES)
def test_sharded_load_gives_the_logits_of_from_pretrained(tmp_path: Path, family: str) -> None:
    from lightning_moe.lit_hf import HFMoELanguageModel

    folder = save_tiny_checkpoint(tmp_path / family, family)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    # eager attention on both sides: every family has it (gpt-oss's sinks have no sdpa path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, attn_implementation="eager"
    ).eval()
    lit = HFMoELanguageModel(
        pretrained=str(folder), load_sharded=True, moe={"experts_backend": "torch"}, attn_implementation="eager"
    )
    assert all(p.is_meta for p in lit.parameters())
    lit.configure_model()  # no Trainer: the whole model on this process, read shard by shard
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lit.eval()(ids), reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", list(FULL_SIZE_RECIPES), ids=_IDS)
def test_full_size_recipe_runs_tiny_on_two_ranks(tmp_path: Path, recipe: str) -> None:
    family, layout = FULL_SIZE_RECIPES[recipe]
    checkpoint = save_tiny_checkpoint(tmp_path / "hf", family)
    chats = write_chats(tmp_path / "chats.jsonl", 256)
    out = run_cli_fit(recipe, [*tiny_run_overrides(checkpoint, chats, STEPS), *layout], tmp_path, timeout=300)
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached." in out, out[-3000:]
    loss = validation_loss(out)
    assert loss.last_step == STEPS and loss.last < 0.5 * loss.first, loss
    name = recipe.removesuffix(".yaml")
    assert (tmp_path / "runs" / name / "checkpoints" / "last.ckpt" / "manifest.json").is_file()
