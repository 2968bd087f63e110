"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.ops import build_cutlass


@pytest.fixture
def needs_cutlass() -> None:
    """Skip without a GPU or the CUTLASS headers; fail when they are here but the kernels did not build."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reason = build_cutlass.cutlass_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    if build_cutlass.load_cutlass_extension() is None:
        pytest.fail("the CUTLASS kernels are available here but did not build; see the warning")
