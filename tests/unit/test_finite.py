"""parallel/finite.py and the optimizer-step guard of MoELanguageModelBase, one process.

Bad steps are planted: ``on_after_backward`` (inside the optimizer's closure, before the guard)
writes +inf into one expert-weight gradient, or the loss is made NaN.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.parallel.finite import (
    NonFiniteGuard,
    check_nonfinite_options,
    find_nonfinite,
    forward_nonfinite_options,
)

EXPERT_W13 = "model.layers.1.ffn.experts.w13"
CPU = torch.device("cpu")


def _config() -> TransformerConfig:
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    return TransformerConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, moe=moe, num_dense_layers=1,
        dense_ffn_hidden_size=16, max_seq_len=8,
    )  # fmt: skip


class _Tokens(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": w[:-1], "labels": w[1:]}


class _LM(MoELanguageModel):
    """The tiny model; ``bad_steps`` get +inf in one expert gradient, ``nan_loss_steps`` a NaN loss,
    ``drop_steps`` lose all gradients (the reference for a skipped step)."""

    def __init__(self, bad_steps: tuple[int, ...] = (), nan_loss_steps: tuple[int, ...] = (),
                 drop_steps: tuple[int, ...] = (), **kwargs: Any) -> None:  # fmt: skip
        super().__init__(_config(), warmup_steps=2, log_layer_load=False, **kwargs)
        self.bad_steps, self.nan_loss_steps, self.drop_steps = bad_steps, nan_loss_steps, drop_steps
        self.before: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.before[self.global_step] = {n: p.detach().clone() for n, p in self.named_parameters()}

    def _lm_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = super()._lm_loss(batch)
        return loss * float("nan") if self.training and self.global_step in self.nan_loss_steps else loss

    def on_after_backward(self) -> None:
        if self.global_step in self.bad_steps:
            grad = self.get_parameter(EXPERT_W13).grad
            assert grad is not None
            grad[1, 0, 0] = float("inf")
        if self.global_step in self.drop_steps:
            for p in self.parameters():
                p.grad = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Tokens(), batch_size=2)


def _fit(model: pl.LightningModule, steps: int = 5, **trainer: Any) -> pl.Trainer:
    torch.manual_seed(0)
    t = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, **trainer,
    )  # fmt: skip
    t.fit(model)
    return t


def _build(**kwargs: Any) -> _LM:
    torch.manual_seed(0)
    return _LM(**kwargs)


def _assert_params_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=0, msg=name)


# --- find_nonfinite and the guard on a plain module ------------------------------------------------


def _grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = torch.ones_like(p)


def test_find_nonfinite_names_the_first_parameter_its_module_and_the_value() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    _grads(net)
    assert find_nonfinite(net, torch.tensor(1.0), None, CPU) is None
    net[2].bias.grad[0] = float("nan")
    net[2].weight.grad[1, 1] = float("inf")
    finding = find_nonfinite(net, torch.tensor(1.0), None, CPU)
    assert finding is not None and finding.what == "gradient"
    assert (finding.parameter, finding.module, finding.module_type, finding.value) == ("2.weight", "2", "Linear", "inf")
    net[2].weight.grad.fill_(1.0)
    finding = find_nonfinite(net, None, None, CPU)
    assert finding is not None and (finding.parameter, finding.value) == ("2.bias", "nan")


def test_find_nonfinite_reports_a_nonfinite_loss_before_any_gradient() -> None:
    net = torch.nn.Linear(2, 2)
    _grads(net)
    net.weight.grad[0, 0] = float("inf")
    finding = find_nonfinite(net, torch.tensor(float("nan")), None, CPU)
    assert finding is not None and (finding.what, finding.value, finding.parameter) == ("loss", "nan", None)


def test_find_nonfinite_sees_finite_gradients_too_large_for_a_two_norm_as_finite() -> None:
    net = torch.nn.Linear(2, 2)
    _grads(net)
    net.weight.grad.fill_(3e38)  # squares overflow fp32: a 2-norm would be inf
    assert find_nonfinite(net, torch.tensor(1.0), None, CPU) is None


def test_guard_drops_gradients_of_a_skipped_step_and_resets_after_a_finite_one() -> None:
    net = torch.nn.Linear(2, 2)
    guard = NonFiniteGuard("Owner", skip_nonfinite=1)
    _grads(net)
    net.weight.grad[0, 0] = float("inf")
    assert guard.check(net, None, None, CPU, step=0) is not None
    assert all(p.grad is None for p in net.parameters()) and guard.consecutive == 1
    _grads(net)
    assert guard.check(net, None, None, CPU, step=1) is None and guard.consecutive == 0 and guard.skipped == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_skip_nonfinite_must_be_a_non_negative_int(bad: object) -> None:
    with pytest.raises(ValueError, match=f"skip_nonfinite={bad!r}"):
        check_nonfinite_options("Owner", True, bad)
    with pytest.raises(ValueError, match=f"MoELanguageModel: skip_nonfinite={bad!r}"):
        MoELanguageModel(_config(), skip_nonfinite=bad)  # type: ignore[arg-type]


def test_guard_nonfinite_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="guard_nonfinite=1 must be a bool"):
        check_nonfinite_options("Owner", 1, 0)


def test_options_forwarded_from_a_module_replace_the_strategy_defaults_and_conflicts_are_refused() -> None:
    assert forward_nonfinite_options("S", (True, 0), "M", {"skip_nonfinite": 3}) == (True, 3)
    assert forward_nonfinite_options("S", (False, 0), "M", {}) == (False, 0)
    assert forward_nonfinite_options("S", (False, 0), "M", {"skip_nonfinite": 0}) == (False, 0)
    assert forward_nonfinite_options("S", (True, 2), "M", {"guard_nonfinite": True, "skip_nonfinite": 2}) == (True, 2)
    with pytest.raises(ValueError, match="S: skip_nonfinite=2 disagrees with skip_nonfinite=0 forwarded from M"):
        forward_nonfinite_options("S", (True, 2), "M", {"guard_nonfinite": False, "skip_nonfinite": 0})
    with pytest.raises(ValueError, match="S: guard_nonfinite=False disagrees with guard_nonfinite=True forwarded"):
        forward_nonfinite_options("S", (False, 0), "M", {"guard_nonfinite": True})


def test_module_guard_options_are_deprecated_and_forwarded() -> None:
    with pytest.warns(DeprecationWarning, match="the strategy owns the non-finite guard"):
        model = MoELanguageModel(_config(), skip_nonfinite=2)
    assert model.forwarded_nonfinite_options == {"skip_nonfinite": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MoELanguageModel(_config()).forwarded_nonfinite_options == {}


# --- the Trainer: MoELanguageModel on one device ---------------------------------------------------


def test_inf_expert_gradient_raises_naming_the_parameter_before_any_weight_changes() -> None:
    model = _build(bad_steps=(2,))
    with pytest.raises(FloatingPointError, match=rf"at step 2, .*parameter '{EXPERT_W13}' \(module 'model.layers.1.ffn.experts', GroupedExperts\) holds inf"):  # fmt: skip
        _fit(model)
    _assert_params_equal(model, model.before[2])


def test_nan_loss_raises_naming_the_loss() -> None:
    model = _build(nan_loss_steps=(1,))
    with pytest.raises(FloatingPointError, match="at step 1, .*the training loss is nan on rank 0"):
        _fit(model)
    _assert_params_equal(model, model.before[1])


def test_guard_off_lets_the_inf_reach_the_weights() -> None:
    model = _build(bad_steps=(1,), guard_nonfinite=False)
    _fit(model, steps=2)
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_skipped_step_leaves_the_weights_as_a_run_without_that_update() -> None:
    skipping = _build(bad_steps=(2,), skip_nonfinite=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(skipping)
    assert any("skipped step 2" in str(w.message) and EXPERT_W13 in str(w.message) for w in caught)
    assert skipping._nonfinite_guard is not None and skipping._nonfinite_guard.skipped == 1
    for name, before_step_2 in skipping.before[2].items():  # step 2 changed nothing
        torch.testing.assert_close(skipping.before[3][name], before_step_2, rtol=0, atol=0, msg=name)
    reference = _build(drop_steps=(2,), skip_nonfinite=2)
    _fit(reference)
    _assert_params_equal(skipping, {n: p.detach() for n, p in reference.named_parameters()})
    assert all(bool(torch.isfinite(p).all()) for p in skipping.parameters())


def test_more_bad_steps_in_a_row_than_skip_nonfinite_raise() -> None:
    model = _build(bad_steps=(1, 2, 3), skip_nonfinite=2)
    with pytest.raises(FloatingPointError, match="at step 3, .*3 such steps in a row are more than skip_nonfinite=2"):
        _fit(model)
    _assert_params_equal(model, model.before[1])  # the skipped steps and the failing one changed nothing


# --- the strategy: any LightningModule under folded_moe ----------------------------------------------


class _Plain(pl.LightningModule):
    """No MoE, no options: the strategy's guard alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.body(batch).pow(2).mean()

    def on_after_backward(self) -> None:
        if self.global_step == 1:
            self.body[1].weight.grad[0, 2] = float("nan")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(8, 4), batch_size=2)


