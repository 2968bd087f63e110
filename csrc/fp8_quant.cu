// FP8 quantization of rows: rowwise (one scale per row) or blockwise (one scale per 1 x 128 tile
// along the row), e4m3 or e5m2, with fp32 dequantization scales (x ~= data * scale). Three entry
// points share one kernel and differ only in where a row's values come from:
//   * quantize_rows_fp8: rows of x as they are;
//   * the same with a source index: rows gathered by a permutation (x[src_idx[r]], -1 a zero row),
//     one read of x and one write of FP8: the send buffer of an FP8 token dispatch;
//   * swiglu_quantize_fp8: the weighted SwiGLU a = silu(gate) * up * w of h = [gate | up], each value
//     rounded to h's dtype exactly as swiglu.cu rounds it, then quantized: the FP8 input of the
//     second expert GEMM without a round trip of a through memory.
//
// The numbers (scale, rounding, the NaN rule) are those of lightning_moe/ops/fp8/quantize.py, in
// fp8_codec.cuh, which a host test checks against torch value by value.
//
// Layout: one warp per row (grid-stride over rows); the row is walked in chunks of 128 values, four
// per lane. Blockwise: a chunk is a unit, its amax a warp reduction, its values kept in registers
// between the reduction and the store. Rowwise: a first pass reduces the whole row, a second
// re-reads it (from L1/L2) and stores. H200, bf16 [32768, 7168]: 0.57 ms (1.24 TB/s counting the
// bf16 read and the FP8 write) against 3.1 ms for quantize.py. Issuing four chunks' loads at once did
// not raise it (blockwise the same, rowwise 1.07 against 1.26 TB/s): the loop is not short of loads
// in flight.
//
// Legend: R rows, S source rows, H row width, F expert FFN width, U units per row (1 rowwise,
// ceil(H / 128) blockwise).

#include <cassert>
#include <cfloat>
#include <cstdint>

#include "fp8_codec.cuh"
#include "moe_kernels.cuh"

namespace lightning_moe {
namespace {

using detail::kMinBlocks;
using detail::kThreads;
using detail::Vec;

template <typename Tag>
using St = typename Tag::storage;

constexpr int kChunk = 128;          // values a warp handles per step (the blockwise tile)
constexpr int kPerLane = kChunk / 32;  // 4
constexpr int kWarps = kThreads / 32;

// One stored value as fp32, and an fp32 rounded to the storage dtype and back (round to nearest even,
// as swiglu.cu's stores round).
template <typename Tag>
__device__ __forceinline__ float to_float_one(St<Tag> v) {
  if constexpr (sizeof(St<Tag>) == 4) {
    return v;
  } else {
    return Tag::one(v);
  }
}
template <typename Tag>
__device__ __forceinline__ float round_trip(float v) {
  if constexpr (sizeof(St<Tag>) == 4) {
    return v;
  } else {
    return Tag::one(Tag::pack1(v));
  }
}

using fp8::quantize_value;
using fp8::unit_scale;

// ---- where a row's values come from -------------------------------------------------------------

// Which column lane `lane`'s j-th value of a chunk is: four consecutive columns per lane when rows
// allow 4-wide accesses (kVec), else columns lane, lane + 32, ... (still coalesced).
template <bool kVec>
__device__ __forceinline__ int chunk_col(int lane, int j) {
  return kVec ? lane * kPerLane + j : j * 32 + lane;
}

// Rows of x, optionally gathered: row r is x[src_idx[r]] (src_idx null: x[r]); a negative source
// index is a zero row.
template <typename Tag, bool kVec>
struct RowSource {
  const St<Tag>* x;
  const int32_t* src_idx;
  int64_t width;
  int64_t num_src_rows;

  __device__ __forceinline__ const St<Tag>* row(int64_t r) const {
    const int64_t s = src_idx == nullptr ? r : static_cast<int64_t>(src_idx[r]);
    assert(s < num_src_rows);  // a corrupt index would read another allocation silently
    return s < 0 ? nullptr : x + s * width;
  }
  // The lane's four values of the chunk starting at column c0 (zeros past the row's end).
  __device__ __forceinline__ void load(const St<Tag>* p, int64_t c0, int lane, float (&v)[kPerLane]) const {
    if (p == nullptr) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) v[j] = 0.0f;
      return;
    }
    if constexpr (kVec) {
      const int64_t c = c0 + lane * kPerLane;  // width % 4 == 0: the four are all in or all out
      if (c < width) {
        Vec<Tag, kPerLane>::load_float(p + c, v);
      } else {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) v[j] = 0.0f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int64_t c = c0 + chunk_col<false>(lane, j);
        v[j] = c < width ? to_float_one<Tag>(p[c]) : 0.0f;
      }
    }
  }
};

