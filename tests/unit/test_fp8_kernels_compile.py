"""The FP8 kernels' numbers against torch on the CPU, and their Python wrappers without a GPU.

Legend: R rows, S source rows, H row width, F expert FFN width, K contracted width, N output width,
E experts.

``csrc/fp8_codec.cuh`` holds the arithmetic of ``csrc/fp8_quant.cu`` (the fp32 -> FP8 encoding, the
scale of a unit, one value's quantization) as plain C++. A small host program built from it with
g++ (or nvcc) turns files of fp32 values into codes and scales, which must equal torch's: the
``.to(float8)`` conversion (after the clamp quantize.py applies) on every FP8 value, every midpoint
between neighbours (the ties) and one fp32 step either side of it, random values over 50 binades,
and the specials; ``scales_from_amax`` of quantize.py on random, tiny, huge and non-finite amaxes.
The kernels themselves are compiled for sm_90 by test_csrc_compiles.py (every csrc/*.cu) and
test_cutlass_compiles.py (every csrc/cutlass/*.cu), and run against quantize.py in
tests/gpu/test_fp8_kernels_gpu.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_moe.ops.fp8 import kernels
from lightning_moe.ops.fp8.quantize import quantize, scales_from_amax
from lightning_moe.ops.fp8.recipe import FP8_DTYPE, FP8_MAX

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CXX = shutil.which("g++") or shutil.which("nvcc")

_MAIN = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "fp8_codec.cuh"
using namespace lightning_moe::fp8;

static std::vector<float> load(const char* path) {
  std::vector<float> out;
  FILE* f = std::fopen(path, "rb");
  float v;
  while (std::fread(&v, sizeof v, 1, f) == 1) out.push_back(v);
  std::fclose(f);
  return out;
}

// codec quant <e4m3|e5m2> values scales out  -> uint8 codes of quantize_value(v, s)
// codec scale <e4m3|e5m2> <0|1> amax out     -> fp32 unit_scale(amax, amax non-finite, pow2)
int main(int argc, char** argv) {
  const bool e5 = std::strcmp(argv[2], "e5m2") == 0;
  if (std::strcmp(argv[1], "quant") == 0) {
    std::vector<float> v = load(argv[3]), s = load(argv[4]);
    FILE* o = std::fopen(argv[5], "wb");
    for (size_t i = 0; i < v.size(); ++i) {
      const uint32_t q = e5 ? quantize_value<true>(v[i], s[i]) : quantize_value<false>(v[i], s[i]);
      const unsigned char c = static_cast<unsigned char>(q);
      std::fwrite(&c, 1, 1, o);
    }
    std::fclose(o);
  } else {
    const bool pow2 = argv[3][0] == '1';
    std::vector<float> a = load(argv[4]);
    FILE* o = std::fopen(argv[5], "wb");
    for (float x : a) {
      const bool bad = !(x <= FLT_MAX);
      const float s = e5 ? unit_scale<true>(x, bad, pow2) : unit_scale<false>(x, bad, pow2);
      std::fwrite(&s, sizeof s, 1, o);
    }
    std::fclose(o);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory):
    if CXX is None:
        pytest.skip("no C++ compiler (g++ or nvcc) to build the codec check")
    root = tmp_path_factory.mktemp("codec")
    src = root / "codec.cpp"
    src.write_text(_MAIN)
    exe = root / "codec"
    cmd = [CXX, "-std=c++17", "-O2", f"-I{CSRC}", str(src), "-o", str(exe)]
    if Path(CXX).name == "nvcc":
        cmd[1:1] = ["-x", "c++"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def run(*args: str | np.ndarray, out_dtype=np.uint8) -> np.ndarray:
        argv = [str(exe)]
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                path = root / f"in{i}.bin"
                a.astype(np.float32).tofile(path)
                argv.append(str(path))
            else:
                argv.append(a)
        out = root / "out.bin"
        argv.append(str(out))
        subprocess.run(argv, check=True, timeout=120)
        return np.fromfile(out, dtype=out_dtype)

    return run


def _fp8_values(fmt: str) -> torch.Tensor:
    """Every finite FP8 value of the format, as fp32, sorted."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE[fmt]).float()
    return codes[torch.isfinite(codes)].unique()


