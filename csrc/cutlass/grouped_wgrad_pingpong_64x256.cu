// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): ping-pong, 64 x 256 tiles, no clusters.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_pingpong_64x256 = sm90::Pingpong<64, 256, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(pingpong_64x256, Tiling_pingpong_64x256)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