// a[r, f] = silu(h[r, f]) * h[r, F + f] * w[r], computed as swiglu.cu computes it and rounded to
// h's dtype (the value the unfused path would store and then quantize).
template <typename Tag, bool kVec>
struct SwigluSource {
  const St<Tag>* h;
  const float* w;
  int64_t width;  // F

  __device__ __forceinline__ const St<Tag>* row(int64_t r) const { return h + r * 2 * width; }

  __device__ __forceinline__ float value(float g, float u, float wr) const {
    float o = g * (1.0f / (1.0f + expf(-g))) * u;  // swiglu.cu's association
    if (w != nullptr) o *= wr;
    return round_trip<Tag>(o);
  }

  __device__ __forceinline__ void load(const St<Tag>* p, int64_t c0, int lane, float (&v)[kPerLane],
                                       float wr) const {
    if constexpr (kVec) {
      const int64_t c = c0 + lane * kPerLane;
      if (c < width) {
        float g[kPerLane], u[kPerLane];
        Vec<Tag, kPerLane>::load_float(p + c, g);
        Vec<Tag, kPerLane>::load_float(p + width + c, u);
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) v[j] = value(g[j], u[j], wr);
      } else {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) v[j] = 0.0f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int64_t c = c0 + chunk_col<false>(lane, j);
        v[j] = c < width ? value(to_float_one<Tag>(p[c]), to_float_one<Tag>(p[width + c]), wr)
                         : 0.0f;
      }
    }
  }
};

// Loads through either source with one signature (the SwiGLU source also takes the row weight).
template <typename Tag, bool kVec>
__device__ __forceinline__ void load_chunk(const RowSource<Tag, kVec>& src, const St<Tag>* p, int64_t c0, int lane,
                                           float (&v)[kPerLane], float) {
  src.load(p, c0, lane, v);
}
template <typename Tag, bool kVec>
__device__ __forceinline__ void load_chunk(const SwigluSource<Tag, kVec>& src, const St<Tag>* p, int64_t c0, int lane,
                                           float (&v)[kPerLane], float wr) {
  src.load(p, c0, lane, v, wr);
}
template <typename Tag, bool kVec>
__device__ __forceinline__ float row_weight(const RowSource<Tag, kVec>&, int64_t) { return 1.0f; }
template <typename Tag, bool kVec>
__device__ __forceinline__ float row_weight(const SwigluSource<Tag, kVec>& src, int64_t r) {
  return src.w != nullptr ? src.w[r] : 1.0f;
}

// ---- the kernel -------------------------------------------------------------------------------------

__device__ __forceinline__ void chunk_amax(const float (&v)[kPerLane], float& amax, bool& nonfinite) {
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float a = fabsf(v[j]);
    nonfinite = nonfinite || !(a <= FLT_MAX);  // NaN or inf
    amax = fmaxf(amax, a);
  }
}

// Stores the lane's four codes of the chunk starting at c0 (kVec: one 4-byte store).
template <bool kVec>
__device__ __forceinline__ void store_chunk(uint8_t* out_row, int64_t c0, int lane, const uint32_t (&code)[kPerLane],
                                            int64_t width) {
  if constexpr (kVec) {
    const int64_t c = c0 + lane * kPerLane;
    if (c < width) {
      const uint32_t packed = code[0] | (code[1] << 8) | (code[2] << 16) | (code[3] << 24);
      *reinterpret_cast<uint32_t*>(out_row + c) = packed;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t c = c0 + chunk_col<false>(lane, j);
      if (c < width) out_row[c] = static_cast<uint8_t>(code[j]);
    }
  }
}

