// Per-head RMSNorm followed by the rotary embedding (Qwen3-style query/key norm), fused, forward and
// backward. For one head row x [D] (D = 2 * half) with its token's fp32 table rows c, s [half]:
//   r  = 1 / sqrt(mean(x^2) + eps)           (fp32, saved: one float per row)
//   n  = x * r * w                            (w: the norm's weight [D])
//   y  = [n1 * c - n2 * s, n2 * c + n1 * s]   (n1 = n[:half], n2 = n[half:])
// backward, from g = dL/dy:
//   gn = [g1 * c + g2 * s, g2 * c - g1 * s]
//   dw += gn * (x * r)                        (summed over rows: per-block partials, fp32)
//   dx = r * (gn * w - (x * r) * mean(gn * w * x * r))
// The unfused path runs the norm (writing n rounded to x's dtype) and then the rotation, reading and
// writing the activations twice and launching torch's norm kernels, which are slow on 64- to 256-wide
// rows. Here n stays in fp32 registers between the two; one read and one write each way.
//
// One warp per row: lane l holds the half-row elements l, l + 32, ... (and their partners half apart),
// so every load is one coalesced 64- or 128-byte run per instruction. D must be a multiple of 64
// (64, 128, 192, 256: kPairs = D / 64 pairs per lane); the Python side falls back otherwise.
//
// Legend: R rows (token-heads, tokens major: row r is token r / heads), D head dim, P table rows
// (token t reads table row t % P).

#include <cmath>

#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::load1;
using detail::store1;
using detail::warp_sum;

template <typename Tag>
using St = typename Tag::storage;

constexpr int kWarps = 8;  // 256 threads: one row per warp per step

template <typename Tag, int kPairs>
__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_fwd_kernel(const St<Tag>* __restrict__ x, const St<Tag>* __restrict__ w,
                            const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                            St<Tag>* __restrict__ y, float* __restrict__ rstd, int64_t rows, int64_t heads,
                            int64_t table_rows, float eps) {
  constexpr int kHalf = kPairs * 32, kD = 2 * kHalf;
  const int lane = threadIdx.x % 32;
  float w1[kPairs], w2[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) w1[j] = load1<Tag>(w + lane + 32 * j), w2[j] = load1<Tag>(w + kHalf + lane + 32 * j);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += warps) {
    const St<Tag>* xr = x + r * kD;
    float a[kPairs], b[kPairs], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      a[j] = load1<Tag>(xr + lane + 32 * j);
      b[j] = load1<Tag>(xr + kHalf + lane + 32 * j);
      ss += a[j] * a[j] + b[j] * b[j];
    }
    const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(kD) + eps);
    if (lane == 0) rstd[r] = inv;
    const int64_t pos = (r / heads) % table_rows;
    const float* cr = cos_t + pos * kHalf;
    const float* sr = sin_t + pos * kHalf;
    St<Tag>* yr = y + r * kD;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = lane + 32 * j;
      const float n1 = a[j] * inv * w1[j], n2 = b[j] * inv * w2[j];
      const float c = cr[i], s = sr[i];
      store1<Tag>(yr + i, n1 * c - n2 * s);
      store1<Tag>(yr + kHalf + i, n2 * c + n1 * s);
    }
  }
}

