// Row movement between token order [T, H] and expert order [R, H]: the gather (permute), the
// weighted gather-sum back (unpermute / combine; also the permute backward), and the routing
// weight's gradient of the latter. All three are bandwidth-bound: every row is moved with the
// widest aligned access (16 bytes when the row pitch allows it), and a row's index is one
// broadcast load for the threads that share the row.
//
// Legend: T tokens, H hidden, K top-k slots, R rows in expert order, S source rows.

#include <cassert>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::kMinBlocks;
using detail::kThreads;
using detail::Vec;

// Thread layout shared by the row kernels (detail::RowGroups): a block of 256 threads is cut into
// groups of 2^tpr_log2 threads; each group owns one row per grid-stride step and walks the row's
// kN-wide vectors. Short rows (few vectors) then pack several rows per block instead of idling threads.

// out[r] = x[src_idx[r]] (* row_scale[r]); a negative source index writes a zero row (padding
// rows of capacity-bounded buffers).
template <typename Tag, int kN, bool kScale>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    permute_rows_kernel(const typename Tag::storage* __restrict__ x,
                        const int32_t* __restrict__ src_idx, const float* __restrict__ row_scale,
                        typename Tag::storage* __restrict__ out, int64_t num_rows,
                        int64_t num_src_rows, int64_t vecs_per_row, int tpr_log2) {
  using V = Vec<Tag, kN>;
  const detail::RowGroups g(tpr_log2);
  const int64_t pitch = vecs_per_row * kN;
  for (int64_t r = g.first(); r < num_rows; r += g.step()) {
    const int64_t s = src_idx[r];
    assert(s < num_src_rows);  // a corrupt index would read another allocation silently
    typename Tag::storage* dst = out + r * pitch;
    if (s < 0) {
      for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) V::store(dst + j * kN, V::zero());
      continue;
    }
    const float scale = kScale ? row_scale[r] : 1.0f;
    const typename Tag::storage* src = x + s * pitch;
#pragma unroll 2
    for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) {
      if (kScale) {
        // Scale in fp32 and round once, as torch's `(x.float() * s).to(dtype)`.
        float f[kN];
        V::load_float(src + j * kN, f);
#pragma unroll
        for (int i = 0; i < kN; ++i) f[i] *= scale;
        V::store_float(dst + j * kN, f);
      } else {
        V::store(dst + j * kN, V::load(src + j * kN));  // bit-exact copy, no conversion
      }
    }
  }
}

// out[slot_row[t,k]] = x[t] for every slot with a row: the same result as the gather when every
// row is the destination of exactly one slot (dropless, or drops without capacity padding), with
// each source row read once instead of once per slot. The gather reads x's rows in expert order,
// a token's K reads far apart, so they miss L2 once x outgrows it; this reads x in order.
template <typename Tag, int kN>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    scatter_rows_kernel(const typename Tag::storage* __restrict__ x,
                        const int32_t* __restrict__ slot_row, typename Tag::storage* __restrict__ out,
                        int64_t num_tokens, int64_t top_k, int64_t num_rows, int64_t vecs_per_row,
                        int tpr_log2) {
  using V = Vec<Tag, kN>;
  const detail::RowGroups g(tpr_log2);
  const int64_t pitch = vecs_per_row * kN;
  for (int64_t t = g.first(); t < num_tokens; t += g.step()) {
    const int32_t* rows = slot_row + t * top_k;  // same address across the group: one broadcast
    const typename Tag::storage* src = x + t * pitch;
#pragma unroll 2
    for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) {
      const auto v = V::load(src + j * kN);  // bit-exact copy, no conversion
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t r = rows[k];
        if (r < 0) continue;  // dropped slot
        assert(r < num_rows);  // a corrupt index would write another allocation silently
        V::store(out + r * pitch + j * kN, v);
      }
    }
  }
}

// out[t] = sum_k w[t,k] * y[slot_row[t,k]]. Each thread keeps kN fp32 accumulators and adds the
// K rows in increasing k: a fixed order, so the result is bitwise reproducible, and no atomics
// (each output element has exactly one writer). The rows are read kBatch at a time as raw vectors,
// all of a batch's loads issued before the first is converted (eight 16-byte loads in flight per
// thread for top-8 routing, in 32 registers): the pass is 8/9 reads, and with four in flight it
// reached ~80 % of a plain read's bandwidth on the H200.
template <typename Tag, int kN, bool kWeighted>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    unpermute_sum_kernel(const typename Tag::storage* __restrict__ y,
                         const int32_t* __restrict__ slot_row, const float* __restrict__ w,
                         typename Tag::storage* __restrict__ out, int64_t num_tokens,
                         int64_t top_k, int64_t vecs_per_row, int tpr_log2) {
  using V = Vec<Tag, kN>;
  constexpr int kBatch = 8;
  const detail::RowGroups g(tpr_log2);
  const int64_t pitch = vecs_per_row * kN;
  for (int64_t t = g.first(); t < num_tokens; t += g.step()) {
    const int32_t* rows = slot_row + t * top_k;  // same address across the group: one broadcast
    for (int64_t j = g.lane; j < vecs_per_row; j += g.tpr) {
      float acc[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) acc[i] = 0.0f;
      for (int64_t k0 = 0; k0 < top_k; k0 += kBatch) {
        typename V::raw_t v[kBatch];
        int64_t r[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          r[u] = k0 + u < top_k ? rows[k0 + u] : -1;
          v[u] = r[u] >= 0 ? V::load(y + r[u] * pitch + j * kN) : V::zero();
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (r[u] < 0) continue;  // dropped slot (or past K): adds nothing, as before
          float f[kN];
          V::to_float(v[u], f);
          if (kWeighted) {
            const float wk = w[t * top_k + k0 + u];
#pragma unroll
            for (int i = 0; i < kN; ++i) acc[i] = fmaf(wk, f[i], acc[i]);
          } else {
#pragma unroll
            for (int i = 0; i < kN; ++i) acc[i] += f[i];
          }
        }
      }
      V::store_float(out + t * pitch + j * kN, acc);
    }
  }
}

