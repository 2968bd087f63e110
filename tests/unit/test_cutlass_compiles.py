"""The optional CUTLASS kernels in csrc/cutlass compile for sm_90a with a bare nvcc, and link.

Like test_csrc_compiles.py this runs on the CPU dev machine: the kernel files include only CUDA
and CUTLASS headers (bindings.cpp alone sees torch). Needs nvcc and the CUTLASS headers
(``pip install --no-deps nvidia-cutlass``, as ``.ci/run`` does, or LIGHTNING_MOE_CUTLASS_DIR);
skipped, saying which is missing, otherwise. A few minutes on two cores (seven files).
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_moe.ops.build_cutlass import CUDA_FLAGS, cutlass_include_dirs

from test_csrc_compiles import NVCC, TORCH_NVCC_FLAGS  # same folder: pytest puts it on sys.path

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cutlass"
KERNEL_FILES = sorted(p.name for p in SOURCE.glob("*.cu"))
INCLUDES = cutlass_include_dirs()
# Each kernel family: its dispatch file (<family>.cu, CUTLASS-free), header (<family>.h) and the
# prefix of its per-tiling entry points in the dispatch table (&<prefix>_<tiling>}).
FAMILIES = {"grouped_wgrad": "wgrad", "grouped_gemm": "gemm", "fp8_blockwise_grouped": "fp8"}
DISPATCH_FILES = tuple(f"{family}.cu" for family in FAMILIES)

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH)"),
    pytest.mark.skipif(
        INCLUDES is None, reason="CUTLASS headers not found (pip install --no-deps nvidia-cutlass)"
    ),
    # the shared fixture compiles every kernel file (two at a time) inside the first test's time
    pytest.mark.timeout(1800),
]


def _nvcc(*args: str) -> subprocess.CompletedProcess[str]:
    includes = [f"-I{p}" for p in (SOURCE, *(INCLUDES or ()))]
    flags = [f for f in CUDA_FLAGS if f != "-lineinfo"]
    return subprocess.run([NVCC, *flags, *TORCH_NVCC_FLAGS, "-Xcompiler", "-fPIC", *includes, *args],
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    out = tmp_path_factory.mktemp("cutlass_objs")
    jobs = {name: out / f"{Path(name).stem}.o" for name in KERNEL_FILES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_nvcc, "-c", str(SOURCE / name), "-o", str(obj)) for name, obj in jobs.items()}
        return {name: (f.result(), jobs[name]) for name, f in futures.items()}


def _errors(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    return "\n".join(lines[:10]) or proc.stderr[-2000:]


def test_the_cutlass_room_holds_its_files() -> None:
    assert {"grouped_wgrad.cu", "grouped_wgrad_cooperative_c1x2.cu", "grouped_gemm.cu"} <= set(KERNEL_FILES)
    # every other .cu is one tiling of a family, named in that family's dispatch table
    for name in set(KERNEL_FILES) - set(DISPATCH_FILES):
        family = next((f for f in FAMILIES if name.startswith(f"{f}_")), None)
        assert family is not None, f"{name} belongs to no family {tuple(FAMILIES)}"
        tiling = name[len(family) + 1 : -3]
        dispatcher = (SOURCE / f"{family}.cu").read_text()
        assert f"&{FAMILIES[family]}_{tiling}}}" in dispatcher, f"{name}: {tiling} is not in {family}.cu's table"
    assert (SOURCE / "bindings.cpp").exists()
    assert all((SOURCE / f"{family}.h").exists() for family in FAMILIES)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_compiles_for_sm90a(name: str, objects: dict) -> None:
    proc, obj = objects[name]
    assert proc.returncode == 0, f"nvcc failed on {name}:\n{_errors(proc)}"
    assert obj.exists()


def test_the_tensor_core_kernels_use_wgmma_and_tma(objects: dict) -> None:
    """A tiling that silently fell back to an older MMA would still compile; the SASS says which."""
    cuobjdump = Path(NVCC).with_name("cuobjdump")
    if not cuobjdump.exists():
        pytest.skip("cuobjdump is not beside nvcc")
    for name in (n for n in KERNEL_FILES if n not in DISPATCH_FILES):
        proc, obj = objects[name]
        if proc.returncode != 0:
            pytest.skip(f"{name} did not compile")
        sass = subprocess.run([str(cuobjdump), "-sass", str(obj)], capture_output=True, text=True, timeout=120).stdout
        assert "HGMMA" in sass and "UTMALDG" in sass, name


def test_the_launchers_link(objects: dict, tmp_path: Path) -> None:
    if any(proc.returncode for proc, _ in objects.values()):
        pytest.skip("a file did not compile (reported above)")
    main = tmp_path / "main.cu"
    main.write_text(
        '#include "grouped_gemm.h"\n'
        '#include "grouped_wgrad.h"\n'
        '#include "fp8_blockwise_grouped.h"\n'
        "using namespace lightning_moe::cutlass_kernels;\n"
        "int main() {\n"
        "  auto* a = &grouped_wgrad; auto* b = &grouped_wgrad_workspace_bytes;\n"
        "  auto* c = &grouped_gemm; auto* d = &grouped_gemm_workspace_bytes;\n"
        "  auto* e = &fp8_blockwise_grouped; auto* f = &fp8_blockwise_grouped_workspace_bytes;\n"
        "  return (a && b && c && d && e && f) ? 0 : 1;\n"
        "}\n"
    )
    objs = [str(obj) for _, obj in objects.values()]
    proc = _nvcc(str(main), *objs, "-o", str(tmp_path / "linked"))
    assert proc.returncode == 0, _errors(proc)


def test_the_header_compiles_as_plain_host_cpp(tmp_path: Path) -> None:
    src = tmp_path / "host_only.cpp"
    src.write_text("".join(f'#include "{family}.h"\n' for family in FAMILIES) + "int main() { return 0; }\n")
    proc = subprocess.run([NVCC, "-std=c++17", "-x", "c++", f"-I{SOURCE}", "-c", str(src), "-o", str(tmp_path / "h.o")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, _errors(proc)
