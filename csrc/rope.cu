// Rotary position embedding (the rotate-half convention) of attention heads, forward and backward
// in one kernel:
//   forward   out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin
//   backward  gx1  = g1 * cos + g2 * sin,   gx2  = g2 * cos - g1 * sin
// where x1 = x[..., :D/2] and x2 = x[..., D/2:] of one head row, cos/sin the fp32 table row of the
// row's token. One read and one write of the activations, instead of the fp32 copy, four products,
// two sums, a concatenation and a cast the torch expression makes (each a full pass in fp32).
//
// Rounding: every product and sum is rounded separately (__fmul_rn / __fadd_rn / __fsub_rn: no
// contraction into FMAs), as torch's elementwise kernels compute them, and the result is rounded
// once to x's dtype at the store, so the forward equals the torch expression bit for bit, and the
// backward equals autograd's through it.
//
// Legend: R rows (token-heads: T tokens x N heads, tokens major), D head dim, P table rows (the
// token of row r reads table row (r / N) % P: P = S for one table shared by every batch row, P = T
// for per-token positions).

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::kMinBlocks;
using detail::kThreads;
using detail::launch_rows;
using detail::RowLaunch;
using detail::Vec;

template <typename Tag>
using St = typename Tag::storage;

template <typename Tag, int kN, bool kBackward>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    rope_kernel(const St<Tag>* __restrict__ x, const float* __restrict__ cos_t,
                const float* __restrict__ sin_t, St<Tag>* __restrict__ out, int64_t num_rows,
                int64_t vecs_per_half, int64_t heads, int64_t table_rows, int tpr_log2) {
  using V = Vec<Tag, kN>;
  const detail::RowGroups g(tpr_log2);
  const int64_t half = vecs_per_half * kN;
  for (int64_t r = g.first(); r < num_rows; r += g.step()) {
    const int64_t pos = (r / heads) % table_rows;
    const float* c_row = cos_t + pos * half;
    const float* s_row = sin_t + pos * half;
    const St<Tag>* x1_row = x + r * 2 * half;
    St<Tag>* o1_row = out + r * 2 * half;
    for (int64_t j = g.lane; j < vecs_per_half; j += g.tpr) {
      float a[kN], b[kN], o1[kN], o2[kN];
      V::load_float(x1_row + j * kN, a);
      V::load_float(x1_row + half + j * kN, b);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float c = c_row[j * kN + i], s = s_row[j * kN + i];
        if constexpr (kBackward) {
          o1[i] = __fadd_rn(__fmul_rn(a[i], c), __fmul_rn(b[i], s));
          o2[i] = __fsub_rn(__fmul_rn(b[i], c), __fmul_rn(a[i], s));
        } else {
          o1[i] = __fsub_rn(__fmul_rn(a[i], c), __fmul_rn(b[i], s));
          o2[i] = __fadd_rn(__fmul_rn(b[i], c), __fmul_rn(a[i], s));
        }
      }
      V::store_float(o1_row + j * kN, o1);
      V::store_float(o1_row + half + j * kN, o2);
    }
  }
}

}  // namespace

cudaError_t rope(const void* x, const float* cos_t, const float* sin_t, void* out, int64_t num_rows,
                 int64_t half, int64_t heads, int64_t table_rows, bool backward, DType dtype,
                 cudaStream_t stream) {
  if (num_rows <= 0 || half <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  // x1 and x2 start D/2 elements apart inside a row: D/2's pitch bounds the vector width.
  const int vb = detail::pick_vec_bytes(eb, {half * eb}, {x, out});
  return launch_rows(dtype, vb, half, num_rows, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    detail::dispatch_bool(backward, [&](auto bwd) {
      rope_kernel<Tag, kN, decltype(bwd)::value><<<rl.grid, kThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(x), cos_t, sin_t, static_cast<St<Tag>*>(out), num_rows,
          rl.vecs, heads, table_rows, rl.log2_threads_per_row);
    });
  });
}

}  // namespace lightning_moe
