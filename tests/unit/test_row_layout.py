"""The row kernels' thread layout (csrc/moe_kernels.cuh), checked on the CPU machine.

``threads_per_row_log2`` (one vector per thread: the permute kernels) and
``threads_per_row_log2_at_least`` (at least m vectors per thread: the SwiGLU kernels) are host
functions; a small program built with nvcc prints their choices and runs here without a GPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_csrc_compiles import NVCC  # same folder: pytest puts it on sys.path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
WIDTHS = [1, 2, 3, 7, 8, 48, 96, 100, 128, 256, 257, 384, 512, 896, 1024, 4096]

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], int]:
    """(vectors per row, m) -> log2 threads per row, as the launchers compute them."""
    tmp = tmp_path_factory.mktemp("row_layout")
    calls = "\n".join(
        f'  std::printf("%d %d %d\\n", {v}, {m}, '
        f"lightning_moe::detail::threads_per_row_log2_at_least({v}, {m}));"
        for v in WIDTHS
        for m in (1, 2, 4)
    )
    src = tmp / "layout.cu"
    src.write_text(f'#include <cstdio>\n#include "moe_kernels.cuh"\nint main() {{\n{calls}\n  return 0;\n}}\n')
    exe = tmp / "layout"
    build = subprocess.run(
        [NVCC, "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-I", str(CSRC), str(src), "-o", str(exe)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)  # host code only: no GPU
    assert run.returncode == 0, run.stderr
    out = {}
    for line in run.stdout.split("\n"):
        if line.strip():
            v, m, log2 = map(int, line.split())
            out[v, m] = log2
    return out


def test_one_vector_per_thread_covers_the_row(layouts: dict) -> None:
    """m = 1 (the permute kernels): the power of two at or above the row's vectors, at most 256."""
    for v in WIDTHS:
        p = 1 << layouts[v, 1]
        assert p <= 256 and (p >= v or p == 256) and (p == 1 or p // 2 < v), (v, p)


def test_several_vectors_per_thread_leave_no_idle_lane_on_the_benchmark_widths(layouts: dict) -> None:
    """m = 2 (the SwiGLU kernels): Qwen3's F = 768 (96 vectors) gets 32 threads with 3 vectors each
    (one vector per thread would spread it over 128 threads, 32 of them idle); DeepSeek-V3's and
    Mixtral's widths split evenly too."""
    assert 1 << layouts[96, 2] == 32
    assert 1 << layouts[256, 2] == 128
    assert 1 << layouts[896, 2] == 128
    assert 1 << layouts[4096, 2] == 256
    for v in (96, 256, 896, 4096):
        assert v % (1 << layouts[v, 2]) == 0


@pytest.mark.parametrize("m", [2, 4])
def test_each_thread_gets_at_least_m_vectors_and_the_fewest_idle_lanes(layouts: dict, m: int) -> None:
    for v in WIDTHS:
        p = 1 << layouts[v, m]
        if v < 2:
            assert p == 1
            continue
        assert p * m <= v or p == 1, (v, m, p)
        steps = -(-v // p)
        use = v / (p * steps)
        # No smaller or larger allowed power of two wastes fewer lanes (ties go to more threads).
        for q in (1 << k for k in range(9)):
            if q * m <= v:
                assert v / (q * -(-v // q)) <= use + 1e-12, (v, m, p, q)