def _probe_values(fmt: str) -> torch.Tensor:
    """The FP8 values, their midpoints (ties) and one fp32 step either side, random values over 50
    binades, values past the range and the fp32 specials; both signs."""
    vals = _fp8_values(fmt)
    vals = vals[vals >= 0]
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    mids = mids.float()
    assert torch.equal(mids.double(), (vals[:-1].double() + vals[1:].double()) / 2)  # exact in fp32
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(0.0))
    g = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(200_000, generator=g) * 50 - 40 + (5 if fmt == "e5m2" else 0))
    m = FP8_MAX[fmt]
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, m, m * 1.01, m * 1.1, 1e30, tiny, 1e-45, 3e-39, float("inf")])
    pos = torch.cat([vals, mids, up, down, rand, special])
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encoding_equals_torch_on_every_value_and_tie(codec, fmt: str) -> None:
    v = _probe_values(fmt)
    got = torch.from_numpy(codec("quant", fmt, v.numpy(), np.ones(v.numel(), np.float32)))
    m = FP8_MAX[fmt]
    want = v.clamp(-m, m).to(FP8_DTYPE[fmt]).view(torch.uint8)
    bad = got != want
    assert not bad.any(), (
        f"{int(bad.sum())} codes differ, e.g. {v[bad][:5].tolist()}: {got[bad][:5]} vs {want[bad][:5]}"
    )


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nan_encodes_as_nan_with_its_sign(codec, fmt: str) -> None:
    v = torch.tensor([float("nan"), -float("nan")])
    got = codec("quant", fmt, v.numpy(), np.ones(2, np.float32))
    assert got.tolist() == [0x7F, 0xFF]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_unit_scales_equal_quantize_py(codec, fmt: str, pow2: bool) -> None:
    g = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.rand(100_000, generator=g) * 250 - 140)  # 2^-140 .. 2^110: subnormal to huge
    amax = torch.cat([amax, torch.tensor([0.0, 1e-45, 1e-40, 448.0, 57344.0, 3.4e38, float("inf"), float("nan")])])
    got = torch.from_numpy(codec("scale", fmt, "1" if pow2 else "0", amax.numpy(), out_dtype=np.float32))
    want = scales_from_amax(amax, fmt, pow2)
    assert torch.equal(got.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantized_values_equal_quantize_py(codec, fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 128, generator=g) * torch.exp2(-torch.randint(0, 30, (4096, 128), generator=g).float())
    x *= torch.exp2(torch.randint(-20, 20, (4096, 1), generator=g).float())
    q = quantize(x, "blockwise", fmt)
    s = q.scale.expand(-1, 128).contiguous()  # one (1, 128) tile a row
    got = torch.from_numpy(codec("quant", fmt, x.flatten().numpy(), s.flatten().numpy()))
    assert torch.equal(got, q.data.view(torch.uint8).flatten())


# ---- the wrappers on the CPU: the torch references, and their checks ------------------------------


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "tensorwise"])
def test_cpu_wrappers_are_the_references(recipe: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 300, generator=g, dtype=torch.float32).to(torch.bfloat16)
    got = kernels.quantize_rows_fp8(x, recipe, "e4m3")
    want = quantize(x, recipe, "e4m3", reduce_dim=-1)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    src = torch.tensor([3, -1, 0, 19, 3], dtype=torch.int32)
    p = kernels.permute_quantize(x, src, recipe)
    rows = torch.stack([x[3], torch.zeros(300, dtype=x.dtype), x[0], x[19], x[3]])
    ref = quantize(rows, recipe, "e4m3", reduce_dim=-1)
    assert torch.equal(p.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(p.scale, ref.scale)


def test_permute_quantize_of_no_source_rows_gives_zero_rows() -> None:
    q = kernels.permute_quantize(torch.zeros(0, 256), torch.full((3,), -1, dtype=torch.int32), "blockwise")
    assert q.data.shape == (3, 256) and (q.data.view(torch.uint8) == 0).all() and (q.scale == 1).all()


def test_swiglu_quantize_on_cpu_is_swiglu_then_quantize() -> None:
    from lightning_moe.ops.swiglu import weighted_swiglu_forward

    g = torch.Generator().manual_seed(4)
    h = torch.randn(9, 2 * 200, generator=g)
    w = torch.rand(9, generator=g)
    got = kernels.swiglu_quantize(h, w, "blockwise", "e4m3", pow2_scales=True)
    want = quantize(weighted_swiglu_forward(h, w), "blockwise", "e4m3", reduce_dim=-1, pow2_scales=True)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    assert got.tile == (1, 128) and got.reduce_dim == -1


def test_bad_inputs_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        kernels.quantize_rows_fp8(torch.ones(2, 4, dtype=torch.int64), "rowwise")
    with pytest.raises(ValueError, match="2-D"):
        kernels.quantize_rows_fp8(torch.ones(4), "rowwise")
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        kernels.quantize_rows_fp8(torch.ones(2, 4), "columnwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="even 2F"):
        kernels.swiglu_quantize(torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"w_R must be a tensor \[R\]"):
        kernels.swiglu_quantize(torch.ones(2, 4), torch.ones(3))
    with pytest.raises(TypeError, match="integer tensor"):
        kernels.permute_quantize(torch.ones(2, 4), torch.ones(2), "rowwise")


def test_cutlass_gemm_refuses_what_it_cannot_run() -> None:
    x = torch.randn(8, 256)
    w = torch.randn(2, 256, 128)
    a, b = quantize(x, "blockwise"), quantize(w, "blockwise", reduce_dim=-2)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    assert not kernels.cutlass_blockwise_supported(a, b)  # CPU tensors
    with pytest.raises(ValueError, match="blockwise recipe"):
        kernels.cutlass_blockwise_grouped_mm(quantize(x, "rowwise"), b, offs)
    with pytest.raises(ValueError, match="e4m3"):
        kernels.cutlass_blockwise_grouped_mm(quantize(x, "blockwise", "e5m2"), b, offs)
    with pytest.raises(ValueError, match="writes bfloat16"):
        kernels.cutlass_blockwise_grouped_mm(a, b, offs, torch.float32)
    with pytest.raises(ValueError, match="offs_E"):
        kernels.cutlass_blockwise_grouped_mm(a, b, torch.tensor([8], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="unavailable"):
        kernels.cutlass_blockwise_grouped_mm(a, b, offs)
