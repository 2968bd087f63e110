// lightning-moe CUTLASS kernels: launcher declarations (host C++, no CUDA or CUTLASS types).
//
// These kernels need the CUTLASS headers (optional: `pip install nvidia-cutlass`, or
// LIGHTNING_MOE_CUTLASS_DIR pointing at a CUTLASS checkout) and an sm_90 GPU (wgmma and TMA,
// compiled for sm_90a). bindings.cpp beside this file is the only file that sees torch.
//
// Legend: R rows grouped by expert, M and N the two sides of one expert's weight, E experts.
#pragma once

#include <cstddef>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace lightning_moe {
namespace cutlass_kernels {

// The GEMM tiling built (output tile M x N; "cooperative": both consumer warp groups share one
// tile; a cluster of two along N shares the x_e^T tile's loads through TMA multicast). H200,
// benchmarks/probes/wgrad_kernels.py: the clustered 256 x 128 tiling was the fastest summed over both
// weights on DeepSeek-V3, Qwen3-30B-A3B and Mixtral of every tiling tried (no clusters, 128 x 256,
// ping-pong 64 x 256 and 128 x 128, clusters along M, 2 x 2 clusters, wider epilogue sub-tiles, all
// of C loaded ahead).
enum class WgradTile : int {
  kCooperative256x128Cluster1x2 = 0,
};
constexpr int kTilings = 1;

// Bytes of device workspace grouped_wgrad needs for `num_experts` groups on a GPU with
// `sm_count` multiprocessors.
size_t grouped_wgrad_workspace_bytes(int64_t num_experts, int sm_count, WgradTile tile);

// For every expert e, in one GEMM launch (plus a tiny kernel that lays out the per-expert
// arguments on the device): accumulate: grad[e] += x[lo_e:hi_e]^T @ dy[lo_e:hi_e] (the old gradient
// read and the sum written by the GEMM's epilogue, beta = 1; experts with no rows untouched);
// else grad[e] = x[lo_e:hi_e]^T @ dy[lo_e:hi_e] (beta = 0: grad is not read; experts with no rows
// zeroed by one more small kernel). lo_e = offsets[e - 1] (0 for e = 0), hi_e = offsets[e]:
// inclusive row-count prefix sums on the device; no host synchronisation.
//
// grad: [E, M, N] bf16, x: [R, M] bf16, dy: [R, N] bf16, all contiguous and 16-byte aligned;
// M and N multiples of 8; offsets non-decreasing and offsets[E - 1] <= R.
// Returns nullptr on success, else a static message naming what failed.
const char* grouped_wgrad(void* grad, const void* x, const void* dy, const int32_t* offsets, int64_t num_experts,
                          int64_t m, int64_t n, bool accumulate, void* workspace, size_t workspace_bytes, int device,
                          int sm_count, WgradTile tile, cudaStream_t stream);

}  // namespace cutlass_kernels
}  // namespace lightning_moe
