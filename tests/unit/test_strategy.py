"""FoldedMoEStrategy without processes: registration, the three ways in, bad input before any group."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import lightning_moe
from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.models.transformer import TransformerConfig
from lightning_moe.moe.utils import find_moe_layers
from lightning_moe.parallel.grad import expert_grad_scale
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.strategies import FabricFoldedMoEStrategy, FoldedMoEStrategy, register_strategies
from lightning_moe.strategies.layout import folded_layout


@pytest.fixture(autouse=True)
def _close_the_group_a_fit_left() -> object:
    """A one-rank ``folded_moe`` fit opens a process group and Lightning keeps it; close it after the
    test, so a later fake-world test of this module starts from none."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _lm(num_experts: int = 8, ffn: int = 16, heads: int = 4) -> MoELanguageModel:
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=ffn, num_experts=num_experts, top_k=2)
    return MoELanguageModel(TransformerConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=heads, moe=moe))


def test_import_registers_folded_moe_in_trainer_and_fabric_registries() -> None:
    assert StrategyRegistry["folded_moe"]["strategy"] is FoldedMoEStrategy
    assert STRATEGY_REGISTRY["folded_moe"]["strategy"] is FabricFoldedMoEStrategy
    register_strategies()  # idempotent
    register_strategies()
    assert lightning_moe.FoldedMoEStrategy is FoldedMoEStrategy


def test_trainer_accepts_the_string_form() -> None:
    trainer = pl.Trainer(strategy="folded_moe", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FoldedMoEStrategy)


