// One tiling of the grouped weight-gradient GEMM (grouped_wgrad_sm90.cuh): cooperative, 128 x 128 tiles (all four C sub-tiles in flight), clusters of two along N.
#include "grouped_wgrad_sm90.cuh"

namespace lightning_moe {
namespace cutlass_kernels {

using Tiling_cooperative_128x128_c1x2 = sm90::Cooperative<128, 128, 1, 2>;  // (commas cannot go through the macro)
LMOE_DEFINE_WGRAD_TILING(cooperative_128x128_c1x2, Tiling_cooperative_128x128_c1x2)

}  // namespace cutlass_kernels
}  // namespace lightning_moe
