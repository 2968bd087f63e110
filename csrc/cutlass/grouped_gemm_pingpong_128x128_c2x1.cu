// One tiling of the grouped expert GEMM (grouped_gemm_sm90.cuh), both w layouts: ping-pong, 128 x 128 tiles, clusters of two along M (the w tile multicast).
#include "grouped_gemm_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using GemmTiling_pingpong_128x128_c2x1 = sm90_gemm::Pingpong<128, 128, 2, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_GEMM_TILING(pingpong_128x128_c2x1, GemmTiling_pingpong_128x128_c2x1)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