template <typename Tag, int kPairs>
__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_bwd_kernel(const St<Tag>* __restrict__ x, const St<Tag>* __restrict__ w,
                            const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                            const float* __restrict__ rstd, const St<Tag>* __restrict__ g,
                            St<Tag>* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,
                            int64_t heads, int64_t table_rows) {
  constexpr int kHalf = kPairs * 32, kD = 2 * kHalf;
  __shared__ float dw_smem[kWarps][kD];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float w1[kPairs], w2[kPairs], dw1[kPairs], dw2[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    w1[j] = load1<Tag>(w + lane + 32 * j), w2[j] = load1<Tag>(w + kHalf + lane + 32 * j);
    dw1[j] = 0.0f, dw2[j] = 0.0f;
  }
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp; r < rows; r += warps) {
    const St<Tag>* xr = x + r * kD;
    const St<Tag>* gr = g + r * kD;
    const float inv = rstd[r];
    const int64_t pos = (r / heads) % table_rows;
    const float* cr = cos_t + pos * kHalf;
    const float* sr = sin_t + pos * kHalf;
    float h1[kPairs], h2[kPairs], q1[kPairs], q2[kPairs], dot = 0.0f;  // h = x * r, q = gn * w
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = lane + 32 * j;
      const float g1 = load1<Tag>(gr + i), g2 = load1<Tag>(gr + kHalf + i);
      const float c = cr[i], s = sr[i];
      const float gn1 = g1 * c + g2 * s, gn2 = g2 * c - g1 * s;
      h1[j] = load1<Tag>(xr + i) * inv, h2[j] = load1<Tag>(xr + kHalf + i) * inv;
      dw1[j] += gn1 * h1[j], dw2[j] += gn2 * h2[j];
      q1[j] = gn1 * w1[j], q2[j] = gn2 * w2[j];
      dot += q1[j] * h1[j] + q2[j] * h2[j];
    }
    const float mean = warp_sum(dot) / static_cast<float>(kD);
    St<Tag>* dr = dx + r * kD;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = lane + 32 * j;
      store1<Tag>(dr + i, inv * (q1[j] - h1[j] * mean));
      store1<Tag>(dr + kHalf + i, inv * (q2[j] - h2[j] * mean));
    }
  }
#pragma unroll
  for (int j = 0; j < kPairs; ++j) dw_smem[warp][lane + 32 * j] = dw1[j], dw_smem[warp][kHalf + lane + 32 * j] = dw2[j];
  __syncthreads();
  for (int i = threadIdx.x; i < kD; i += kWarps * 32) {
    float acc = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) acc += dw_smem[v][i];  // fixed order: deterministic
    dw_partial[static_cast<int64_t>(blockIdx.x) * kD + i] = acc;
  }
}

template <typename Fn>
cudaError_t dispatch_pairs(int64_t dim, Fn&& f) {
  switch (dim) {
    case 64: return f(detail::IntTag<1>{});
    case 128: return f(detail::IntTag<2>{});
    case 192: return f(detail::IntTag<3>{});
    case 256: return f(detail::IntTag<4>{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int qk_norm_rope_grid(int64_t rows) { return detail::grid_size((rows + kWarps - 1) / kWarps); }

cudaError_t qk_norm_rope_fwd(const void* x, const void* w, const float* cos_t, const float* sin_t, void* y,
                             float* rstd, int64_t rows, int64_t dim, int64_t heads, int64_t table_rows, float eps,
                             DType dtype, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    return dispatch_pairs(dim, [&](auto pairs) {
      qk_norm_rope_fwd_kernel<Tag, decltype(pairs)::value><<<qk_norm_rope_grid(rows), kWarps * 32, 0, stream>>>(
          static_cast<const St<Tag>*>(x), static_cast<const St<Tag>*>(w), cos_t, sin_t, static_cast<St<Tag>*>(y),
          rstd, rows, heads, table_rows, eps);
      return cudaGetLastError();
    });
  });
}

cudaError_t qk_norm_rope_bwd(const void* x, const void* w, const float* cos_t, const float* sin_t,
                             const float* rstd, const void* g, void* dx, float* dw_partial, int64_t rows, int64_t dim,
                             int64_t heads, int64_t table_rows, DType dtype, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    return dispatch_pairs(dim, [&](auto pairs) {
      qk_norm_rope_bwd_kernel<Tag, decltype(pairs)::value><<<qk_norm_rope_grid(rows), kWarps * 32, 0, stream>>>(
          static_cast<const St<Tag>*>(x), static_cast<const St<Tag>*>(w), cos_t, sin_t, rstd,
          static_cast<const St<Tag>*>(g), static_cast<St<Tag>*>(dx), dw_partial, rows, heads, table_rows);
      return cudaGetLastError();
    });
  });
}

}  // namespace lightning_moe
