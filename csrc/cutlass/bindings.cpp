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

#include "fp8_blockwise_grouped.h"
#include "grouped_gemm.h"
#include "grouped_wgrad.h"

namespace lightning_moe {
namespace {

constexpr const char* kOp = "lightning_moe_cutlass_C.grouped_wgrad_accumulate_";
constexpr const char* kFreshOp = "lightning_moe_cutlass_C.grouped_wgrad";
constexpr const char* kGemmOp = "lightning_moe_cutlass_C.grouped_mm";
constexpr const char* kFp8Op = "lightning_moe_cutlass_C.fp8_blockwise_grouped_mm";

// Numbers go into messages through std::to_string: streaming an int64 into TORCH_CHECK's message
// from an extension crashed (SIGSEGV) on the GPU machine, as csrc/bindings.cpp notes.
std::string num(int64_t value) { return std::to_string(value); }

// Device and dtype only: grouped_mm reads w in either of two layouts (w_is_k_major).
void check_placed(const at::Tensor& t, const char* op, const char* name, const at::Device& device,
                  at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, op, ": ", name, " is on ", t.device(), "; every tensor must be on ",
              device, ".");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, ".dtype=", t.scalar_type(), " must be ", dtype, ".");
}

void check(const at::Tensor& t, const char* op, const char* name, const at::Device& device, at::ScalarType dtype) {
  check_placed(t, op, name, device, dtype);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " is not contiguous; pass ", name, ".contiguous().");
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int sm_count(int device) {  // getDeviceProperties caches the properties per device
  return at::cuda::getDeviceProperties(device)->multiProcessorCount;
}

// grad[e] (+)= x[lo_e:hi_e]^T @ dy[lo_e:hi_e], lo/hi from the inclusive prefix sums `offsets`.
void run_wgrad(at::Tensor& grad, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offsets, int64_t tile,
               bool accumulate, const char* op) {
  const at::Device device = grad.device();
  check(grad, op, "grad", device, at::kBFloat16);
  check(x, op, "x", device, at::kBFloat16);
  check(dy, op, "dy", device, at::kBFloat16);
  check(offsets, op, "offsets", device, at::kInt);
  TORCH_CHECK(grad.dim() == 3 && x.dim() == 2 && dy.dim() == 2 && offsets.dim() == 1, op,
              ": expected grad [E, M, N], x [R, M], dy [R, N], offsets [E]; got ", num(grad.dim()), "-d, ",
              num(x.dim()), "-d, ", num(dy.dim()), "-d, ", num(offsets.dim()), "-d.");
  const int64_t experts = grad.size(0), m = grad.size(1), n = grad.size(2);
  TORCH_CHECK(x.size(1) == m && dy.size(1) == n && x.size(0) == dy.size(0) && offsets.size(0) == experts, op,
              ": shapes disagree: grad [", num(experts), ", ", num(m), ", ", num(n), "], x [", num(x.size(0)), ", ",
              num(x.size(1)), "], dy [", num(dy.size(0)), ", ", num(dy.size(1)), "], offsets [", num(offsets.size(0)),
              "].");
  TORCH_CHECK(m % 8 == 0 && n % 8 == 0, op, ": M=", num(m), " and N=", num(n),
              " must be multiples of 8 (16-byte rows for TMA); use the cuBLAS kernels for this shape.");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&grad), &x, &dy}) {
    TORCH_CHECK(aligned16(*t), op,
                ": a tensor's data is not 16-byte aligned (a view at an odd offset); pass a fresh copy.");
  }
  TORCH_CHECK(tile >= 0 && tile < cutlass_kernels::kTilings, op, ": tile=", num(tile), " is not a tiling (0 to ", num(cutlass_kernels::kTilings - 1), "; see WgradTile in grouped_wgrad.h).");
  if (experts == 0) return;
  if (x.size(0) == 0) {  // no rows at all: nothing to add, or an all-zero gradient
    if (!accumulate) grad.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  const int sms = sm_count(index);
  const auto tiling = static_cast<cutlass_kernels::WgradTile>(tile);
  const size_t bytes = cutlass_kernels::grouped_wgrad_workspace_bytes(experts, sms, tiling);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  const char* failed = cutlass_kernels::grouped_wgrad(
      grad.data_ptr(), x.data_ptr(), dy.data_ptr(), offsets.data_ptr<int32_t>(), experts, m, n, accumulate,
      workspace.data_ptr(), bytes, index, sms, tiling, at::cuda::getCurrentCUDAStream(index).stream());
  TORCH_CHECK(failed == nullptr, op, ": the CUTLASS kernel failed: ", failed == nullptr ? "" : failed, ".");
}