// kBlockwise: one unit per 128-value chunk; else one unit per row. Every lane of a warp runs the
// same trip counts, as the full-mask shuffles require.
template <typename Tag, bool kVec, bool kE5M2, bool kBlockwise, class Source>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    quantize_rows_kernel(Source src, uint8_t* __restrict__ data, float* __restrict__ scale, int64_t num_rows,
                         int64_t width, bool pow2) {
  const int lane = threadIdx.x & 31;
  const int64_t chunks = (width + kChunk - 1) / kChunk;
  const int64_t units = kBlockwise ? chunks : 1;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); r < num_rows;
       r += static_cast<int64_t>(gridDim.x) * kWarps) {
    const St<Tag>* p = src.row(r);
    const float wr = row_weight(src, r);
    uint8_t* out_row = data + r * width;
    if constexpr (kBlockwise) {
      for (int64_t u = 0; u < chunks; ++u) {
        float v[kPerLane];
        load_chunk(src, p, u * kChunk, lane, v, wr);
        float amax = 0.0f;
        bool nonfinite = false;
        chunk_amax(v, amax, nonfinite);
        amax = detail::warp_max(amax);
        nonfinite = __any_sync(0xffffffffu, nonfinite);
        const float s = unit_scale<kE5M2>(amax, nonfinite, pow2);
        uint32_t code[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) code[j] = quantize_value<kE5M2>(v[j], s);
        store_chunk<kVec>(out_row, u * kChunk, lane, code, width);
        if (lane == 0) scale[r * units + u] = s;
      }
    } else {
      float amax = 0.0f;
      bool nonfinite = false;
      for (int64_t u = 0; u < chunks; ++u) {
        float v[kPerLane];
        load_chunk(src, p, u * kChunk, lane, v, wr);
        chunk_amax(v, amax, nonfinite);
      }
      amax = detail::warp_max(amax);
      nonfinite = __any_sync(0xffffffffu, nonfinite);
      const float s = unit_scale<kE5M2>(amax, nonfinite, pow2);
      for (int64_t u = 0; u < chunks; ++u) {
        float v[kPerLane];
        load_chunk(src, p, u * kChunk, lane, v, wr);
        uint32_t code[kPerLane];
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) code[j] = quantize_value<kE5M2>(v[j], s);
        store_chunk<kVec>(out_row, u * kChunk, lane, code, width);
      }
      if (lane == 0) scale[r] = s;
    }
  }
}

// Launches the kernel for the runtime dtype / format / unit flags, with the source made by
// make_source(Tag{}, std::bool_constant<kVec>{}).
template <class MakeSource>
cudaError_t launch_quantize(DType dtype, bool vec, Fp8Format fmt, bool blockwise, bool pow2, void* data, float* scale,
                            int64_t num_rows, int64_t width, cudaStream_t stream, MakeSource&& make_source) {
  const int grid = detail::grid_size((num_rows + kWarps - 1) / kWarps);
  return detail::dispatch_dtype(dtype, [&](auto tag) {
    using Tag = decltype(tag);
    detail::dispatch_bool(vec, [&](auto kv) {
      constexpr bool kVec = decltype(kv)::value;
      auto src = make_source(tag, kv);
      detail::dispatch_bool(fmt == Fp8Format::kE5M2, [&](auto e5) {
        detail::dispatch_bool(blockwise, [&](auto bw) {
          quantize_rows_kernel<Tag, kVec, decltype(e5)::value, decltype(bw)::value, decltype(src)>
              <<<grid, kThreads, 0, stream>>>(src, static_cast<uint8_t*>(data), scale, num_rows, width, pow2);
        });
      });
    });
    return cudaGetLastError();
  });
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t quantize_rows_fp8(const void* x, const int32_t* src_idx, void* data, float* scale, int64_t num_rows,
                              int64_t num_src_rows, int64_t hidden, Fp8Format fmt, bool blockwise, bool pow2_scales, DType dtype,
                              cudaStream_t stream) {
  if (num_rows <= 0 || hidden <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  // Four values per access need every row to start on a 4-value boundary (in x and in data).
  const bool vec = hidden % kPerLane == 0 && aligned(x, kPerLane * eb) && aligned(data, kPerLane);
  return launch_quantize(dtype, vec, fmt, blockwise, pow2_scales, data, scale, num_rows, hidden, stream,
                         [&](auto tag, auto kv) {
                           using Tag = decltype(tag);
                           return RowSource<Tag, decltype(kv)::value>{static_cast<const St<Tag>*>(x), src_idx, hidden,
                                                                     num_src_rows};
                         });
}

cudaError_t swiglu_quantize_fp8(const void* h, const float* w, void* data, float* scale, int64_t num_rows, int64_t ffn,
                                Fp8Format fmt, bool blockwise, bool pow2_scales, DType dtype, cudaStream_t stream) {
  if (num_rows <= 0 || ffn <= 0) return cudaSuccess;
  const int eb = detail::elem_bytes(dtype);
  const bool vec = ffn % kPerLane == 0 && aligned(h, kPerLane * eb) && aligned(data, kPerLane);
  return launch_quantize(dtype, vec, fmt, blockwise, pow2_scales, data, scale, num_rows, ffn, stream,
                         [&](auto tag, auto kv) {
                           using Tag = decltype(tag);
                           return SwigluSource<Tag, decltype(kv)::value>{static_cast<const St<Tag>*>(h), w, ffn};
                         });
}

}  // namespace lightning_moe
