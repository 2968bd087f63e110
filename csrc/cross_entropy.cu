// Token cross-entropy over a vocabulary row, straight from the logits' own dtype:
//   forward   lse[t]  = log(sum_v exp(x[t, v]))          (fp32, one online max/sum pass)
//             loss[t] = lse[t] - x[t, label[t]]          (0 where label[t] == ignore_index)
//   backward  grad[t, v] = (exp(x[t, v] - lse[t]) - [v == label[t]]) * g[t]
//             (0 for ignored rows), rounded once to x's dtype.
// The torch path upcasts the whole [T, V] logits to fp32, saves fp32 log-probabilities and writes
// an fp32 gradient that is cast back: four full-size fp32 passes. Here the forward reads the logits
// once and saves nothing of size V; the backward reads them once and writes the gradient once.
//
// A label outside [0, V) that is not ignore_index gives a NaN loss (torch raises a device-side
// assert there): the loss shows it, nothing is silently dropped.
//
// Precise expf/logf (no --use_fast_math), fp32 accumulation, a fixed reduction order per row and
// block size (deterministic).
//
// Legend: T tokens (rows), V vocabulary (row width).

#include <cmath>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::load1;
using detail::Vec;

template <typename Tag>
using St = typename Tag::storage;

constexpr int kCeThreads = 512;

// Merge of two online-softmax states (max m, sum s of exp(x - m)).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ void add(float& m, float& s, float x) {
  if (x == -INFINITY) return;
  if (x > m) {
    s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

template <typename Tag, int kN>
__global__ void __launch_bounds__(kCeThreads)
    ce_fwd_kernel(const St<Tag>* __restrict__ x, const int64_t* __restrict__ labels,
                  float* __restrict__ loss, float* __restrict__ lse, int64_t rows, int64_t vocab,
                  int64_t ignore_index) {
  using V = Vec<Tag, kN>;
  __shared__ float sm_m[kCeThreads / 32], sm_s[kCeThreads / 32];
  const int64_t vecs = vocab / kN;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const St<Tag>* row = x + t * vocab;
    float m = -INFINITY, s = 0.0f;
    for (int64_t j = threadIdx.x; j < vecs; j += kCeThreads) {
      float f[kN];
      V::load_float(row + j * kN, f);
#pragma unroll
      for (int i = 0; i < kN; ++i) add(m, s, f[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) sm_m[warp] = m, sm_s[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float bm = sm_m[0], bs = sm_s[0];
      for (int w = 1; w < kCeThreads / 32; ++w) merge(bm, bs, sm_m[w], sm_s[w]);
      const float l = bm + logf(bs);  // every logit -inf: -inf + log(0) = -inf, loss NaN below
      lse[t] = l;
      const int64_t y = labels[t];
      if (y == ignore_index) {
        loss[t] = 0.0f;
      } else if (y < 0 || y >= vocab) {
        loss[t] = NAN;
      } else {
        loss[t] = l - load1<Tag>(row + y);
      }
    }
    __syncthreads();  // sm_m/sm_s are reused by the next row
  }
}

template <typename Tag, int kN>
__global__ void __launch_bounds__(kCeThreads)
    ce_bwd_kernel(const St<Tag>* __restrict__ x, const int64_t* __restrict__ labels,
                  const float* __restrict__ lse, const float* __restrict__ grad_loss,
                  St<Tag>* __restrict__ grad_x, int64_t rows, int64_t vocab, int64_t ignore_index) {
  using V = Vec<Tag, kN>;
  const int64_t vecs = vocab / kN;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const int64_t y = labels[t];
    const bool ignored = y == ignore_index;
    const float g = ignored ? 0.0f : grad_loss[t];
    const float l = lse[t];
    const St<Tag>* row = x + t * vocab;
    St<Tag>* out = grad_x + t * vocab;
    for (int64_t j = threadIdx.x; j < vecs; j += kCeThreads) {
      float f[kN];
      V::load_float(row + j * kN, f);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const int64_t v = j * kN + i;
        const float p = expf(f[i] - l);
        f[i] = ignored ? 0.0f : (p - (v == y ? 1.0f : 0.0f)) * g;
      }
      V::store_float(out + j * kN, f);
    }
  }
}

int ce_grid(int64_t rows) { return detail::grid_size(rows, 4); }  // 4 blocks of 512 threads fill an SM

}  // namespace

cudaError_t cross_entropy_fwd(const void* x, const int64_t* labels, float* loss, float* lse, int64_t rows,
                              int64_t vocab, int64_t ignore_index, DType dtype, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {vocab * eb}, {x});
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    return detail::dispatch_vec<Tag>(vb, [&](auto n) {
      ce_fwd_kernel<Tag, decltype(n)::value><<<ce_grid(rows), kCeThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(x), labels, loss, lse, rows, vocab, ignore_index);
      return cudaGetLastError();
    });
  });
}

cudaError_t cross_entropy_bwd(const void* x, const int64_t* labels, const float* lse, const float* grad_loss,
                              void* grad_x, int64_t rows, int64_t vocab, int64_t ignore_index, DType dtype,
                              cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const int vb = detail::pick_vec_bytes(eb, {vocab * eb}, {x, grad_x});
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    return detail::dispatch_vec<Tag>(vb, [&](auto n) {
      ce_bwd_kernel<Tag, decltype(n)::value><<<ce_grid(rows), kCeThreads, 0, stream>>>(
          static_cast<const St<Tag>*>(x), labels, lse, grad_loss, static_cast<St<Tag>*>(grad_x), rows, vocab,
          ignore_index);
      return cudaGetLastError();
    });
  });
}

}  // namespace lightning_moe
