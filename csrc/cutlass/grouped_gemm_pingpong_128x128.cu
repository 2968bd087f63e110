// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: ping-pong, 128 x 128 tiles.
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_pingpong_128x128 = sm90_gemm::Pingpong<128, 128, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(pingpong_128x128, GemmTiling_pingpong_128x128)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