// grad_w[t,k] = <grad_out[t], y[slot_row[t,k]]>: one warp per (t, k) pair, lane-strided vectors
// (coalesced), per-lane fp32 FMA chain, then a fixed-order butterfly (deterministic). grad_out[t]
// is read K times; the K reads of one token land in consecutive warps and hit L2.
template <typename Tag, int kN>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    unpermute_weight_grad_kernel(const typename Tag::storage* __restrict__ grad_out,
                                 const typename Tag::storage* __restrict__ y,
                                 const int32_t* __restrict__ slot_row, float* __restrict__ grad_w,
                                 int64_t num_pairs, int64_t top_k, int64_t vecs_per_row) {
  using V = Vec<Tag, kN>;
  constexpr int64_t kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31;
  const int64_t pitch = vecs_per_row * kN;
  // The loop condition is uniform across the warp, as warp_sum's full mask requires.
  for (int64_t p = blockIdx.x * kWarps + (threadIdx.x >> 5); p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t r = slot_row[p];
    float acc = 0.0f;
    if (r >= 0) {
      const typename Tag::storage* g = grad_out + (p / top_k) * pitch;
      const typename Tag::storage* yr = y + r * pitch;
      for (int64_t j = lane; j < vecs_per_row; j += 32) {
        float a[kN], b[kN];
        V::load_float(g + j * kN, a);
        V::load_float(yr + j * kN, b);
#pragma unroll
        for (int i = 0; i < kN; ++i) acc = fmaf(a[i], b[i], acc);
      }
    }
    acc = detail::warp_sum(acc);
    if (lane == 0) grad_w[p] = acc;
  }
}

template <typename Tag>
using St = typename Tag::storage;
using detail::dispatch_bool;
using detail::launch_rows;
using detail::RowLaunch;

}  // namespace

cudaError_t permute_rows(const void* x, const int32_t* src_idx, const float* row_scale, void* out,
                         int64_t num_rows, int64_t num_src_rows, int64_t hidden, DType dtype,
                         cudaStream_t stream) {
  if (num_rows <= 0 || hidden <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {hidden * eb}, {x, out});
  return launch_rows(dtype, vb, hidden, num_rows, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    dispatch_bool(row_scale != nullptr, [&](auto scale) {
      permute_rows_kernel<Tag, kN, decltype(scale)::value><<<rl.grid, kThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(x), src_idx, row_scale, static_cast<St<Tag>*>(out), num_rows,
          num_src_rows, rl.vecs, rl.log2_threads_per_row);
    });
  });
}

cudaError_t scatter_rows(const void* x, const int32_t* slot_row, void* out, int64_t num_tokens,
                         int64_t top_k, int64_t num_rows, int64_t hidden, DType dtype, cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0 || num_rows <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {hidden * eb}, {x, out});
  return launch_rows(dtype, vb, hidden, num_tokens, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    scatter_rows_kernel<Tag, kN><<<rl.grid, kThreads, 0, stream>>>(
        static_cast<const St<Tag>*>(x), slot_row, static_cast<St<Tag>*>(out), num_tokens, top_k, num_rows,
        rl.vecs, rl.log2_threads_per_row);
  });
}

cudaError_t unpermute_sum(const void* y, const int32_t* slot_row, const float* w, void* out,
                          int64_t num_tokens, int64_t top_k, int64_t hidden, DType dtype,
                          cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {hidden * eb}, {y, out});
  return launch_rows(dtype, vb, hidden, num_tokens, [&](auto tag, auto n, const RowLaunch& rl) {
    using Tag = decltype(tag);
    constexpr int kN = decltype(n)::value;
    dispatch_bool(w != nullptr, [&](auto weighted) {
      unpermute_sum_kernel<Tag, kN, decltype(weighted)::value><<<rl.grid, kThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(y), slot_row, w, static_cast<St<Tag>*>(out), num_tokens,
          top_k, rl.vecs, rl.log2_threads_per_row);
    });
  });
}

cudaError_t unpermute_weight_grad(const void* grad_out, const void* y, const int32_t* slot_row,
                                  float* grad_w, int64_t num_tokens, int64_t top_k, int64_t hidden,
                                  DType dtype, cudaStream_t stream) {
  const int64_t pairs = num_tokens * top_k;
  if (pairs <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {hidden * eb}, {grad_out, y});
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    return detail::dispatch_vec<Tag>(vb, [&](auto n) {
      constexpr int kN = decltype(n)::value;
      const int64_t vecs = hidden / kN;
      const int grid = detail::grid_size((pairs + kThreads / 32 - 1) / (kThreads / 32));
      unpermute_weight_grad_kernel<Tag, kN><<<grid, kThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(grad_out), static_cast<const St<Tag>*>(y), slot_row, grad_w,
          pairs, top_k, vecs);
      return cudaGetLastError();
    });
  });
}

}  // namespace lightning_moe
