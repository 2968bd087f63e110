"""``LIGHTNING_MOE_KERNELS`` and the other machine facts: one parser, read once per process."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_moe import resources
from lightning_moe.ops import backend, build, build_cutlass


@pytest.fixture(autouse=True)
def _fresh_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("LIGHTNING_MOE_KERNELS", "LIGHTNING_MOE_CACHE", "LIGHTNING_MOE_CUTLASS_DIR"):
        monkeypatch.delenv(name, raising=False)
    resources.reread_environment()
    yield
    monkeypatch.undo()
    resources.reread_environment()  # the next test sees this process's real environment


def _set(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("LIGHTNING_MOE_KERNELS", value)
    resources.reread_environment()


def _cuda_like() -> SimpleNamespace:
    """What ``csrc_extension`` reads of a tensor, as a CUDA tensor would show it (no GPU needed)."""
    return SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)


@pytest.mark.parametrize(
    ("raw", "mode"),
    [(None, "auto"), ("", "auto"), ("   ", "auto"), ("torch", "torch"), (" Torch\n", "torch"), ("\tCSRC ", "csrc"),
     ("auto", "auto")],
)
def test_values_are_read_without_case_or_surrounding_whitespace(raw: str | None, mode: str) -> None:
    assert resources.parse_kernels_mode(raw) == mode


@pytest.mark.parametrize("raw", ["cuda", "tor ch", "1", "csrc,torch"])
def test_a_bad_value_is_named_with_the_choices(raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"LIGHTNING_MOE_KERNELS={raw!r} is unknown; choose one of auto, csrc, torch")):
        resources.parse_kernels_mode(raw)


def test_the_variable_is_read_once_until_asked_to_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, "torch")
    assert resources.kernels_mode() == "torch"
    monkeypatch.setenv("LIGHTNING_MOE_KERNELS", "csrc")
    assert resources.kernels_mode() == "torch"  # not read again on every call
    resources.reread_environment()
    assert resources.kernels_mode() == "csrc"


@pytest.mark.parametrize("raw", ["torch", " torch ", "TORCH\n"])
def test_the_op_backend_and_the_builders_agree(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op-call backend and both JIT builders see the same mode for the same value."""
    _set(monkeypatch, raw)
    assert backend.csrc_extension(_cuda_like()) is None  # type: ignore[arg-type]
    assert build.load_extension() is None  # torch: no build, no warning
    assert build_cutlass.cutlass_unavailable_reason() == "LIGHTNING_MOE_KERNELS=torch"


def test_a_bad_value_fails_alike_at_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    _set(monkeypatch, " cuda ")
    readers = (
        lambda: backend.csrc_extension(_cuda_like()),  # type: ignore[arg-type]
        build.load_extension,
        build_cutlass.cutlass_unavailable_reason,
    )
    for read in readers:
        with pytest.raises(ValueError, match=re.escape("LIGHTNING_MOE_KERNELS=' cuda ' is unknown")):
            read()


def test_the_build_cache_and_cutlass_directories(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert resources.build_cache_dir() == Path.home() / ".cache" / "lightning_moe"
    assert resources.cutlass_dir() is None
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", f" {tmp_path} ")
    monkeypatch.setenv("LIGHTNING_MOE_CUTLASS_DIR", "  ")
    assert resources.build_cache_dir() == Path.home() / ".cache" / "lightning_moe"  # read once
    resources.reread_environment()
    assert build.cache_dir() == resources.build_cache_dir() == tmp_path
    assert resources.cutlass_dir() is None  # blank is unset


def test_only_the_resources_module_reads_the_environment() -> None:
    root = Path(resources.__file__).parent
    readers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"os\.(environ|getenv)\b", path.read_text())
    )
    assert readers == ["resources.py"]
