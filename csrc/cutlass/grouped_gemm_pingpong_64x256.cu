// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: ping-pong, 64 x 256 tiles.
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_pingpong_64x256 = sm90_gemm::Pingpong<64, 256, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(pingpong_64x256, GemmTiling_pingpong_64x256)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
