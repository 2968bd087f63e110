// The torch face of the CUTLASS kernels (the only file here that includes torch headers).
//
// Registration: TORCH_LIBRARY(lightning_moe_cutlass_C, ...) with a CUDA implementation;
// lightning_moe/ops/build.py loads the library and returns torch.ops.lightning_moe_cutlass_C.
// Nothing here synchronises with the host.

#include <cstdint>
#include <string>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "grouped_wgrad.h"

namespace lightning_moe {
namespace {

constexpr const char* kOp = "lightning_moe_cutlass_C.grouped_wgrad_accumulate_";

// Numbers go into messages through std::to_string: streaming an int64 into TORCH_CHECK's message
// from an extension crashed (SIGSEGV) on the GPU machine, as csrc/bindings.cpp notes.
std::string num(int64_t value) { return std::to_string(value); }

void check(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, kOp, ": ", name, " is on ", t.device(), "; every tensor must be on ",
              device, ".");
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, ".dtype=", t.scalar_type(), " must be ", dtype, ".");
  TORCH_CHECK(t.is_contiguous(), kOp, ": ", name, " is not contiguous; pass ", name, ".contiguous().");
}

int sm_count(int device) {  // getDeviceProperties caches the properties per device
  return at::cuda::getDeviceProperties(device)->multiProcessorCount;
}

// grad[e] += x[lo_e:hi_e]^T @ dy[lo_e:hi_e], lo/hi from the inclusive prefix sums `offsets`.
void grouped_wgrad_accumulate_op(at::Tensor grad, const at::Tensor& x, const at::Tensor& dy,
                                 const at::Tensor& offsets, int64_t tile) {
  const at::Device device = grad.device();
  check(grad, "grad", device, at::kBFloat16);
  check(x, "x", device, at::kBFloat16);
  check(dy, "dy", device, at::kBFloat16);
  check(offsets, "offsets", device, at::kInt);
  TORCH_CHECK(grad.dim() == 3 && x.dim() == 2 && dy.dim() == 2 && offsets.dim() == 1, kOp,
              ": expected grad [E, M, N], x [R, M], dy [R, N], offsets [E]; got ", num(grad.dim()), "-d, ",
              num(x.dim()), "-d, ", num(dy.dim()), "-d, ", num(offsets.dim()), "-d.");
  const int64_t experts = grad.size(0), m = grad.size(1), n = grad.size(2);
  TORCH_CHECK(x.size(1) == m && dy.size(1) == n && x.size(0) == dy.size(0) && offsets.size(0) == experts, kOp,
              ": shapes disagree: grad [", num(experts), ", ", num(m), ", ", num(n), "], x [", num(x.size(0)), ", ",
              num(x.size(1)), "], dy [", num(dy.size(0)), ", ", num(dy.size(1)), "], offsets [", num(offsets.size(0)),
              "].");
  TORCH_CHECK(m % 8 == 0 && n % 8 == 0, kOp, ": M=", num(m), " and N=", num(n),
              " must be multiples of 8 (16-byte rows for TMA); use the cuBLAS kernels for this shape.");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&grad), &x, &dy}) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, kOp,
                ": a tensor's data is not 16-byte aligned (a view at an odd offset); pass a fresh copy.");
  }
  TORCH_CHECK(tile >= 0 && tile < cutlass_kernels::kTilings, kOp, ": tile=", num(tile), " is not a tiling (0 to ", num(cutlass_kernels::kTilings - 1), "; see WgradTile in grouped_wgrad.h).");
  if (experts == 0 || x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  const int sms = sm_count(index);
  const auto tiling = static_cast<cutlass_kernels::WgradTile>(tile);
  const size_t bytes = cutlass_kernels::grouped_wgrad_workspace_bytes(experts, sms, tiling);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  const char* failed = cutlass_kernels::grouped_wgrad_accumulate(
      grad.data_ptr(), x.data_ptr(), dy.data_ptr(), offsets.data_ptr<int32_t>(), experts, m, n, workspace.data_ptr(),
      bytes, index, sms, tiling, at::cuda::getCurrentCUDAStream(index).stream());
  TORCH_CHECK(failed == nullptr, kOp, ": the CUTLASS kernel failed: ", failed == nullptr ? "" : failed, ".");
}

}  // namespace
}  // namespace lightning_moe

TORCH_LIBRARY(lightning_moe_cutlass_C, m) {
  m.def("grouped_wgrad_accumulate_(Tensor(a!) grad, Tensor x, Tensor dy, Tensor offsets, int tile=0) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_moe_cutlass_C, CUDA, m) {
  m.impl("grouped_wgrad_accumulate_", &lightning_moe::grouped_wgrad_accumulate_op);
}