def test_trainer_accepts_the_object_form() -> None:
    strategy = FoldedMoEStrategy(tp=2, ep=2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy is strategy
    assert (strategy.tp, strategy.ep, strategy.dp) == (2, 2, "auto")


@pytest.mark.parametrize("strategy", [FoldedMoEStrategy, FabricFoldedMoEStrategy])
@pytest.mark.parametrize("attribute", ["folded_mesh", "device_mesh", "distributed_sampler_kwargs"])
def test_mesh_read_before_setup_raises(strategy: type, attribute: str) -> None:
    with pytest.raises(RuntimeError, match=f"{strategy.__name__}: the folded mesh is built in setup_environment"):
        getattr(strategy(ep=2), attribute)


def test_module_device_mesh_is_none_until_a_trainer_with_a_mesh_attaches() -> None:
    module = _lm()
    assert module.device_mesh is None
    module.trainer = pl.Trainer(strategy="auto", accelerator="cpu", devices=1, logger=False)
    assert module.device_mesh is None
    trainer = pl.Trainer(strategy=FoldedMoEStrategy(), accelerator="cpu", devices=1, logger=False)
    module.trainer = trainer
    with pytest.raises(RuntimeError, match="FoldedMoEStrategy: the folded mesh is built in setup_environment"):
        module.device_mesh


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pp": 2, "tp": 2, "vocab_parallel": True}, "vocab_parallel=True with pp=2 is not supported"),
        ({"pp": 2, "pp_schedule": "zero_bubble"}, "pp_schedule='zero_bubble' is unknown"),
        ({"order": "tp-cp-xx-dp-pp"}, "order='tp-cp-xx-dp-pp' has unknown token 'xx'"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor parallel .* but tp=1"),
        ({"vocab_parallel": True, "ep": 2}, "vocab_parallel=True needs tensor parallel .* but tp=1"),
        ({"ep": 0}, "ep=0 must be a positive int"),
        ({"dp": 0}, "dp=0 must be 'auto' or a positive int"),
        ({"edp": True}, "edp=True must be 'auto' or a positive int"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FoldedMoEStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world", "kwargs", "match"),
    [
        (6, {"tp": 4}, r"tp\*cp\*pp=4 .* must divide world_size=6"),
        (6, {"ep": 4}, r"etp\*ep\*pp=4 .* must divide world_size=6"),
        (8, {"tp": 2, "dp": 2}, r"dp=2 but world_size=8 / \(tp=2 \* cp=1 \* pp=1\) = 4"),
        (8, {"ep": 2, "edp": 2}, r"edp=2 but world_size=8 / \(etp=1 \* ep=2 \* pp=1\) = 4"),
    ],
)
def test_world_size_rules_fail_before_any_process_group(world: int, kwargs: dict, match: str) -> None:
    full = {"tp": 1, "cp": 1, "ep": 1, "etp": 1, "pp": 1, "dp": "auto", "edp": "auto", "order": "tp-cp-ep-dp-pp"}
    with pytest.raises(ValueError, match=match):
        folded_layout("FoldedMoEStrategy", world, **(full | kwargs))


def _env_strategy(world: int, model: MoELanguageModel, **kwargs: object) -> FoldedMoEStrategy:
    """A strategy whose setup_environment can run up to its checks without launching processes."""
    strategy = FoldedMoEStrategy(**kwargs)  # type: ignore[arg-type]
    strategy.parallel_devices = [None] * world  # type: ignore[list-item]
    strategy._lightning_module = model
    called = []
    strategy._setup_distributed = types.MethodType(lambda self: called.append(1), strategy)  # type: ignore[method-assign]
    return strategy


@pytest.mark.parametrize(
    ("kwargs", "model_kwargs", "match"),
    [
        ({"ep": 4}, {"num_experts": 6}, r"ep=4 must divide num_experts=6"),
        ({"ep": 2, "etp": 2, "tp": 2}, {"ffn": 15}, r"etp=2 must divide ffn_hidden_size=15"),
        ({"tp": 4}, {"heads": 2}, r"tp=4 must divide the 2 query and 2 key/value heads"),
        ({"etp": 2}, {}, r"etp=2 with tp=1 .* outside one TP group"),
    ],
)
def test_model_rules_fail_in_setup_environment_before_any_collective(
    kwargs: dict, model_kwargs: dict, match: str
) -> None:
    strategy = _env_strategy(8, _lm(**model_kwargs), **kwargs)
    with pytest.raises(ValueError, match=match):
        strategy.setup_environment()


def _lm_with(moe_kwargs: dict, **model_kwargs: object) -> MoELanguageModel:
    moe = MoEConfig(**{"hidden_size": 32, "ffn_hidden_size": 16, "num_experts": 8, "top_k": 2, **moe_kwargs})
    return MoELanguageModel(TransformerConfig(vocab_size=32, hidden_size=32, num_layers=1, moe=moe, **model_kwargs))  # type: ignore[arg-type]


class _RootParameterLM(MoELanguageModel):
    def __init__(self) -> None:
        super().__init__(_lm().config)
        self.temperature = torch.nn.Parameter(torch.ones(()))


@pytest.mark.parametrize(
    ("model", "kwargs", "match"),
    [
        ("padded", {"ep": 2}, r"pad_to_capacity=True with ep=2 is not supported yet"),
        ("gqa", {"tp": 4}, r"tp=4 must divide the 4 query and 2 key/value heads"),
        ("root_parameter", {"ep": 2}, r"_RootParameterLM holds parameters directly"),
    ],
)
def test_more_model_rules_fail_in_setup_environment_naming_the_value(model: str, kwargs: dict, match: str) -> None:
    """Padded capacity under EP, key/value heads tp does not divide (GQA), a parameter on the root."""
    lm = {
        "padded": lambda: _lm_with({"capacity_factor": 1.0, "pad_to_capacity": True}, num_heads=4),
        "gqa": lambda: _lm_with({}, num_heads=4, num_kv_heads=2),
        "root_parameter": _RootParameterLM,
    }[model]()
    strategy = _env_strategy(8, lm, **kwargs)
    with pytest.raises(ValueError, match=match):
        strategy.setup_environment()


def test_pytorch_lightning_trainer_with_the_folded_moe_name_gets_a_one_line_error() -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    register_strategies()  # registers the refusing stub now that pytorch_lightning is imported
    with pytest.raises(TypeError, match="strategy='folded_moe' was given to the `pytorch_lightning` package"):
        pytorch_lightning.Trainer(strategy="folded_moe", accelerator="cpu", devices=1, logger=False)


def test_standalone_lightning_fabric_with_the_folded_moe_name_gets_a_one_line_error() -> None:
    lightning_fabric = pytest.importorskip("lightning_fabric")
    register_strategies()
    with pytest.raises(TypeError, match="given to the `lightning_fabric` package; .* `from lightning import Fabric`"):
        lightning_fabric.Fabric(strategy="folded_moe", accelerator="cpu", devices=1)


def test_pytorch_lightning_namespace_is_rejected_with_a_clear_error() -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")

    class Legacy(pytorch_lightning.LightningModule):
        pass

    with pytest.raises(TypeError, match="`pytorch_lightning` namespace; lightning-moe supports the `lightning`"):
        FoldedMoEStrategy().connect(Legacy())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world", "kwargs", "scale"),
    [(4, {"ep": 4}, 1 / 4), (4, {"ep": 2}, 1 / 2), (4, {"tp": 2, "ep": 4}, 1 / 4), (4, {"tp": 2, "ep": 2, "etp": 2}, 1 / 2)],
)
def test_expert_grad_scale_ends_at_the_data_parallel_average(world: int, kwargs: dict, scale: float) -> None:
    assert expert_grad_scale(FoldedLayout(world, **kwargs)) == pytest.approx(scale)


def test_data_parallel_size_is_the_dense_dp_degree_and_needs_setup() -> None:
    strategy = FoldedMoEStrategy(tp=2, ep=4)
    with pytest.raises(RuntimeError, match="setup_environment"):
        strategy.data_parallel_size
    strategy._folded_mesh = types.SimpleNamespace(layout=FoldedLayout(8, tp=2, ep=4))  # type: ignore[assignment]
    assert strategy.data_parallel_size == 4


@pytest.mark.parametrize(
    ("make", "match"),
    [
        ("stepped", r"SGD already has state for 1 parameters; pass an optimizer that has not stepped"),
        ("foreign", r"SGD holds 1 parameters that are not the model's; build it from model.parameters\(\)"),
    ],
)
def test_fabric_setup_with_an_unusable_optimizer_fails_before_sharding(make: str, match: str) -> None:
    import torch

    model = torch.nn.Linear(2, 2, bias=False)
    if make == "stepped":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    else:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    strategy = FabricFoldedMoEStrategy()
    with pytest.raises(ValueError, match=match):
        strategy.setup_module_and_optimizers(model, [optimizer])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pp": 2, "tp": 2, "vocab_parallel": True}, "vocab_parallel=True with pp=2 is not supported"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor parallel"),
    ],
)
def test_fabric_twin_refuses_what_the_trainer_strategy_refuses(kwargs: dict, match: str) -> None:
    from lightning_moe.strategies.fabric import FabricFoldedMoEStrategy

    with pytest.raises(ValueError, match=f"FabricFoldedMoEStrategy: {match}"):
        FabricFoldedMoEStrategy(**kwargs)


