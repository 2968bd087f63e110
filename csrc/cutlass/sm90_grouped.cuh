// What the two CUTLASS 3 grouped GEMMs of this folder share (grouped_wgrad_sm90.cuh: the expert
// weight gradients; grouped_gemm_sm90.cuh: the experts' forward and data-gradient products):
// element types, the tile schedules, the per-group argument arrays laid out in the workspace, and
// the launch with its error strings.
//
// Both are ptr-array grouped GEMMs whose per-group problem sizes, pointers and strides exist only
// on the device (written by a small prepare kernel from the experts' row offsets), so the host
// never synchronises to learn the row counts.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace lightning_moe {
namespace cutlass_kernels {
namespace sm90_grouped {

using Element = cutlass::bfloat16_t;
using Accumulator = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) of each group
constexpr int kAlignment = 8;                                                      // 16 bytes of bf16: TMA's unit

// Cooperative: both consumer warp groups share one tile (each takes half its rows) and the epilogue
// follows the tile's MMAs. Ping-pong: each consumer warp group owns a whole tile and one group's
// epilogue overlaps the other's MMAs. Clusters share operand tiles through TMA multicast. EpiN: the
// epilogue's sub-tile width (128 x EpiN; 0 = CUTLASS's choice).
template <int TileM, int TileN, int ClusterM, int ClusterN, int EpiN = 0>
struct Cooperative {
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using EpilogueTile = std::conditional_t<EpiN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                          cute::Shape<cute::_128, cute::Int<EpiN>>>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

template <int TileM, int TileN, int ClusterM, int ClusterN>
struct Pingpong {
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// The kernel of one grouped GEMM: D_g = alpha * A_g B_g (+ beta * C_g) per group, bf16 operands and
// D, fp32 accumulation, C at D's layout (ElementC = void: no source, so the epilogue neither loads
// one nor keeps shared memory for it). Config: one of the schedules above. The mainloop takes the
// shared memory the epilogue leaves.
template <class Config, class LayoutA, class LayoutB, class ElementC, class LayoutD>
struct GroupedGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      typename Config::EpilogueTile, Accumulator, Accumulator, ElementC, LayoutD*, kAlignment,
      Element, LayoutD*, kAlignment, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, Accumulator>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element, LayoutB*,
      kAlignment, Accumulator, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = ProblemShape::UnderlyingProblemShape;
};

// The per-group argument arrays of a GEMM type G (G::Shape, G::StrideA/B/D), carved out of the
// front of the workspace: problem sizes, A/B/D pointers and strides (D's also serve C where the
// epilogue reads a source at the same place).
template <class G>
struct GroupArrays {
  typename G::Shape* problems;
  const Element** a;
  const Element** b;
  Element** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  size_t bytes;  // through the end of the last array, rounded up to 256

  GroupArrays(void* base, int64_t groups) {
    size_t at = 0;
    auto take = [&](size_t each) {
      char* p = static_cast<char*>(base) + at;
      at = (at + each * static_cast<size_t>(groups) + 255) / 256 * 256;
      return static_cast<void*>(p);
    };
    problems = static_cast<typename G::Shape*>(take(sizeof(typename G::Shape)));
    a = static_cast<const Element**>(take(sizeof(void*)));
    b = static_cast<const Element**>(take(sizeof(void*)));
    d = static_cast<Element**>(take(sizeof(void*)));
    stride_a = static_cast<typename G::StrideA*>(take(sizeof(typename G::StrideA)));
    stride_b = static_cast<typename G::StrideB*>(take(sizeof(typename G::StrideB)));
    stride_d = static_cast<typename G::StrideD*>(take(sizeof(typename G::StrideD)));
    bytes = at;
  }
};

inline cutlass::KernelHardwareInfo hardware(int device, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  return hw;
}

// What one grouped GEMM needs in its workspace: the group arrays, then CUTLASS's own.
template <class G>
size_t workspace_bytes(const GroupArrays<G>& arrays, const typename G::Gemm::Arguments& args) {
  return arrays.bytes + G::Gemm::get_workspace_size(args);
}

// The launch shape of a prepare kernel: one thread per group.
constexpr int kPrepareThreads = 128;
inline unsigned prepare_blocks(int64_t groups) {
  return static_cast<unsigned>((groups + kPrepareThreads - 1) / kPrepareThreads);
}

// Checks the workspace, launches `prepare` (which writes the group arrays in `stream`) and then the
// grouped GEMM reading them; nullptr or a static message naming what failed.
template <class G, class Prepare>
const char* launch(const GroupArrays<G>& arrays, const typename G::Gemm::Arguments& args, void* workspace,
                   size_t bytes, cudaStream_t stream, Prepare&& prepare) {
  if (bytes < workspace_bytes<G>(arrays, args)) return "workspace too small";
  prepare();
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);  // the prepare kernel
  typename G::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  status = gemm.initialize(args, static_cast<char*>(workspace) + arrays.bytes, stream);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return nullptr;
}

}  // namespace sm90_grouped
}  // namespace cutlass_kernels
}  // namespace lightning_moe