def test_folded_moe_guards_a_plain_lightning_module() -> None:
    from lightning_moe.strategies import FoldedMoEStrategy

    model = _Plain()
    with pytest.raises(FloatingPointError, match=r"FoldedMoEStrategy: at step 1, .*'body.1.weight' \(module 'body.1', Linear\) holds nan"):  # fmt: skip
        _fit(model, steps=3, strategy=FoldedMoEStrategy())


# --- Fabric: the guard on the optimizer-step path of FabricFoldedMoEStrategy ------------------------


def _fabric_setup(**strategy: Any) -> tuple[Any, torch.nn.Module, Any]:
    from lightning.fabric import Fabric

    from lightning_moe.strategies import FabricFoldedMoEStrategy

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricFoldedMoEStrategy(**strategy))
    fabric.launch()
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model, optimizer = fabric.setup(body, torch.optim.AdamW(body.parameters(), lr=0.1))
    return fabric, model, optimizer


def _fabric_step(fabric: Any, model: Any, optimizer: Any, nan_loss: bool = False, inf_grad: bool = False) -> None:
    loss = model(torch.ones(2, 4)).pow(2).mean()
    fabric.backward(loss * float("nan") if nan_loss else loss)
    if inf_grad:
        grad = model.module.get_parameter("1.weight").grad
        (grad.to_local() if hasattr(grad, "to_local") else grad)[0, 2] = float("inf")
    optimizer.step()
    optimizer.zero_grad()


