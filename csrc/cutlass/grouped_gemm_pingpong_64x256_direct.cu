// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: ping-pong, 64 x 256 tiles, direct stores (no shared-memory epilogue).
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_pingpong_64x256_direct = sm90_gemm::Pingpong<64, 256, 1, 1, true>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(pingpong_64x256_direct, GemmTiling_pingpong_64x256_direct)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