void grouped_wgrad_accumulate_op(at::Tensor grad, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offsets,
                                 int64_t tile) {
  run_wgrad(grad, x, dy, offsets, tile, /*accumulate=*/true, kOp);
}

// A fresh [E, M, N] gradient: out[e] = x[lo_e:hi_e]^T @ dy[lo_e:hi_e] (zeros for experts without rows).
at::Tensor grouped_wgrad_op(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offsets, int64_t tile) {
  TORCH_CHECK(x.dim() == 2 && dy.dim() == 2 && offsets.dim() == 1, kFreshOp,
              ": expected x [R, M], dy [R, N], offsets [E]; got ", num(x.dim()), "-d, ", num(dy.dim()), "-d, ",
              num(offsets.dim()), "-d.");
  at::Tensor out = at::empty({offsets.size(0), x.size(1), dy.size(1)}, x.options());
  run_wgrad(out, x, dy, offsets, tile, /*accumulate=*/false, kFreshOp);
  return out;
}

// Whether w [E, K, N] is read N-major (each w[e] N-contiguous: how the forward reads w13 and w2) or
// K-major (each w[e] K-contiguous: w.transpose(1, 2) of a contiguous [E, N, K], how the data
// gradient reads them); anything else is refused. One expert's stride does not matter.
bool w_is_k_major(const at::Tensor& w) {
  const int64_t experts = w.size(0), k = w.size(1), n = w.size(2);
  const bool packed = experts <= 1 || w.stride(0) == k * n;
  const bool n_major = packed && w.stride(2) == 1 && w.stride(1) == n;
  const bool k_major = packed && w.stride(1) == 1 && w.stride(2) == k;
  TORCH_CHECK(n_major || k_major, kGemmOp, ": w has strides (", num(w.stride(0)), ", ", num(w.stride(1)), ", ",
              num(w.stride(2)), ") for shape [", num(experts), ", ", num(k), ", ", num(n),
              "]; it must be N-major (strides (K*N, N, 1)) or K-major (strides (K*N, 1, K)); pass w.contiguous() "
              "or w.transpose(1, 2).contiguous().transpose(1, 2).");
  return k_major;
}

// out[lo_e:hi_e] = a[lo_e:hi_e] @ w[e], lo/hi from the inclusive prefix sums `offsets`; the rows
// from offsets[E - 1] on are left as at::empty made them (as F.grouped_mm does).
at::Tensor grouped_mm_op(const at::Tensor& a, const at::Tensor& w, const at::Tensor& offsets, int64_t tile) {
  const at::Device device = a.device();
  check_placed(a, kGemmOp, "a", device, at::kBFloat16);
  check_placed(w, kGemmOp, "w", device, at::kBFloat16);
  check(offsets, kGemmOp, "offsets", device, at::kInt);
  TORCH_CHECK(a.dim() == 2 && w.dim() == 3 && offsets.dim() == 1, kGemmOp,
              ": expected a [R, K], w [E, K, N], offsets [E]; got ", num(a.dim()), "-d, ", num(w.dim()), "-d, ",
              num(offsets.dim()), "-d.");
  TORCH_CHECK(a.is_contiguous(), kGemmOp, ": a is not contiguous; pass a.contiguous().");
  const int64_t rows = a.size(0), experts = w.size(0), k = w.size(1), n = w.size(2);
  TORCH_CHECK(a.size(1) == k && offsets.size(0) == experts, kGemmOp, ": shapes disagree: a [", num(rows), ", ",
              num(a.size(1)), "], w [", num(experts), ", ", num(k), ", ", num(n), "], offsets [",
              num(offsets.size(0)), "].");
  TORCH_CHECK(k > 0 && n > 0 && k % 8 == 0 && n % 8 == 0, kGemmOp, ": K=", num(k), " and N=", num(n),
              " must be positive multiples of 8 (16-byte rows for TMA); use F.grouped_mm for this shape.");
  TORCH_CHECK(k <= INT32_MAX && n <= INT32_MAX && rows <= INT32_MAX, kGemmOp, ": R=", num(rows), ", K=", num(k),
              " and N=", num(n), " must each fit in int32 (the kernel's problem sizes).");
  const bool k_major = w_is_k_major(w);
  TORCH_CHECK(aligned16(a) && aligned16(w), kGemmOp,
              ": a's or w's data is not 16-byte aligned (a view at an odd offset); pass a fresh copy.");
  TORCH_CHECK(tile >= 0 && tile < cutlass_kernels::kGemmTilings, kGemmOp, ": tile=", num(tile),
              " is not a tiling (0 to ", num(cutlass_kernels::kGemmTilings - 1), "; see GemmTile in grouped_gemm.h).");
  at::Tensor out = at::empty({rows, n}, a.options());
  if (experts == 0 || rows == 0) return out;
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  const int sms = sm_count(index);
  const auto tiling = static_cast<cutlass_kernels::GemmTile>(tile);
  const size_t bytes = cutlass_kernels::grouped_gemm_workspace_bytes(experts, sms, k_major, tiling);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, a.options().dtype(at::kByte));
  const char* failed = cutlass_kernels::grouped_gemm(
      out.data_ptr(), a.data_ptr(), w.data_ptr(), offsets.data_ptr<int32_t>(), experts, k, n, k_major,
      workspace.data_ptr(), bytes, index, sms, tiling, at::cuda::getCurrentCUDAStream(index).stream());
  TORCH_CHECK(failed == nullptr, kGemmOp, ": the CUTLASS kernel failed: ", failed == nullptr ? "" : failed, ".");
  return out;
}

