// Weighted SwiGLU between the two expert GEMMs: h = x @ w13 is [R, 2F] = [gate | up] and
//   a[r, f] = silu(gate[r, f]) * up[r, f] * w[r].
// Carrying the routing weight w into the activation (the memory-efficient permutation: the
// weight scales the activation, not the combined output) makes combine a plain sum and gives the weight's gradient from h alone:
//   grad_w[r] = sum_f grad_a[r, f] * silu(gate[r, f]) * up[r, f].
// Both kernels are bandwidth-bound elementwise passes: 16-byte vectors when F allows it, fp32
// math, one rounding to h's dtype at the store.
//
// Precise expf and IEEE division on purpose (no --use_fast_math): the pass is memory-bound, so
// the approximations would buy nothing, while __expf's error grows with |x| and would break the
// fp32 comparison with torch (rel 1e-5).
//
// Legend: R rows (dispatched tokens), F expert FFN width.

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::dispatch_bool;
using detail::kMinBlocks;
using detail::kThreads;
using detail::launch_rows;
using detail::RowLaunch;
using detail::Vec;

template <typename Tag>
using St = typename Tag::storage;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// Layout as in permute.cu: groups of 2^tpr_log2 threads own one row per grid-stride step, here
// with at least two of the row's vectors per thread (kVecsPerThread): H200, bf16,
// benchmarks/probes/row_kernels.py — Qwen3-30B-A3B (F = 768: 96 vectors a row, which one vector per thread
// spread over 128 threads, 32 idle) forward 0.204 -> 0.174 ms, backward 0.331 -> 0.260 ms
// (3.0 -> 3.5 and 3.9 TB/s; a copy: 4.1); DeepSeek-V3 backward 0.382 -> 0.350 ms. Four per thread
// gained nothing more; the permute kernels were not faster with two (they keep one).
constexpr int kVecsPerThread = 2;
template <typename Tag, int kN, bool kWeighted>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    swiglu_fwd_kernel(const St<Tag>* __restrict__ h, const float* __restrict__ w,
                      St<Tag>* __restrict__ a, int64_t num_rows, int64_t vecs_per_row,
                      int tpr_log2) {
  using V = Vec<Tag, kN>;
  const detail::RowGroups g(tpr_log2);
  const int64_t ffn = vecs_per_row * kN;
  for (int64_t r = g.first(); r < num_rows; r += g.step()) {
    const float wr = kWeighted ? w[r] : 1.0f;
    const St<Tag>* gate_row = h + r * 2 * ffn;
    const St<Tag>* up_row = gate_row + ffn;
#pragma unroll 2
    for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) {
      float g[kN], u[kN], o[kN];
      V::load_float(gate_row + j * kN, g);
      V::load_float(up_row + j * kN, u);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        o[i] = g[i] * sigmoid(g[i]) * u[i];  // same association as silu(gate) * up * w in torch
        if (kWeighted) o[i] *= wr;
      }
      V::store_float(a + r * ffn + j * kN, o);
    }
  }
}

