"""parallelize.py pieces that need a mesh but no data movement: rank 1 of a fake 2-rank world."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_moe.config import MoEConfig
from lightning_moe.moe.layer import MoELayer
from lightning_moe.parallel.layout import FoldedLayout
from lightning_moe.parallel.mesh import FoldedMesh
from lightning_moe.parallel.parallelize import init_experts_by_id, parallelize_moe_model

E, H, F = 4, 8, 4


@pytest.fixture
def ep2_rank1_mesh(fake_world: Callable[[int, int], None]) -> FoldedMesh:
    fake_world(1, 2)
    return FoldedMesh.build(FoldedLayout(2, ep=2), "cpu")


def test_init_experts_by_id_draws_every_global_expert_from_its_own_seed(ep2_rank1_mesh: FoldedMesh) -> None:
    """EP rank 1 holds global experts 2 and 3; expert g of MoE layer l comes from ``seed + 7919*l + g``."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=2)
    model = torch.nn.ModuleList([MoELayer(cfg), MoELayer(cfg)])
    parallelize_moe_model(model, mesh=ep2_rank1_mesh, fsdp=False)  # experts: DTensors of this rank's 2
    init_experts_by_id(model, ep2_rank1_mesh, seed=5)
    std = cfg.init_std
    for l, layer in enumerate(model):
        for j, g in enumerate((2, 3)):
            gen = torch.Generator().manual_seed(5 + 7919 * l + g)
            w13 = torch.randn(H, 2 * F, generator=gen) * std
            w2 = torch.randn(F, H, generator=gen) * std
            torch.testing.assert_close(layer.experts.w13.to_local()[j].detach(), w13, rtol=0, atol=0)
            torch.testing.assert_close(layer.experts.w2.to_local()[j].detach(), w2, rtol=0, atol=0)


def test_init_experts_by_id_leaves_experts_seeded_or_loaded_already(ep2_rank1_mesh: FoldedMesh) -> None:
    """A second seeding (a strategy set up again for validate after fit) and a layer whose experts
    hold loaded weights keep their values; the first seeding marks the layers it drew."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=2)
    model = torch.nn.ModuleList([MoELayer(cfg), MoELayer(cfg)])
    parallelize_moe_model(model, mesh=ep2_rank1_mesh, fsdp=False)
    with torch.no_grad():
        model[1].experts.w13.to_local().fill_(0.5)  # "loaded"
    model[1].experts.seeded_or_loaded = True
    init_experts_by_id(model, ep2_rank1_mesh, seed=5)
    seeded = model[0].experts.w13.to_local().detach().clone()
    assert model[0].experts.seeded_or_loaded
    assert bool((model[1].experts.w13.to_local() == 0.5).all())
    init_experts_by_id(model, ep2_rank1_mesh, seed=6)
    torch.testing.assert_close(model[0].experts.w13.to_local().detach(), seeded, rtol=0, atol=0)
    assert bool((model[1].experts.w13.to_local() == 0.5).all())
