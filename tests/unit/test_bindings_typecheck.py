"""csrc/bindings.cpp (and csrc/cutlass/bindings.cpp) type-check against this machine's (CPU) torch headers.

The kernels compile with nvcc alone (``test_csrc_compiles.py``); the binding file needs torch's
CUDA headers, which a CPU build of torch ships without the cuBLAS/cuSPARSE headers they include.
Two small stand-ins (``_cuda_stubs/``: the current stream and the device guard) take their place,
so ``g++ -fsyntax-only`` checks every other line: argument checks, messages, op registration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "_cuda_stubs"


def _cuda_include() -> Path | None:
    candidates = [Path(home) / "include" for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if home]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(Path(nvcc).resolve().parents[1] / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_runtime_api.h").exists()), None)


CXX = shutil.which("g++")
CUDA_INCLUDE = _cuda_include()


@pytest.mark.skipif(CXX is None or CUDA_INCLUDE is None, reason="needs g++ and the CUDA runtime headers")
@pytest.mark.parametrize("room", ["csrc", "csrc/cutlass"])
def test_bindings_type_check_against_torch_headers(room: str) -> None:
    includes = [STUBS, *map(Path, cpp_extension.include_paths()), CUDA_INCLUDE, ROOT / room]
    cmd = [
        str(CXX), "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=lightning_moe_C",
        *(f"-I{p}" for p in includes), f"-I{sysconfig.get_paths()['include']}", str(ROOT / room / "bindings.cpp"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:20]) or result.stderr[-4000:]