// grad_h = [grad_a*w*up*silu'(gate) | grad_a*w*silu(gate)], silu'(g) = s*(1 + g*(1 - s)) with
// s = sigmoid(g); grad_w[r] = sum_f grad_a*silu(gate)*up. The row sum runs over the row's
// thread group: per-thread partials in vector order, a fixed xor butterfly inside each warp,
// then (rows wider than a warp) the warps' partials in warp order through shared memory. The
// order depends only on F, so grad_w is bitwise reproducible.
template <typename Tag, int kN, bool kWeighted, bool kGradW>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    swiglu_bwd_kernel(const St<Tag>* __restrict__ h, const float* __restrict__ w,
                      const St<Tag>* __restrict__ grad_a, St<Tag>* __restrict__ grad_h,
                      float* __restrict__ grad_w, int64_t num_rows, int64_t vecs_per_row,
                      int tpr_log2) {
  using V = Vec<Tag, kN>;
  __shared__ float warp_partial[kThreads / 32];
  const detail::RowGroups g(tpr_log2);
  const int64_t ffn = vecs_per_row * kN;
  // `base` is uniform across the block, so every thread reaches the shuffles and barriers
  // below, including threads whose row is past the end.
  for (int64_t base = g.first_base(); base < num_rows; base += g.step()) {
    const int64_t r = g.row_in(base);
    float partial = 0.0f;
    if (r < num_rows) {
      const float wr = kWeighted ? w[r] : 1.0f;
      const St<Tag>* gate_row = h + r * 2 * ffn;
      const St<Tag>* up_row = gate_row + ffn;
      St<Tag>* dgate_row = grad_h + r * 2 * ffn;
      St<Tag>* dup_row = dgate_row + ffn;
#pragma unroll 2
      for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) {
        float g[kN], u[kN], da[kN], dg[kN], du[kN];
        V::load_float(gate_row + j * kN, g);
        V::load_float(up_row + j * kN, u);
        V::load_float(grad_a + r * ffn + j * kN, da);
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const float s = sigmoid(g[i]);
          const float silu = g[i] * s;
          if (kGradW) partial += da[i] * silu * u[i];
          const float daw = kWeighted ? da[i] * wr : da[i];
          dg[i] = daw * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
          du[i] = daw * silu;
        }
        V::store_float(dgate_row + j * kN, dg);
        V::store_float(dup_row + j * kN, du);
      }
    }
    if (kGradW) {
      const int seg = g.tpr < 32 ? static_cast<int>(g.tpr) : 32;
      for (int o = seg >> 1; o > 0; o >>= 1) partial += __shfl_xor_sync(0xffffffffu, partial, o);
      if (g.tpr <= 32) {
        if (g.lane == 0 && r < num_rows) grad_w[r] = partial;
      } else {
        if ((threadIdx.x & 31) == 0) warp_partial[threadIdx.x >> 5] = partial;
        __syncthreads();
        if (g.lane == 0 && r < num_rows) {
          float total = 0.0f;
          for (int k = 0; k < static_cast<int>(g.tpr >> 5); ++k) total += warp_partial[(threadIdx.x >> 5) + k];
          grad_w[r] = total;
        }
        __syncthreads();  // warp_partial is rewritten by the next step
      }
    }
  }
}

}  // namespace

cudaError_t weighted_swiglu_fwd(const void* h, const float* w, void* a, int64_t num_rows,
                                int64_t ffn, DType dtype, cudaStream_t stream) {
  if (num_rows <= 0 || ffn <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  // gate and up start F elements apart inside a row: F's pitch bounds the width too.
  const int vb = detail::pick_vec_bytes(eb, {ffn * eb}, {h, a});
  return launch_rows(dtype, vb, ffn, num_rows, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    dispatch_bool(w != nullptr, [&](auto weighted) {
      swiglu_fwd_kernel<Tag, kN, decltype(weighted)::value><<<rl.grid, kThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(h), w, static_cast<St<Tag>*>(a), num_rows, rl.vecs,
          rl.log2_threads_per_row);
    });
  }, kVecsPerThread);
}

cudaError_t weighted_swiglu_bwd(const void* h, const float* w, const void* grad_a, void* grad_h,
                                float* grad_w, int64_t num_rows, int64_t ffn, DType dtype,
                                cudaStream_t stream) {
  if (num_rows <= 0) return cudaSuccess;
  if (ffn <= 0) {
    // Empty rows: the gradient of w is an empty sum.
    if (grad_w != nullptr) cudaMemsetAsync(grad_w, 0, sizeof(float) * num_rows, stream);
    return cudaGetLastError();
  }
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {ffn * eb}, {h, grad_a, grad_h});
  return launch_rows(dtype, vb, ffn, num_rows, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    dispatch_bool(w != nullptr, [&](auto weighted) {
      dispatch_bool(grad_w != nullptr, [&](auto want_gw) {
        swiglu_bwd_kernel<Tag, kN, decltype(weighted)::value, decltype(want_gw)::value>
            <<<rl.grid, kThreads, 0, stream>>>(
                static_cast<const St<Tag>*>(h), w, static_cast<const St<Tag>*>(grad_a),
                static_cast<St<Tag>*>(grad_h), grad_w, num_rows, rl.vecs, rl.log2_threads_per_row);
      });
    });
  }, kVecsPerThread);
}

}  // namespace lightning_moe
