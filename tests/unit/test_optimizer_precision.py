"""The AdamW kernel, gradient clipping and every precision plugin agree (Trainer and Fabric).

torch's fused AdamW runs on the CPU too, so the decision that crashed GPU users (``auto`` picks
``fused`` on CUDA; Lightning's mixed-precision plugin then refused ``gradient_clip_val``) is forced
here: ``optimizer_impl="fused"`` under every precision Lightning offers, with clipping on, must
train and must step the same weights as the foreach kernel.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_moe import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.optimizer import OPTIMIZER_IMPLS, choose_adamw_impl, unscale_before_step

PRECISIONS = ["32-true", "bf16-mixed", "bf16-true", "16-mixed"]


def _precision_args(precision: str, plugin_type: Any) -> dict[str, Any]:
    """Lightning turns ``16-mixed`` on the CPU into ``bf16-mixed``; the plugin with a real GradScaler
    is passed directly so that the scaler path (unscale before clipping, skip on inf) runs here."""
    if precision != "16-mixed":
        return {"precision": precision}
    return {"plugins": [plugin_type("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]}


def test_auto_picks_fused_exactly_when_every_parameter_is_on_cuda() -> None:
    assert choose_adamw_impl("auto", ["cuda", "cuda"]) == "fused"
    assert choose_adamw_impl("auto", ["cuda", "cpu"]) == "default"
    assert choose_adamw_impl("auto", ["cpu"]) == "default"
    assert choose_adamw_impl("auto", []) == "default"
    assert choose_adamw_impl("foreach", ["cuda"]) == "foreach"
    assert set(OPTIMIZER_IMPLS) == {"auto", "fused", "foreach"}


def test_fused_adamw_is_marked_clippable_and_others_are_untouched() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    fused = torch.optim.AdamW([p], fused=True)
    assert getattr(fused, "_step_supports_amp_scaling", False)  # torch's own mark, the cause
    assert unscale_before_step(fused) is fused and not fused._step_supports_amp_scaling
    plain = torch.optim.SGD([p], lr=0.1)
    unscale_before_step(plain)
    assert not getattr(plain, "_step_supports_amp_scaling", False)


def test_lightning_mixed_precision_clips_the_fused_optimizer_our_module_builds() -> None:
    """The exact check that raised on the first GPU step (Lightning's ``MixedPrecision.clip_gradients``)."""
    lm = _lm(optimizer_impl="fused")
    optimizer = lm.configure_optimizers()["optimizer"]
    for p in lm.parameters():
        p.grad = torch.full_like(p, 3.0)
    MixedPrecision("bf16-mixed", "cpu").clip_gradients(optimizer, 1.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in lm.parameters()]))
    assert norm == pytest.approx(1.0, rel=1e-4)


def _lm(**kwargs: Any) -> MoELanguageModel:
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    model = TransformerConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, moe=moe)
    return MoELanguageModel(model, learning_rate=1e-2, warmup_steps=0, **kwargs)


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 32, (9,), generator=g)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def _fit(precision: str, impl: str, strategy: str) -> dict[str, torch.Tensor]:
    L.seed_everything(7)
    lm = _lm(optimizer_impl=impl)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, gradient_clip_val=0.5,
        **_precision_args(precision, MixedPrecision),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(lm, torch.utils.data.DataLoader(_Batches(), batch_size=4))
    assert trainer.global_step == 3
    return {n: p.detach().float().clone() for n, p in lm.named_parameters()}


@pytest.mark.parametrize("strategy", ["auto", "folded_moe"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trainer_fused_adamw_with_clipping_trains_like_foreach(precision: str, strategy: str) -> None:
    fused = _fit(precision, "fused", strategy)
    foreach = _fit(precision, "foreach", strategy)
    tol = 1e-5 if precision == "32-true" else 2e-2  # bf16/fp16 rounding of the same steps
    for name, value in fused.items():
        torch.testing.assert_close(value, foreach[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("strategy", ["auto", "folded_moe"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_clip_gradients_with_fused_adamw(precision: str, strategy: str) -> None:
    """``fabric.clip_gradients`` unscales (16-mixed) and clips a fused optimizer under every precision;
    ``folded_moe`` unmarks the optimizers it sets up, under ``auto`` the user calls the function."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, **_precision_args(precision, FabricMixedPrecision))
    fabric.launch()
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    if strategy == "auto":
        unscale_before_step(optimizer)
    loss = model(torch.randn(4, 8)).pow(2).sum()  # gradient norm well above 0.5, finite in fp16 at scale 1024
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
    assert norm is not None and torch.isfinite(norm) and norm > 1.0
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in model.parameters()]))
    assert after == pytest.approx(0.5, rel=2e-2)  # the unscaled gradient was clipped, not the scaled one
    optimizer.step()
