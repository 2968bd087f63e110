"""A DCP checkpoint of a swapped HF model, sharded by folded_moe, exports to HF safetensors.

Experts live as DTensors over EP (and ETP); the export reads them back whole in one process,
puts the HF blocks back and ``transformers`` reloads a model with the trained logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _harness import run_cli_fit, run_torchrun

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("family", "tp", "ep", "etp"),
    [
        ("qwen3_moe", 1, 2, 1),
        ("mixtral", 2, 1, 2),  # w13 sharded over ETP; the folder stores its gate and up halves whole
        ("qwen3_moe", 2, 1, 2),  # per-head q/k norms: TP-replicated weights, gradients summed over TP
    ],
    ids=["qwen3_ep2", "mixtral_tp2_etp2", "qwen3_tp2_etp2"],
)
def test_folded_dcp_checkpoint_exports_to_hf_with_trained_logits(
    tmp_path: Path, family: str, tp: int, ep: int, etp: int
) -> None:
    from lightning_moe.export import export_checkpoint

    out = run_torchrun("worker_hf_export.py", 2, [str(tmp_path), family, str(tp), str(ep), str(etp)], timeout=300)
    assert "WORKER OK" in out
    if etp > 1:  # a DCP folder stores w13 independently of the layout: an etp for it is refused
        with pytest.raises(ValueError, match=f"etp={etp} is not needed"):
            export_checkpoint(tmp_path / "ckpt", tmp_path / "refused", etp=etp)
    hf_dir = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    ref = torch.load(tmp_path / "logits.pt")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ref["ids"]).logits, ref["logits"], atol=1e-5, rtol=1e-5)


def test_hf_recipe_yaml_fits_under_folded_moe_on_2_cpu_ranks(tmp_path: Path) -> None:
    """``lightning-moe fit --config configs/hf_qwen3_moe_tiny.yaml`` as written (2 ranks, EP2)."""
    args = [
        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
        "--trainer.num_sanity_val_steps=0", "--trainer.logger=false", "--data.init_args.max_bytes=100000",
    ]  # fmt: skip
    out = run_cli_fit("hf_qwen3_moe_tiny.yaml", args, tmp_path, timeout=300)
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out, out[-3000:]
