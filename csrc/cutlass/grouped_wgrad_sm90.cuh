// One CUTLASS 3 grouped GEMM for the expert weight gradients, accumulated in place (beta = 1) or
// written fresh (beta = 0: the epilogue then loads no C at all, CUTLASS skips it for a zero beta).
//
// Per expert e (one group): D_e = 1 * A_e B_e + beta * C_e with C_e = D_e = grad[e] ([M, N],
// row-major), A_e = x[lo_e:hi_e]^T ([M, K_e]: x's rows are M wide, so A_e is column-major with
// leading dimension M) and B_e = dy[lo_e:hi_e] ([K_e, N], row-major). K_e is the expert's row
// count: it only exists on the device, so the per-group problem sizes, pointers and strides are
// written by prepare_groups (one thread per expert) in the same stream, and the GEMM reads them
// there: the host never learns the row counts. An expert without rows gets M = 0: no tiles, its
// gradient untouched (when written fresh, grouped_wgrad.cu zeroes it).
//
// Included by the grouped_wgrad_<tiling>.cu files (one tiling each, so they compile in parallel).
#pragma once

#include "grouped_wgrad.h"
#include "sm90_grouped.cuh"

namespace lightning_moe {
namespace cutlass_kernels {
namespace sm90 {

using sm90_grouped::Accumulator;
using sm90_grouped::Cooperative;
using sm90_grouped::Element;
using sm90_grouped::GroupArrays;
using sm90_grouped::kAlignment;
using sm90_grouped::Pingpong;
using sm90_grouped::ProblemShape;  // (M, N, K_e)
using LayoutA = cutlass::layout::ColumnMajor;  // x_e^T: M contiguous
using LayoutB = cutlass::layout::RowMajor;     // dy_e: N contiguous
using LayoutC = cutlass::layout::RowMajor;     // grad[e]

// EpiN: the epilogue's sub-tile width (128 x EpiN; 0 = CUTLASS's choice, 128 x 32 here). The epilogue
// prefetches up to four sub-tiles of the old gradient (C) while the tile's MMAs run. On the H200,
// wider sub-tiles, all eight C sub-tiles loaded ahead, 128 x 128 tiles, 2 x 2 clusters and a ping-pong
// 64 x 256 tiling were all slower than this default (figures: docs/kernels.md): the old gradient's
// loads are not what holds the kernel back. Nsight Compute on the default tiling (DeepSeek-V3 w13):
// DRAM 57 % of peak (2.7 TB/s), tensor pipe 38 %, 1 block of 3 warp groups per SM; neither bound is
// reached, the tile's epilogue and its MMAs take turns.
template <class Config>
using WgradGemm = sm90_grouped::GroupedGemm<Config, LayoutA, LayoutB, Element, LayoutC>;

template <class G>
__global__ void prepare_groups(GroupArrays<G> arrays, const int32_t* __restrict__ offsets, int64_t groups,
                               int m, int n, const Element* x, const Element* dy, Element* grad) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  const int64_t lo = e == 0 ? 0 : offsets[e - 1];
  const int k = static_cast<int>(offsets[e] - lo);
  arrays.problems[e] = typename G::Shape{k > 0 ? m : 0, n, k};
  arrays.a[e] = x + lo * m;
  arrays.b[e] = dy + lo * n;
  arrays.d[e] = grad + e * static_cast<int64_t>(m) * n;
  arrays.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k > 0 ? k : 1, 1});
  arrays.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k > 0 ? k : 1, 1});
  arrays.stride_d[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
}

template <class G>
typename G::Gemm::Arguments make_arguments(const GroupArrays<G>& arrays, int64_t groups, int device, int sm_count,
                                           float beta) {
  // The epilogue reads C and writes D at the same place (grad[e]): GroupArrays' D pointer and
  // stride array serve both.
  static_assert(std::is_same_v<typename G::StrideC, typename G::StrideD>, "C and D share their strides");
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = beta;  // 1: the old gradient, read and added in the epilogue; 0: not read
  args = typename G::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(groups), arrays.problems, nullptr},  // no host problem sizes: K_e lives on the device
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
      {fusion, const_cast<const Element**>(arrays.d), arrays.stride_d, arrays.d, arrays.stride_d},
      sm90_grouped::hardware(device, sm_count)};
  return args;
}

template <class Config>
size_t workspace_bytes(int64_t groups, int sm_count) {
  using G = WgradGemm<Config>;
  GroupArrays<G> arrays(nullptr, groups);
  return sm90_grouped::workspace_bytes<G>(arrays, make_arguments<G>(arrays, groups, 0, sm_count, 1.0f));
}

template <class Config>
const char* wgrad(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups, int64_t m,
                  int64_t n, bool accumulate, void* workspace, size_t bytes, int device, int sm_count,
                  cudaStream_t stream) {
  using G = WgradGemm<Config>;
  if (groups == 0) return nullptr;
  GroupArrays<G> arrays(workspace, groups);
  auto args = make_arguments<G>(arrays, groups, device, sm_count, accumulate ? 1.0f : 0.0f);
  return sm90_grouped::launch<G>(arrays, args, workspace, bytes, stream, [&] {
    prepare_groups<G><<<sm90_grouped::prepare_blocks(groups), sm90_grouped::kPrepareThreads, 0, stream>>>(
        arrays, offsets, groups, static_cast<int>(m), static_cast<int>(n), static_cast<const Element*>(x),
        static_cast<const Element*>(dy), static_cast<Element*>(grad));
  });
}

}  // namespace sm90

// One tiling's two entry points, defined by the .cu file that instantiates it (one per tiling, so
// they compile in parallel) and declared by hand in grouped_wgrad.cu (which stays free of CUTLASS).
#define LMOE_DEFINE_WGRAD_TILING(name, Config)                                                                   \
  size_t workspace_bytes_##name(int64_t groups, int sm_count) {                                                 \
    return sm90::workspace_bytes<Config>(groups, sm_count);                                                     \
  }                                                                                                             \
  const char* wgrad_##name(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t groups,      \
                           int64_t m, int64_t n, bool accumulate, void* workspace, size_t bytes, int device,     \
                           int sm_count, cudaStream_t stream) {                                                  \
    return sm90::wgrad<Config>(grad, x, dy, offsets, groups, m, n, accumulate, workspace, bytes, device, sm_count, \
                               stream);                                                                         \
  }

}  // namespace cutlass_kernels
}  // namespace lightning_moe