// out[lo_e:hi_e] = (a_data * a_scale)[lo_e:hi_e] @ (b_data[e] * b_scale[e]) with 1 x 128 scales on a
// and 128 x 128 scales on b (fp8_blockwise_grouped.h); rows from offsets[E - 1] on are set to zero.
// b_data is the [E, K, N] weight read K-major: strides (K*N, 1, K), i.e. w.transpose(1, 2) of a
// contiguous [E, N, K].
void fp8_blockwise_grouped_mm_op(const at::Tensor& a_data, const at::Tensor& a_scale, const at::Tensor& b_data,
                                 const at::Tensor& b_scale, const at::Tensor& offsets, at::Tensor out, int64_t tile) {
  const at::Device device = a_data.device();
  check(a_data, kFp8Op, "a_data", device, at::kFloat8_e4m3fn);
  check(a_scale, kFp8Op, "a_scale", device, at::kFloat);
  check_placed(b_data, kFp8Op, "b_data", device, at::kFloat8_e4m3fn);
  check(b_scale, kFp8Op, "b_scale", device, at::kFloat);
  check(offsets, kFp8Op, "offsets", device, at::kInt);
  check(out, kFp8Op, "out", device, at::kBFloat16);
  TORCH_CHECK(a_data.dim() == 2 && a_scale.dim() == 2 && b_data.dim() == 3 && b_scale.dim() == 3 &&
                  offsets.dim() == 1 && out.dim() == 2,
              kFp8Op, ": expected a_data [R, K], a_scale [R, Kb], b_data [E, K, N], b_scale [E, Kb, Nb], offsets [E], ",
              "out [R, N]; got ", num(a_data.dim()), "-d, ", num(a_scale.dim()), "-d, ", num(b_data.dim()), "-d, ",
              num(b_scale.dim()), "-d, ", num(offsets.dim()), "-d, ", num(out.dim()), "-d.");
  const int64_t rows = a_data.size(0), experts = b_data.size(0), k = b_data.size(1), n = b_data.size(2);
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  TORCH_CHECK(a_data.size(1) == k && offsets.size(0) == experts && out.size(0) == rows && out.size(1) == n, kFp8Op,
              ": shapes disagree: a_data [", num(rows), ", ", num(a_data.size(1)), "], b_data [", num(experts), ", ",
              num(k), ", ", num(n), "], offsets [", num(offsets.size(0)), "], out [", num(out.size(0)), ", ",
              num(out.size(1)), "].");
  TORCH_CHECK(a_scale.size(0) == rows && a_scale.size(1) == kb, kFp8Op, ": a_scale has shape [", num(a_scale.size(0)),
              ", ", num(a_scale.size(1)), "]; expected one scale per 1 x 128 tile of a: [", num(rows), ", ", num(kb), "].");
  TORCH_CHECK(b_scale.size(0) == experts && b_scale.size(1) == kb && b_scale.size(2) == nb, kFp8Op,
              ": b_scale has shape [", num(b_scale.size(0)), ", ", num(b_scale.size(1)), ", ", num(b_scale.size(2)),
              "]; expected one scale per 128 x 128 tile of each [K, N] weight: [", num(experts), ", ", num(kb), ", ",
              num(nb), "].");
  TORCH_CHECK(k > 0 && n > 0 && k % 16 == 0 && n % 16 == 0, kFp8Op, ": K=", num(k), " and N=", num(n),
              " must be positive multiples of 16 (16-byte rows of FP8 for TMA); pad them with zeros.");
  TORCH_CHECK(k <= INT32_MAX && n <= INT32_MAX && rows <= INT32_MAX, kFp8Op, ": R=", num(rows), ", K=", num(k),
              " and N=", num(n), " must each fit in int32 (the kernel's problem sizes).");
  const bool packed = experts <= 1 || b_data.stride(0) == k * n;
  TORCH_CHECK(packed && b_data.stride(1) == 1 && b_data.stride(2) == k, kFp8Op, ": b_data has strides (",
              num(b_data.stride(0)), ", ", num(b_data.stride(1)), ", ", num(b_data.stride(2)), ") for shape [",
              num(experts), ", ", num(k), ", ", num(n), "]; the FP8 tensor cores read it K-major only: strides (K*N, 1, K), ",
              "i.e. pass b_data.transpose(1, 2).contiguous().transpose(1, 2).");
  TORCH_CHECK(aligned16(a_data) && aligned16(b_data) && aligned16(out), kFp8Op,
              ": a_data's, b_data's or out's data is not 16-byte aligned (a view at an odd offset); pass a fresh copy.");
  TORCH_CHECK(tile >= 0 && tile < cutlass_kernels::kFp8Tilings, kFp8Op, ": tile=", num(tile), " is not a tiling (0 to ",
              num(cutlass_kernels::kFp8Tilings - 1), "; see Fp8Tile in fp8_blockwise_grouped.h).");
  if (rows == 0) return;
  if (experts == 0) {
    out.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(device);
  const int index = device.index();
  const int sms = sm_count(index);
  const auto tiling = static_cast<cutlass_kernels::Fp8Tile>(tile);
  const size_t bytes = cutlass_kernels::fp8_blockwise_grouped_workspace_bytes(experts, sms, tiling);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, a_data.options().dtype(at::kByte));
  const char* failed = cutlass_kernels::fp8_blockwise_grouped(
      out.data_ptr(), a_data.data_ptr(), a_scale.data_ptr<float>(), b_data.data_ptr(), b_scale.data_ptr<float>(),
      offsets.data_ptr<int32_t>(), experts, rows, k, n, workspace.data_ptr(), bytes, index, sms, tiling,
      at::cuda::getCurrentCUDAStream(index).stream());
  TORCH_CHECK(failed == nullptr, kFp8Op, ": the CUTLASS kernel failed: ", failed == nullptr ? "" : failed, ".");
}

}  // namespace
}  // namespace lightning_moe

TORCH_LIBRARY(lightning_moe_cutlass_C, m) {
  m.def("grouped_wgrad_accumulate_(Tensor(a!) grad, Tensor x, Tensor dy, Tensor offsets, int tile=0) -> ()");
  m.def("grouped_wgrad(Tensor x, Tensor dy, Tensor offsets, int tile=0) -> Tensor");
  m.def("grouped_mm(Tensor a, Tensor w, Tensor offsets, int tile=0) -> Tensor");
  m.def(
      "fp8_blockwise_grouped_mm(Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, Tensor offsets, "
      "Tensor(a!) out, int tile=0) -> ()");
}

TORCH_LIBRARY_IMPL(lightning_moe_cutlass_C, CUDA, m) {
  m.impl("grouped_wgrad_accumulate_", &lightning_moe::grouped_wgrad_accumulate_op);
  m.impl("grouped_wgrad", &lightning_moe::grouped_wgrad_op);
  m.impl("grouped_mm", &lightning_moe::grouped_mm_op);
  m.impl("fp8_blockwise_grouped_mm", &lightning_moe::fp8_blockwise_grouped_mm_op);
}
