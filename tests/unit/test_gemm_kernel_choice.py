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
        ("auto", None, DEEPSEEK_W2, "pingpong-64x256"),
        ("auto", None, DEEPSEEK_W2.transpose(1, 2), "pingpong-64x256"),  # the data gradient's view
        ("auto", None, QWEN3_W13, None),
        ("auto", None, MIXTRAL_W2, None),  # wide, but many rows an expert: F.grouped_mm measured faster
        ("torch", None, DEEPSEEK_W2, None),
        ("cutlass", None, QWEN3_W13, cg.DEFAULT_TILE),
        ("cutlass", "pingpong-128x128", QWEN3_W13, "pingpong-128x128"),
    ],
)
def test_layer_tiling_follows_the_setting_and_the_width(cutlass_built, monkeypatch, kernel, tile, w, expected) -> None:  # noqa: ANN001
    monkeypatch.setenv("LIGHTNING_MOE_GEMM_KERNEL", kernel)
    if tile is None:
        monkeypatch.delenv("LIGHTNING_MOE_GEMM_CUTLASS_TILE", raising=False)
    else:
        monkeypatch.setenv("LIGHTNING_MOE_GEMM_CUTLASS_TILE", tile)
    assert cg.layer_tiling(CUDA_ROWS, w) == expected


def test_no_cutlass_without_a_gpu_or_a_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_MOE_GEMM_KERNEL", "cutlass")
    assert cg.layer_tiling(torch.empty(4, 2048, dtype=torch.bfloat16), DEEPSEEK_W2) is None  # CPU rows
    monkeypatch.setattr(cg, "supported", lambda a, w: False)
    assert cg.layer_tiling(CUDA_ROWS, DEEPSEEK_W2) is None


def test_unknown_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_MOE_GEMM_KERNEL", "cublas")
    with pytest.raises(ValueError, match=r"LIGHTNING_MOE_GEMM_KERNEL='cublas' is unknown"):
        cg.layer_tiling(CUDA_ROWS, DEEPSEEK_W2)
    monkeypatch.setenv("LIGHTNING_MOE_GEMM_KERNEL", "cutlass")
    monkeypatch.setenv("LIGHTNING_MOE_GEMM_CUTLASS_TILE", "huge")
    monkeypatch.setattr(cg, "supported", lambda a, w: True)
    with pytest.raises(ValueError, match=r"LIGHTNING_MOE_GEMM_CUTLASS_TILE='huge' is unknown"):
        cg.layer_tiling(CUDA_ROWS, DEEPSEEK_W2)
