// lightning-moe CUTLASS blockwise-scaled FP8 grouped GEMM (DeepSeek-V3's recipe): launcher
// declarations (host C++, no CUDA or CUTLASS types).
//
// Like grouped_gemm.h: needs the CUTLASS headers and an sm_90 GPU (compiled for sm_90a);
// bindings.cpp beside this file is the only file that sees torch.
//
// Legend: R rows grouped by expert, K the rows' width (the GEMM's reduction), N the output width,
// E experts, Kb = ceil(K / 128) and Nb = ceil(N / 128) scale tiles along K and N.
#pragma once

#include <cstddef>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace lightning_moe {
namespace cutlass_kernels {

// The tilings built (output tile M x N x 128 along K: one scale tile of K per main-loop step;
// "cooperative": both consumer warp groups share one tile). One tiling keeps the compile short.
enum class Fp8Tile : int {
  kCooperative128x128 = 0,
};
constexpr int kFp8Tilings = 1;

// Bytes of device workspace fp8_blockwise_grouped needs for `num_experts` groups on a GPU with
// `sm_count` multiprocessors.
size_t fp8_blockwise_grouped_workspace_bytes(int64_t num_experts, int sm_count, Fp8Tile tile);

// out[lo_e:hi_e] = (a[lo_e:hi_e] * a_scale) @ (b[e] * b_scale[e]) for every expert e, in one launch
// (plus a tiny kernel that lays out the per-expert arguments on the device). The product runs on
// the FP8 tensor cores one 128-wide K tile at a time; each tile's fp32 partial sums are multiplied by
// the row's A scale and the column tile's B scale and added to fp32 accumulators (the scales never
// touch the FP8 data); the sum is rounded once to bf16. lo_e = offsets[e - 1] (0 for e = 0),
// hi_e = offsets[e]: inclusive row-count prefix sums on the device; no host synchronisation.
// Experts with no rows launch no tiles; rows from offsets[E - 1] to `rows` (R) are set to zero by
// one more small kernel.
//
// a: [R, K] float8_e4m3fn, row-major (K contiguous); a_scale: [R, Kb] fp32, row-major: the
// dequantization scale of each row's 1 x 128 tiles. b: [E, N, K] float8_e4m3fn, each b[e] K-contiguous
// (the [K, N] weight read K-major); b_scale: [E, Kb, Nb] fp32, row-major: one scale per 128 x 128 tile
// of each [K, N] weight. out: [R, N] bf16 row-major. All 16-byte aligned (scales 4-byte); K and N
// multiples of 16; offsets non-decreasing and offsets[E - 1] <= R. Partial last tiles along K or N
// are read as zeros past the edge (TMA), so they need no padding.
// Returns nullptr on success, else a static message naming what failed.
const char* fp8_blockwise_grouped(void* out, const void* a, const float* a_scale, const void* b, const float* b_scale,
                                  const int32_t* offsets, int64_t num_experts, int64_t rows, int64_t k, int64_t n,
                                  void* workspace,
                                  size_t workspace_bytes, int device, int sm_count, Fp8Tile tile,
                                  cudaStream_t stream);

}  // namespace cutlass_kernels
}  // namespace lightning_moe
