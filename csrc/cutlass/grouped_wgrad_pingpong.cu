// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): pingpong, 128 x 128 tiles.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_pingpong = sm90::Pingpong<128, 128, 1, 1>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(pingpong, Tiling_pingpong)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
