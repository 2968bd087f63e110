// One CUTLASS 3 grouped GEMM for the experts' forward and data-gradient products.
//
// Per expert e (one group): D_e = A_e B_e with A_e = a[lo_e:hi_e] ([M_e, K], row-major), B_e = w[e]
// ([K, N]) and D_e = out[lo_e:hi_e] ([M_e, N], row-major); alpha = 1, beta = 0 and no C operand
// (ElementC = void: the epilogue neither loads a source nor keeps shared memory for one). w[e] is
// read either N-major (RowMajor B: the layer's forward, w13 [E, H, 2F] and w2 [E, F, H]) or K-major
// (ColumnMajor B: its data gradient, w.transpose(1, 2)); one instantiation per layout.
//
// M_e = hi_e - lo_e is the expert's row count: it only exists on the device, so the per-group
// problem sizes, pointers and strides are written by prepare_groups (one thread per expert) in the
// same stream, and the GEMM reads them there: the host never learns the row counts. An expert
// without rows gets M = 0: no tiles, nothing written.
//
// Included by the grouped_gemm_<tiling>.cu files (one tiling each, so they compile in parallel).
// Its own namespace (sm90_gemm): grouped_wgrad_sm90.cuh's templates have the same names and link
// into the same library.
#pragma once

#include "grouped_gemm.h"
#include "sm90_grouped.cuh"

namespace lightning_moe {
namespace cutlass_kernels {
namespace sm90_gemm {

using sm90_grouped::Accumulator;
using sm90_grouped::Cooperative;
using sm90_grouped::Element;
using sm90_grouped::GroupArrays;
using sm90_grouped::kAlignment;
using sm90_grouped::Pingpong;
using sm90_grouped::ProblemShape;  // (M_e, N, K)
using LayoutA = cutlass::layout::RowMajor;   // a's rows: K contiguous
using LayoutD = cutlass::layout::RowMajor;   // out's rows: N contiguous
using NMajor = cutlass::layout::RowMajor;    // w[e] [K, N] with N contiguous
using KMajor = cutlass::layout::ColumnMajor;  // w[e] [K, N] with K contiguous

// ElementC = void: no source tensor (beta = 0), so no C loads and no C buffers in shared memory,
// which leaves more of it to the mainloop's stages.
template <class Config, class LayoutB>
using ExpertGemm = sm90_grouped::GroupedGemm<Config, LayoutA, LayoutB, void, LayoutD>;

// One thread per expert. Only M varies between groups; N and K are every expert's. A decreasing
// pair of offsets (outside the contract) gives that expert no rows rather than a negative M.
template <class G>
__global__ void prepare_groups(GroupArrays<G> arrays, const int32_t* __restrict__ offsets, int64_t groups, int k,
                               int n, const Element* a, const Element* w, Element* out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  const int64_t lo = e == 0 ? 0 : offsets[e - 1];
  const int64_t rows = offsets[e] - lo;
  const int m = rows > 0 ? static_cast<int>(rows) : 0;
  const int m_stride = m > 0 ? m : 1;  // M only enters the (unused) batch strides; keep them non-zero
  arrays.problems[e] = typename G::Shape{m, n, k};
  arrays.a[e] = a + lo * k;
  arrays.b[e] = w + e * static_cast<int64_t>(k) * n;
  arrays.d[e] = out + lo * n;
  arrays.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m_stride, k, 1});
  arrays.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
  arrays.stride_d[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m_stride, n, 1});
}

template <class G>
typename G::Gemm::Arguments make_arguments(const GroupArrays<G>& arrays, int64_t groups, int device, int sm_count) {
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;  // no source: a void-C epilogue only accepts beta = 0
  args = typename G::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(groups), arrays.problems, nullptr},  // no host problem sizes: M_e lives on the device
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
      {fusion, nullptr, nullptr, arrays.d, arrays.stride_d},  // C: none
      sm90_grouped::hardware(device, sm_count)};
  return args;
}

template <class Config, class LayoutB>
size_t workspace_bytes(int64_t groups, int sm_count) {
  using G = ExpertGemm<Config, LayoutB>;
  GroupArrays<G> arrays(nullptr, groups);
  return sm90_grouped::workspace_bytes<G>(arrays, make_arguments<G>(arrays, groups, 0, sm_count));
}

template <class Config, class LayoutB>
const char* run(void* out, const void* a, const void* w, const int32_t* offsets, int64_t groups, int64_t k, int64_t n,
                void* workspace, size_t bytes, int device, int sm_count, cudaStream_t stream) {
  using G = ExpertGemm<Config, LayoutB>;
  if (groups == 0) return nullptr;
  GroupArrays<G> arrays(workspace, groups);
  auto args = make_arguments<G>(arrays, groups, device, sm_count);
  return sm90_grouped::launch<G>(arrays, args, workspace, bytes, stream, [&] {
    prepare_groups<G><<<sm90_grouped::prepare_blocks(groups), sm90_grouped::kPrepareThreads, 0, stream>>>(
        arrays, offsets, groups, static_cast<int>(k), static_cast<int>(n), static_cast<const Element*>(a),
        static_cast<const Element*>(w), static_cast<Element*>(out));
  });
}

}  // namespace sm90_gemm

// One tiling's two entry points, both B layouts behind a flag, defined by the .cu file that
// instantiates it (one per tiling, so they compile in parallel) and declared by hand in
// grouped_gemm.cu (which stays free of CUTLASS).
#define LMOE_DEFINE_GEMM_TILING(name, Config)                                                                    \
  size_t gemm_workspace_bytes_##name(int64_t groups, int sm_count, bool w_k_major) {                            \
    return w_k_major ? sm90_gemm::workspace_bytes<Config, sm90_gemm::KMajor>(groups, sm_count)                  \
                     : sm90_gemm::workspace_bytes<Config, sm90_gemm::NMajor>(groups, sm_count);                 \
  }                                                                                                             \
  const char* gemm_##name(void* out, const void* a, const void* w, const int32_t* offsets, int64_t groups,      \
                          int64_t k, int64_t n, bool w_k_major, void* workspace, size_t bytes, int device,      \
                          int sm_count, cudaStream_t stream) {                                                  \
    return w_k_major ? sm90_gemm::run<Config, sm90_gemm::KMajor>(out, a, w, offsets, groups, k, n, workspace,   \
                                                                 bytes, device, sm_count, stream)               \
                     : sm90_gemm::run<Config, sm90_gemm::NMajor>(out, a, w, offsets, groups, k, n, workspace,   \
                                                                 bytes, device, sm_count, stream);              \
  }

}  // namespace cutlass_kernels
}  // namespace lightning_moe
