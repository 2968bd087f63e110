"""Which grouped GEMM the layer's forward and data-gradient products run (ops/grouped_gemm_cutlass.layer_tiling)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe.ops import grouped_gemm_cutlass as cg

# Rows on a GPU (only .is_cuda and .shape are read before `supported`), the benchmark shapes' row counts.
CUDA_ROWS = SimpleNamespace(is_cuda=True, shape=(16384 * 8, 2048))  # 512 an expert of DeepSeek-V3's 256
QWEN3_W13 = torch.empty(128, 2048, 1536, dtype=torch.bfloat16, device="meta")  # 6.3 MB an expert: narrow
DEEPSEEK_W2 = torch.empty(256, 2048, 7168, dtype=torch.bfloat16, device="meta")  # 29 MB an expert: wide
MIXTRAL_W2 = torch.empty(8, 14336, 4096, dtype=torch.bfloat16, device="meta")  # 117 MB, but 16384 rows an expert here


@pytest.fixture
def cutlass_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cg, "supported", lambda a, w: True)


@pytest.mark.parametrize(
    ("kernel", "tile", "w", "expected"),
    [
        ("auto", cg.DEFAULT_TILE, DEEPSEEK_W2, "pingpong-64x256"),
        ("auto", cg.DEFAULT_TILE, DEEPSEEK_W2.transpose(1, 2), "pingpong-64x256"),  # the data gradient's view
        ("auto", cg.DEFAULT_TILE, QWEN3_W13, None),
        ("auto", cg.DEFAULT_TILE, MIXTRAL_W2, None),  # wide, but many rows an expert: F.grouped_mm measured faster
        ("torch", cg.DEFAULT_TILE, DEEPSEEK_W2, None),
        ("cutlass", cg.DEFAULT_TILE, QWEN3_W13, "cooperative-128x256-c2x1"),
        ("cutlass", "pingpong-64x256", QWEN3_W13, "pingpong-64x256"),
    ],
)
def test_layer_tiling_follows_the_setting_and_the_width(cutlass_built, kernel, tile, w, expected) -> None:  # noqa: ANN001
    assert cg.layer_tiling(CUDA_ROWS, w, kernel, tile) == expected


def test_no_cutlass_without_a_gpu_or_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cg.layer_tiling(torch.empty(4, 2048, dtype=torch.bfloat16), DEEPSEEK_W2, "cutlass") is None  # CPU rows
    monkeypatch.setattr(cg, "supported", lambda a, w: False)
    assert cg.layer_tiling(CUDA_ROWS, DEEPSEEK_W2, "cutlass") is None


def test_unknown_kernel_is_named() -> None:
    with pytest.raises(ValueError, match=r"kernel='cublas' is not one of"):
        cg.layer_tiling(CUDA_ROWS, DEEPSEEK_W2, "cublas")


def test_the_built_tilings_are_the_ones_the_config_offers() -> None:
    from typing import get_args

    from lightning_moe.config import GemmCutlassTile, GemmKernel, WgradKernel
    from lightning_moe.ops.wgrad import WGRAD_KERNELS

    assert set(get_args(GemmCutlassTile)) == set(cg.TILES) and cg.WIDE_TILE in cg.TILES
    assert set(get_args(GemmKernel)) == set(cg.GEMM_KERNELS)
    assert set(get_args(WgradKernel)) == set(WGRAD_KERNELS)


@pytest.mark.parametrize("gemm,tile", [("auto", "cooperative-128x256-c2x1"), ("torch", "pingpong-64x256"),
                                       ("cutlass", "pingpong-64x256")])
@pytest.mark.parametrize("memory_efficient_permute", [True, False])
def test_the_configured_gemm_kernel_reaches_the_op(monkeypatch, gemm, tile, memory_efficient_permute) -> None:  # noqa: ANN001
    """KernelConfig(gemm=..., gemm_cutlass_tile=...) is read once at construction and handed, as plain
    strings, to every forward and data-gradient GEMM of the layer (fused local path and plain path)."""
    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.config import KernelConfig

    seen: list[tuple[str, str]] = []
    real = cg.layer_tiling

    def spy(a, w, kernel="auto", tile=cg.DEFAULT_TILE):  # noqa: ANN001, ANN202
        seen.append((kernel, tile))
        return real(a, w, kernel, tile)

    monkeypatch.setattr(cg, "layer_tiling", spy)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(
        hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, experts_backend="torch",
        memory_efficient_permute=memory_efficient_permute, kernels=KernelConfig(gemm=gemm, gemm_cutlass_tile=tile),
    ))  # fmt: skip
    layer(torch.randn(12, 16, requires_grad=True)).sum().backward()
    assert len(seen) == 4 and set(seen) == {(gemm, tile)}  # up, down, and both data gradients
