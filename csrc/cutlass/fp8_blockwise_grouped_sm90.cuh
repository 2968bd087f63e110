// One CUTLASS 3 grouped GEMM with blockwise-scaled FP8 operands (DeepSeek-V3's recipe).
//
// Per expert e (one group): D_e = (A_e * SFA_e) (B_e * SFB_e) with A_e = a[lo_e:hi_e] ([M_e, K]
// e4m3, row-major), SFA_e its 1 x 128 dequantization scales ([M_e, Kb] fp32, K-major: each row's
// tiles side by side), B_e = b[e] ([K, N] e4m3 read K-major: stored as [N, K]) with SFB_e = b_scale[e]
// ([Kb, Nb] fp32, N-major), and D_e = out[lo_e:hi_e] ([M_e, N] bf16). alpha = 1, beta = 0, no C.
//
// The main loop is CUTLASS's sm90 ptr-array FP8 blockwise-scaling collective: TMA loads of 128-wide
// K tiles, wgmma into fp32 partial sums, and after each K tile (the scale granularity along K) the
// partial sums times SFA (per row) times SFB (per 128-column tile) are added to the fp32
// accumulators. The scales are read with predicated copies, so partial M tiles (any M_e), partial K
// tiles (TMA fills past the edge with zeros) and partial N tiles need no padding.
//
// As in grouped_gemm_sm90.cuh, M_e exists only on the device: prepare_groups (one thread per
// expert) writes every group's problem size, pointers, strides and scale layouts in the stream,
// and the GEMM reads them there. An expert without rows gets M = 0: no tiles, nothing written.
#pragma once

#include "fp8_blockwise_grouped.h"
#include "sm90_grouped.cuh"

#include "cutlass/detail/blockwise_scale_layout.hpp"

namespace lightning_moe {
namespace cutlass_kernels {
namespace sm90_fp8 {

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using Accumulator = float;
using sm90_grouped::ProblemShape;             // (M_e, N, K)
using LayoutA = cutlass::layout::RowMajor;     // a's rows: K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // b[e] [K, N] with K contiguous (FP8 wgmma reads K-major only)
using LayoutD = cutlass::layout::RowMajor;     // out's rows: N contiguous
constexpr int kAlignmentAB = 16;               // 16 bytes of e4m3: TMA's unit
constexpr int kAlignmentD = 8;                 // 16 bytes of bf16
constexpr int kScaleK = 128;                   // scale tile along K (both operands)
constexpr int kScaleN = 128;                   // B's scale tile along N (A's is one row)

// A's scales K-major ([M, Kb], the quantizer's layout), B's N-major ([Kb, Nb] per expert).
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, kScaleK, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// Cooperative: both consumer warp groups share one tile. The K extent of the tile is the scale
// tile, so each main-loop step applies one scale pair.
template <int TileM, int TileN, int ClusterM, int ClusterN>
struct Cooperative {
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<kScaleK>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

template <class Config>
struct Fp8GroupedGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator, void, LayoutD*, kAlignmentD,
      ElementD, LayoutD*, kAlignmentD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, Accumulator>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>,
      kAlignmentAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentAB, Accumulator, typename Config::Tile,
      typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = ProblemShape::UnderlyingProblemShape;
};

// The per-group argument arrays of a GEMM type G, carved out of the front of the workspace.
template <class G>
struct Fp8GroupArrays {
  typename G::Shape* problems;
  const ElementAB** a;
  const ElementAB** b;
  const float** sfa;
  const float** sfb;
  ElementD** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  size_t bytes;  // through the end of the last array, rounded up to 256

  Fp8GroupArrays(void* base, int64_t groups) {
    size_t at = 0;
    auto take = [&](size_t each) {
      char* p = static_cast<char*>(base) + at;
      at = (at + each * static_cast<size_t>(groups) + 255) / 256 * 256;
      return static_cast<void*>(p);
    };
    problems = static_cast<typename G::Shape*>(take(sizeof(typename G::Shape)));
    a = static_cast<const ElementAB**>(take(sizeof(void*)));
    b = static_cast<const ElementAB**>(take(sizeof(void*)));
    sfa = static_cast<const float**>(take(sizeof(void*)));
    sfb = static_cast<const float**>(take(sizeof(void*)));
    d = static_cast<ElementD**>(take(sizeof(void*)));
    stride_a = static_cast<typename G::StrideA*>(take(sizeof(typename G::StrideA)));
    stride_b = static_cast<typename G::StrideB*>(take(sizeof(typename G::StrideB)));
    stride_d = static_cast<typename G::StrideD*>(take(sizeof(typename G::StrideD)));
    layout_sfa = static_cast<LayoutSFA*>(take(sizeof(LayoutSFA)));
    layout_sfb = static_cast<LayoutSFB*>(take(sizeof(LayoutSFB)));
    bytes = at;
  }
};

// One thread per expert. Only M varies between groups; N and K are every expert's. A decreasing
// pair of offsets (outside the contract) gives that expert no rows rather than a negative M.
template <class G>
__global__ void prepare_groups(Fp8GroupArrays<G> arrays, const int32_t* __restrict__ offsets, int64_t groups, int k,
                               int n, const ElementAB* a, const float* a_scale, const ElementAB* b,
                               const float* b_scale, ElementD* out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= groups) return;
  const int64_t lo = e == 0 ? 0 : offsets[e - 1];
  const int64_t rows = offsets[e] - lo;
  const int m = rows > 0 ? static_cast<int>(rows) : 0;
  const int m_stride = m > 0 ? m : 1;  // M only enters the (unused) batch strides; keep them non-zero
  const int64_t kb = (k + kScaleK - 1) / kScaleK, nb = (n + kScaleN - 1) / kScaleN;
  arrays.problems[e] = typename G::Shape{m, n, k};
  arrays.a[e] = a + lo * k;
  arrays.b[e] = b + e * static_cast<int64_t>(k) * n;
  arrays.sfa[e] = a_scale + lo * kb;
  arrays.sfb[e] = b_scale + e * kb * nb;
  arrays.d[e] = out + lo * n;
  arrays.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m_stride, k, 1});
  arrays.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
  arrays.stride_d[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m_stride, n, 1});
  arrays.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  arrays.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

