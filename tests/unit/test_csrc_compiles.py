"""The CUDA kernels in csrc/ compile for sm_90 with a bare nvcc, without spills, and link.

This runs on the CPU dev machine (nvcc present, no GPU, no CUDA torch headers), which is what
keeps broken kernels from landing: the kernel files include only CUDA headers by design. The
flags mirror what torch.utils.cpp_extension passes on the GPU machine (its
``__CUDA_NO_*_CONVERSIONS__`` defines are the ones that bite). Files compile two at a time;
the whole module takes well under two minutes on two cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
KERNEL_FILES = sorted(p.name for p in CSRC.glob("*.cu"))
HEADER = CSRC / "moe_kernels.cuh"


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and Path(home, "bin", "nvcc").exists():
            return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or PATH); csrc cannot be compiled here")

# What torch.utils.cpp_extension adds to every nvcc call (COMMON_NVCC_FLAGS).
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def _compile(src: Path, obj: Path) -> subprocess.CompletedProcess[str]:
    # -Xptxas -v rides along on the one compile: it only adds the register/spill report.
    cmd = [
        NVCC, "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-O3", *TORCH_NVCC_FLAGS,
        "-Xptxas", "-v", "-Xcompiler", "-fPIC", "-I", str(CSRC), "-c", str(src), "-o", str(obj),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    out = tmp_path_factory.mktemp("csrc_objs")
    jobs = {name: (CSRC / name, out / f"{Path(name).stem}.o") for name in KERNEL_FILES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_compile, src, obj) for name, (src, obj) in jobs.items()}
        return {name: (f.result(), jobs[name][1]) for name, f in futures.items()}


def _errors(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    return "\n".join(lines[:10]) or proc.stderr[-2000:]


def _spills(ptxas_report: str) -> dict[str, int]:
    """Kernel (mangled name) -> bytes of spill stores, from ``ptxas -v`` output."""
    spills: dict[str, int] = {}
    current = "?"
    for line in ptxas_report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and int(m.group(1)) > 0:
            spills[current] = int(m.group(1))
    return spills


def test_csrc_holds_the_kernel_files() -> None:
    assert {"permute.cu", "swiglu.cu", "routing.cu"} <= set(KERNEL_FILES), KERNEL_FILES
    assert HEADER.exists()


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_file_compiles_for_sm90(name: str, compiled: dict) -> None:
    proc, obj = compiled[name]
    assert proc.returncode == 0, f"nvcc failed on {name}:\n{_errors(proc)}"
    assert obj.exists()


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernels_do_not_spill_registers(name: str, compiled: dict) -> None:
    proc, _ = compiled[name]
    if proc.returncode != 0:
        pytest.skip(f"{name} did not compile (reported by test_kernel_file_compiles_for_sm90)")
    spills = _spills(proc.stderr + proc.stdout)
    assert not spills, f"{name}: kernels spill registers (bytes of spill stores): {spills}"


def test_header_compiles_as_plain_host_cpp(tmp_path: Path) -> None:
    # bindings.cpp includes the header with the host compiler: nothing device-side may leak out
    # of its __CUDACC__ guard.
    src = tmp_path / "host_only.cpp"
    src.write_text('#include "moe_kernels.cuh"\nint main() { return 0; }\n')
    proc = subprocess.run(
        [NVCC, "-std=c++17", "-x", "c++", "-I", str(CSRC), "-c", str(src), "-o", str(tmp_path / "h.o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, _errors(proc)


def test_every_declared_launcher_links(compiled: dict, tmp_path: Path) -> None:
    # A definition whose signature drifted from its declaration compiles fine and only fails
    # when the extension links on the GPU machine; linking a host program that takes the address
    # of every declared launcher catches that here.
    procs = [proc for proc, _ in compiled.values()]
    if any(p.returncode != 0 for p in procs):
        pytest.skip("a kernel file did not compile (reported by test_kernel_file_compiles_for_sm90)")
    host_part = HEADER.read_text().split("\n#ifdef __CUDACC__")[0]  # the launcher declarations
    names = re.findall(r"^(?:cudaError_t|size_t)\s+(\w+)\(", host_part, flags=re.MULTILINE)
    assert len(names) >= 8, names
    refs = "\n".join(f"  use(reinterpret_cast<const void*>(&lightning_moe::{n}));" for n in names)
    src = tmp_path / "link_check.cpp"
    src.write_text(
        '#include <cstdio>\n#include "moe_kernels.cuh"\n'
        "static void use(const void* p) { std::printf(\"%p\\n\", p); }\n"
        f"int main() {{\n{refs}\n  return 0;\n}}\n"
    )
    objs = [str(obj) for _, obj in compiled.values()]
    proc = subprocess.run(
        [NVCC, "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-I", str(CSRC), str(src), *objs,
         "-o", str(tmp_path / "link_check")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"launchers declared in moe_kernels.cuh do not link:\n{proc.stderr[-3000:]}"