def test_both_strategies_accept_context_parallel_and_the_tp_options() -> None:
    from lightning_moe.strategies.fabric import FabricFoldedMoEStrategy

    for cls in (FoldedMoEStrategy, FabricFoldedMoEStrategy):
        strategy = cls(tp=2, cp=2, ep=4, sequence_parallel=True, vocab_parallel=True)
        assert (strategy.cp, strategy.sequence_parallel, strategy.vocab_parallel) == (2, True, True)


def test_one_rank_keeps_the_model_plain_and_trains_like_the_default_strategy(tmp_path: Path) -> None:
    """World size 1: no FSDP wrapping (it would only copy), same parameters as strategy='auto'."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from _callback_models import tiny_config, tiny_trainer, token_loader

    states = {}
    for name, strategy in (("auto", "auto"), ("folded", FoldedMoEStrategy())):
        torch.manual_seed(0)
        module = MoELanguageModel(tiny_config(), learning_rate=1e-2, warmup_steps=1)
        # the same batches in the same order (a distributed strategy would swap in its own sampler)
        trainer = tiny_trainer(tmp_path / name, [], max_steps=3, strategy=strategy, use_distributed_sampler=False)
        trainer.fit(module, token_loader())
        assert not any(isinstance(m, FSDPModule) for m in module.modules())
        assert not any(isinstance(p, DTensor) for p in module.parameters())
        states[name] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for key, value in states["auto"].items():
        torch.testing.assert_close(states["folded"][key], value, rtol=1e-6, atol=1e-7, msg=key)


class _MeshRecordingLM(MoELanguageModel):
    """Records ``self.device_mesh`` as ``configure_model`` sees it."""

    def configure_model(self) -> None:
        self.seen_mesh = self.device_mesh


def test_device_mesh_is_visible_in_configure_model(tmp_path: Path) -> None:
    from _callback_models import tiny_config, tiny_trainer, token_loader

    module = _MeshRecordingLM(tiny_config(), warmup_steps=1)
    strategy = FoldedMoEStrategy()
    trainer = tiny_trainer(tmp_path, [], max_steps=1, strategy=strategy, use_distributed_sampler=False)
    trainer.fit(module, token_loader())
    assert module.seen_mesh is strategy.device_mesh is strategy.folded_mesh.dense
    assert module.seen_mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert module.device_mesh is strategy.device_mesh


def test_fabric_meta_device_init_equals_the_trainer_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model built on the meta device is materialised after sharding and its experts drawn per
    global expert id, under Fabric exactly as under the Trainer (one rank; seed 0)."""
    from lightning.fabric import Fabric

    from _callback_models import tiny_config, tiny_trainer, token_loader
    from lightning_moe.models.transformer import MoETransformer

    # Lightning reseeds from PL_GLOBAL_SEED when a strategy sets up its environment: inside
    # validate (after the seed below) for the Trainer, inside launch (before it) for Fabric.
    # Pinned to the same seed, both paths draw from seed 0 whatever the environment holds.
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    trainer = tiny_trainer(tmp_path, [], max_steps=1, strategy=FoldedMoEStrategy(), use_distributed_sampler=False)
    with trainer.init_module(empty_init=True):
        lm = MoELanguageModel(tiny_config(), warmup_steps=1)
    assert all(p.is_meta for p in lm.parameters())
    torch.manual_seed(0)
    trainer.validate(lm, token_loader(num=2), verbose=False)
    expected = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricFoldedMoEStrategy())
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = MoETransformer(tiny_config())
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    model = fabric.setup(model)
    got = model.module.state_dict()
    assert got.keys() == expected.keys()
    experts = [k for k in expected if ".experts." in k]
    assert experts
    for key, value in expected.items():
        assert not got[key].is_meta, key
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    # the layers' global aux-loss counters (buffers outside the state dict) start at zero
    layers = [m for _, m in find_moe_layers(model.module)]
    assert layers and all(not m.global_tokens_per_expert.any() and not m.global_num_tokens for m in layers)


def test_an_fsdp1_wrapped_module_is_refused_before_sharding(fake_world: Callable[[int, int], None]) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    fake_world(0, 1)
    wrapped = torch.nn.Sequential(FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=torch.device("cpu")))
    with pytest.raises(TypeError, match=r"FabricFoldedMoEStrategy: Sequential holds .*FullyShardedDataParallel \(FSDP1\)"):
        FabricFoldedMoEStrategy().setup_module(wrapped)