// out[r, :] = 0 for the rows no expert owns (offsets[E - 1] <= r < R), 16 bytes a thread per step.
// N % 8 == 0, so a row is whole 16-byte pieces.
constexpr int kZeroThreads = 256;
inline unsigned zero_tail_blocks(int64_t rows, int64_t n) {
  const int64_t pieces = rows * (n / 8);
  const int64_t blocks = (pieces + kZeroThreads - 1) / kZeroThreads;
  return static_cast<unsigned>(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
}
template <class T>  // (a template: the definition may sit in several tilings' objects)
__global__ void zero_tail_rows(T* out, const int32_t* __restrict__ offsets, int64_t groups, int64_t rows, int64_t n) {
  const int64_t start = offsets[groups - 1] > 0 ? offsets[groups - 1] : 0;
  if (start >= rows) return;
  const int64_t per_row = n / 8;
  uint4* base = reinterpret_cast<uint4*>(out + start * n);
  const int64_t pieces = (rows - start) * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    base[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <class G>
typename G::Gemm::Arguments make_arguments(const Fp8GroupArrays<G>& arrays, int64_t groups, int device,
                                           int sm_count) {
  typename G::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;  // no source: a void-C epilogue only accepts beta = 0
  args = typename G::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(groups), arrays.problems, nullptr},  // no host problem sizes: M_e lives on the device
      {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa, arrays.sfb,
       arrays.layout_sfb},
      {fusion, nullptr, nullptr, arrays.d, arrays.stride_d},  // C: none
      sm90_grouped::hardware(device, sm_count)};
  return args;
}

template <class Config>
size_t workspace_bytes(int64_t groups, int sm_count) {
  using G = Fp8GroupedGemm<Config>;
  Fp8GroupArrays<G> arrays(nullptr, groups);
  return arrays.bytes + G::Gemm::get_workspace_size(make_arguments<G>(arrays, groups, 0, sm_count));
}

template <class Config>
const char* run(void* out, const void* a, const float* a_scale, const void* b, const float* b_scale,
                const int32_t* offsets, int64_t groups, int64_t rows, int64_t k, int64_t n, void* workspace,
                size_t bytes, int device, int sm_count, cudaStream_t stream) {
  using G = Fp8GroupedGemm<Config>;
  if (groups == 0) return nullptr;
  Fp8GroupArrays<G> arrays(workspace, groups);
  auto args = make_arguments<G>(arrays, groups, device, sm_count);
  if (bytes < arrays.bytes + G::Gemm::get_workspace_size(args)) return "workspace too small";
  prepare_groups<G><<<sm90_grouped::prepare_blocks(groups), sm90_grouped::kPrepareThreads, 0, stream>>>(
      arrays, offsets, groups, static_cast<int>(k), static_cast<int>(n), static_cast<const ElementAB*>(a), a_scale,
      static_cast<const ElementAB*>(b), b_scale, static_cast<ElementD*>(out));
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  typename G::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  status = gemm.initialize(args, static_cast<char*>(workspace) + arrays.bytes, stream);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  zero_tail_rows<ElementD><<<zero_tail_blocks(rows, n), kZeroThreads, 0, stream>>>(static_cast<ElementD*>(out), offsets, groups,
                                                                         rows, n);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cudaGetErrorString(err);
  return nullptr;
}

}  // namespace sm90_fp8

// One tiling's two entry points, defined by the .cu file that instantiates it and declared by hand
// in fp8_blockwise_grouped.cu (which stays free of CUTLASS).
#define LMOE_DEFINE_FP8_TILING(name, Config)                                                                    \
  size_t fp8_workspace_bytes_##name(int64_t groups, int sm_count) {                                             \
    return sm90_fp8::workspace_bytes<Config>(groups, sm_count);                                                 \
  }                                                                                                             \
  const char* fp8_##name(void* out, const void* a, const float* a_scale, const void* b, const float* b_scale,  \
                         const int32_t* offsets, int64_t groups, int64_t rows, int64_t k, int64_t n,            \
                         void* workspace, size_t bytes, int device, int sm_count, cudaStream_t stream) {        \
    return sm90_fp8::run<Config>(out, a, a_scale, b, b_scale, offsets, groups, rows, k, n, workspace, bytes,    \
                                 device, sm_count, stream);                                                     \
  }

}  // namespace cutlass_kernels
}  // namespace lightning_moe
