"""RouterReplay: record a run, perturb the routers, replay -> the same expert ids everywhere.

A spy callback registers forward hooks on every router and keeps the ids each forward routed
(the original forward and, under activation checkpointing, its recompute), keyed like the
callback by ``(global_step, micro_batch)``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.checkpoint as checkpoint_utils
from _callback_models import CheckpointedLM, tiny_config, tiny_trainer, token_loader
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_moe.callbacks import RouterReplay
from lightning_moe.callbacks.router_replay import (
    FORMAT,
    VERSION,
    load_shard,
    shard_name,
)
from lightning_moe.config import MoEConfig
from lightning_moe.lit import MoELanguageModel
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.utils import find_moe_layers

Key = tuple[int, int]


class RoutingSpy(L.Callback):
    """Ids routed by every forward of every router, and each router's grad norm per step."""

    def __init__(self) -> None:
        self.ids: dict[Key, dict[str, list[torch.Tensor]]] = {}
        self.grad_norms: list[dict[str, float]] = []
        self._key: Key | None = None
        self._layers: list[tuple[str, Any]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._layers = find_moe_layers(pl_module)
        for name, layer in self._layers:
            layer.router.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._key is not None:
                self.ids.setdefault(self._key, {}).setdefault(name, []).append(output.routed_ids_TK.clone())

        return hook

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        step = trainer.global_step
        self._key = (step, 0) if self._key is None or self._key[0] != step else (step, self._key[1] + 1)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grad_norms.append({n: float(layer.router.weight.grad.norm()) for n, layer in self._layers})


def _fit(model: L.LightningModule, root: Path, callbacks: list[Any], max_steps: int = 3, seq_len: int = 8) -> None:
    trainer = tiny_trainer(root, callbacks, max_steps=max_steps, accumulate_grad_batches=2)
    trainer.fit(model, train_dataloaders=token_loader(seq_len=seq_len))


def _model(seed: int = 0, checkpointed: bool | None = None) -> MoELanguageModel:
    L.seed_everything(seed, verbose=False)
    if checkpointed is None:
        return MoELanguageModel(tiny_config(), warmup_steps=1)
    return CheckpointedLM(tiny_config(), use_reentrant=checkpointed, warmup_steps=1)


def _perturb_routers(model: L.LightningModule) -> None:
    g = torch.Generator().manual_seed(123)
    for _, layer in find_moe_layers(model):
        w = layer.router.weight
        w.data += torch.randn(w.shape, generator=g) * 10 * w.data.std()


def _recorded(root: Path) -> dict[Key, dict[str, Any]]:
    steps: dict[Key, dict[str, Any]] = {}
    for file in sorted(root.glob("rank00000-step*.pt")):
        steps.update(load_shard(file)["steps"])
    return steps


def test_replay_forces_recorded_ids_after_router_perturbation(tmp_path: Path) -> None:
    routes = tmp_path / "routes"
    record_spy = RoutingSpy()
    _fit(_model(), tmp_path / "a", [RouterReplay("record", str(routes), steps_per_file=2), record_spy])
    recorded = _recorded(routes)
    assert sorted(recorded) == [(s, m) for s in range(3) for m in range(2)]
    assert len(list(routes.glob("*.pt"))) == 2  # steps 0-1, then step 2 at the end of training
    for key, layers in recorded.items():
        for name, ids in layers.items():
            assert ids.dtype == torch.int16
            assert torch.equal(ids.long(), record_spy.ids[key][name][0])

    free = _model()
    _perturb_routers(free)
    seen: list[torch.Tensor] = []
    first_name, first_layer = find_moe_layers(free)[0]
    first_layer.router.register_forward_hook(lambda m, a, out: seen.append(out.routed_ids_TK))
    with torch.no_grad():
        free(next(iter(token_loader()))["input_ids"])
    assert not torch.equal(seen[0], recorded[(0, 0)][first_name].long())  # perturbed routers route differently

    replay_spy = RoutingSpy()
    replayed = _model()
    _perturb_routers(replayed)
    _fit(replayed, tmp_path / "c", [RouterReplay("replay", str(routes)), replay_spy])
    assert sorted(replay_spy.ids) == sorted(recorded)
    for key, layers in recorded.items():
        assert sorted(replay_spy.ids[key]) == sorted(layers)
        for name, ids in layers.items():
            assert all(torch.equal(seen, ids.long()) for seen in replay_spy.ids[key][name]), (key, name)
    assert len(replay_spy.grad_norms) == 3
    assert all(norm > 0 for step in replay_spy.grad_norms for norm in step.values())
    assert all(layer.router._override is None for _, layer in find_moe_layers(replayed))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_replay_is_consistent_under_activation_recompute(tmp_path: Path, use_reentrant: bool) -> None:
    routes = tmp_path / "routes"
    _fit(_model(checkpointed=use_reentrant), tmp_path / "a", [RouterReplay("record", str(routes))], max_steps=2)
    recorded = _recorded(routes)

    spy = RoutingSpy()
    model = _model(checkpointed=use_reentrant)
    _perturb_routers(model)
    _fit(model, tmp_path / "b", [RouterReplay("replay", str(routes)), spy], max_steps=2)
    for key, layers in recorded.items():
        for name, ids in layers.items():
            seen = spy.ids[key][name]
            assert len(seen) == 2, "the forward and its recompute"
            assert all(torch.equal(s, ids.long()) for s in seen), (key, name)
    assert all(norm > 0 for step in spy.grad_norms for norm in step.values())


@pytest.fixture(scope="module")
def one_step_routes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recording of one optimizer step (2 micro-batches of 2 x 8 tokens), shared by the tests below."""
    root = tmp_path_factory.mktemp("one_step")
    _fit(_model(), root, [RouterReplay("record", str(root / "r"))], max_steps=1)
    return root / "r"


def test_shard_file_format_is_versioned_and_self_describing(one_step_routes: Path) -> None:
    data = torch.load(one_step_routes / shard_name(0, 0), weights_only=True)
    assert data["format"] == FORMAT and data["version"] == VERSION == 1
    assert (data["rank"], data["world_size"]) == (0, 1)
    assert data["layers"] == ["model.layers.0.ffn", "model.layers.1.ffn"]
    assert data["num_experts"] == {n: 4 for n in data["layers"]} and data["top_k"] == {n: 2 for n in data["layers"]}
    assert list(data["steps"]) == [(0, 0), (0, 1)]
    assert data["steps"][(0, 0)]["model.layers.1.ffn"].shape == (16, 2)  # batch 2 x seq 8 tokens, top-2


def test_replay_past_the_recording_names_step_and_layer(tmp_path: Path, one_step_routes: Path) -> None:
    routes = str(one_step_routes)
    with pytest.raises(RuntimeError, match=r"global_step=1, micro_batch=0 \(layer 'model.layers.0.ffn'\)"):
        _fit(_model(), tmp_path, [RouterReplay("replay", routes)], max_steps=2)


def test_replay_with_other_batch_shape_names_step_layer_and_shapes(tmp_path: Path, one_step_routes: Path) -> None:
    routes = str(one_step_routes)
    match = r"layer 'model.layers.0.ffn' at global_step=0, micro_batch=0 have shape \(16, 2\).* routes \(8, 2\)"
    with pytest.raises(ValueError, match=match):
        _fit(_model(), tmp_path, [RouterReplay("replay", routes)], max_steps=1, seq_len=4)


def test_replay_without_recording_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        _fit(_model(), tmp_path, [RouterReplay("replay", str(tmp_path / "nothing"))], max_steps=1)


def test_model_without_moe_layer_is_refused_with_the_fix(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, [RouterReplay("record", str(tmp_path / "r"))], max_steps=1)
    with pytest.raises(ValueError, match=r"RouterReplay: BoringModel holds no .*MoELayer.*swap_moe_blocks"):
        trainer.fit(BoringModel())


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"mode": "play"}, "mode='play'"), ({"steps_per_file": 0}, "steps_per_file=0")]
)
def test_bad_arguments_are_rejected_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RouterReplay(**{"mode": "record", "path": "x", **kwargs})


# ---- driven without a Trainer: the callback's hooks called by hand on a bare MoELayer ------------


def _bare_model(num_experts: int, top_k: int = 2, hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=hidden, ffn_hidden_size=8, num_experts=num_experts, top_k=top_k, pre_softmax=True,
        aux_loss="none", experts_backend="torch",
    )  # fmt: skip
    return torch.nn.Sequential(MoELayer(cfg))  # the layer is named "0"


def _trainer_stub(step: int = 0) -> Any:
    return SimpleNamespace(global_step=step, global_rank=0, world_size=1)


def test_recorded_ids_of_more_than_int16_experts_are_kept_in_int32(tmp_path: Path) -> None:
    model, trainer = _bare_model(num_experts=40_000), _trainer_stub()
    with torch.no_grad():
        model[0].router.weight.zero_()
        model[0].router.weight[39_999] = 1.0  # every token's top expert is 39999 (> int16 max 32767)
    rr = RouterReplay("record", str(tmp_path / "r"))
    rr.setup(trainer, model, "fit")
    rr.on_train_batch_start(trainer, model, None, 0)
    with torch.no_grad():
        model(torch.ones(1, 3, 8))
    rr.on_train_batch_end(trainer, model, None, None, 0)
    rr.on_train_end(trainer, model)
    ids = load_shard(tmp_path / "r" / shard_name(0, 0))["steps"][(0, 0)]["0"]
    assert ids.dtype == torch.int32
    assert ids[:, 0].tolist() == [39_999, 39_999, 39_999]


def test_recompute_of_repeated_identical_forwards_gets_each_forwards_replayed_ids(tmp_path: Path) -> None:
    # One layer runs twice on the same input per micro-batch, each call checkpointed on its own:
    # backward recomputes call 2 first, then call 1, and each must see the ids replayed to it.
    ids_call1 = torch.tensor([[0, 1], [0, 1], [0, 1]], dtype=torch.int16)
    ids_call2 = torch.tensor([[2, 3], [3, 2], [2, 3]], dtype=torch.int16)
    routes = tmp_path / "r"
    routes.mkdir()
    shard = {
        "format": FORMAT, "version": VERSION, "rank": 0, "world_size": 1, "layers": ["0"],
        "num_experts": {"0": 4}, "top_k": {"0": 2}, "steps": {(0, 0): {"0": [ids_call1, ids_call2]}},
    }  # fmt: skip
    torch.save(shard, routes / shard_name(0, 0))
    model, trainer = _bare_model(num_experts=4), _trainer_stub()
    seen: list[torch.Tensor] = []
    model[0].router.register_forward_hook(lambda m, a, out: seen.append(out.routed_ids_TK.clone()))
    rr = RouterReplay("replay", str(routes))
    rr.setup(trainer, model, "fit")
    rr.on_train_batch_start(trainer, model, None, 0)
    x = torch.randn(1, 3, 8, requires_grad=True)
    y1 = checkpoint_utils.checkpoint(model, x, use_reentrant=False)
    y2 = checkpoint_utils.checkpoint(model, x, use_reentrant=False)
    (y1.sum() + 2 * y2.sum()).backward()
    rr.on_train_batch_end(trainer, model, None, None, 0)
    assert len(seen) == 4, "two forwards and their two recomputes"
    expected = [ids_call1, ids_call2, ids_call2, ids_call1]  # forward order, then backward (reverse) order
    assert all(torch.equal(s, e.long()) for s, e in zip(seen, expected)), seen
