// lightning-moe CUTLASS grouped GEMM for the experts' forward and data-gradient products: launcher
// declarations (host C++, no CUDA or CUTLASS types).
//
// Like grouped_wgrad.h: needs the CUTLASS headers and an sm_90 GPU (compiled for sm_90a);
// bindings.cpp beside this file is the only file that sees torch.
//
// Legend: R rows grouped by expert, K the rows' width (the GEMM's reduction), N the output width,
// E experts.
#pragma once

#include <cstddef>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace lightning_moe {
namespace cutlass_kernels {

// The tilings built (output tile M x N; "cooperative": both consumer warp groups share one tile;
// "pingpong": each owns a tile and one's epilogue overlaps the other's MMAs; "c2x1": clusters of two
// along M sharing the w tile through TMA multicast). kPingpong64x256 is what the layer runs for wide
// experts with few rows each; kCooperative128x256Cluster2x1 is the tiling torch's grouped_mm uses on
// sm_90 (the default when the CUTLASS kernel is asked for everywhere).
enum class GemmTile : int {
  kCooperative128x256Cluster2x1 = 0,
  kPingpong64x256 = 1,
};
constexpr int kGemmTilings = 2;

// Bytes of device workspace grouped_gemm needs for `num_experts` groups on a GPU with `sm_count`
// multiprocessors.
size_t grouped_gemm_workspace_bytes(int64_t num_experts, int sm_count, bool w_k_major, GemmTile tile);

// out[lo_e:hi_e] = a[lo_e:hi_e] @ w[e] for every expert e, in one launch (plus a tiny kernel that
// lays out the per-expert arguments on the device); fp32 accumulation, no source (beta = 0).
// lo_e = offsets[e - 1] (0 for e = 0), hi_e = offsets[e]: inclusive row-count prefix sums on the
// device; no host synchronisation. Experts with no rows launch no tiles; rows from offsets[E - 1]
// on are not written.
//
// a: [R, K] bf16 row-major; w: [E, K, N] bf16, each w[e] N-contiguous (w_k_major = false) or
// K-contiguous (w_k_major = true), w[e] starting K * N elements after w[e - 1]; out: [R, N] bf16
// row-major. All 16-byte aligned; K and N multiples of 8; offsets non-decreasing and
// offsets[E - 1] <= R. Returns nullptr on success, else a static message naming what failed.
const char* grouped_gemm(void* out, const void* a, const void* w, const int32_t* offsets, int64_t num_experts,
                         int64_t k, int64_t n, bool w_k_major, void* workspace, size_t workspace_bytes, int device,
                         int sm_count, GemmTile tile, cudaStream_t stream);

}  // namespace cutlass_kernels
}  // namespace lightning_moe