def _local_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.module.named_parameters()}


def test_fabric_nan_loss_raises_naming_the_loss_before_any_weight_changes() -> None:
    fabric, model, optimizer = _fabric_setup()
    _fabric_step(fabric, model, optimizer)
    before = _local_params(model)
    with pytest.raises(FloatingPointError, match="FabricFoldedMoEStrategy: at step 1, .*the training loss is nan on rank 0"):
        _fabric_step(fabric, model, optimizer, nan_loss=True)
    for name, value in _local_params(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_fabric_inf_gradient_raises_naming_the_parameter() -> None:
    fabric, model, optimizer = _fabric_setup()
    before = _local_params(model)
    with pytest.raises(FloatingPointError, match=r"at step 0, .*parameter '1.weight' \(module '1', Linear\) holds inf"):
        _fabric_step(fabric, model, optimizer, inf_grad=True)
    for name, value in _local_params(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_fabric_skips_up_to_skip_nonfinite_steps_in_a_row_with_a_warning() -> None:
    fabric, model, optimizer = _fabric_setup(skip_nonfinite=1)
    before = _local_params(model)
    with pytest.warns(UserWarning, match=r"skipped step 0: the gradient of parameter '1.weight'"):
        _fabric_step(fabric, model, optimizer, inf_grad=True)
    for name, value in _local_params(model).items():  # the skipped step changed nothing
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    _fabric_step(fabric, model, optimizer)  # a finite step trains and resets the count
    assert any(not torch.equal(v, before[n]) for n, v in _local_params(model).items())
    with pytest.warns(UserWarning, match="skipped step 2: the training loss is nan"):
        _fabric_step(fabric, model, optimizer, nan_loss=True)
    with pytest.raises(FloatingPointError, match="at step 3, .*2 such steps in a row are more than skip_nonfinite=1"):
        _fabric_step(fabric, model, optimizer, nan_loss=True)
    assert all(bool(torch.isfinite(v).all()) for v in _local_params(model).values())


def test_fabric_guard_checks_after_a_step_closure() -> None:
    fabric, model, optimizer = _fabric_setup()

    def closure() -> torch.Tensor:
        loss = model(torch.ones(2, 4)).pow(2).mean() * float("nan")
        fabric.backward(loss)
        return loss

    with pytest.raises(FloatingPointError, match="at step 0, .*the training loss is nan"):
        optimizer.step(closure)


def test_fabric_guard_off_lets_the_nan_reach_the_weights() -> None:
    fabric, model, optimizer = _fabric_setup(guard_nonfinite=False)
    _fabric_step(fabric, model, optimizer, nan_loss=True)
    assert not all(bool(torch.isfinite(v).all()) for v in _local_params(model).values())


def test_fabric_guard_refuses_an_optimizer_of_no_set_up_module() -> None:
    fabric, model, _ = _fabric_setup()
    stray = torch.nn.Parameter(torch.zeros(2))
    stray.grad = torch.ones(2)
    optimizer = fabric.setup_optimizers(torch.optim.SGD([stray], lr=0.1))
    with pytest.raises(ValueError, match="FabricFoldedMoEStrategy: guard_nonfinite=True checks .* no set-up module"):
        optimizer.step()


def test_fabric_takes_the_guard_options_a_module_forwards() -> None:
    from lightning.fabric import Fabric

    from lightning_moe.strategies import FabricFoldedMoEStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricFoldedMoEStrategy())
    fabric.launch()
    with pytest.warns(DeprecationWarning):
        module = MoELanguageModel(_config(), skip_nonfinite=2)
    fabric.setup(module)
    strategy = fabric.strategy
    assert strategy.skip_nonfinite == 2 and strategy.step_guard is not None
    assert strategy.step_guard.guard.skip_nonfinite == 2
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="skip_nonfinite=2 disagrees with skip_nonfinite=1"):
        fabric.setup(MoELanguageModel(_config(), skip_nonfinite=1))
