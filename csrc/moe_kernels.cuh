// lightning-moe CUDA kernels: launcher declarations (host C++) and shared device helpers.
//
// Legend (as in lightning_moe/moe and lightning_moe/ops): T tokens, H hidden, F expert FFN width,
// E experts, K top-k slots per token, N = T*K slots, R rows after permutation, S source rows.
// Every row index is int32; a row index of -1 means "dropped / none".
//
// Split of responsibilities:
//   * permute.cu, swiglu.cu, routing.cu hold the kernels and the launchers declared below. They
//     include only CUDA headers, so they compile with a bare nvcc (the CPU torch wheel ships no
//     CUDA headers; tests/unit/test_csrc_compiles.py compiles them on the CPU dev machine).
//   * bindings.cpp is the only file that sees torch: it validates tensors and calls these
//     launchers on the current stream. This header is therefore included by a host-only C++
//     compiler too, so everything device-side sits behind `#ifdef __CUDACC__`.
//
// Launcher contract: raw pointers to contiguous row-major buffers, element counts as int64,
// a DType for the floating tensors (index tensors are int32, weights/scales are fp32), and a
// stream. Launchers never allocate and never synchronise; they return cudaGetLastError() so
// a bad launch configuration surfaces at the call site. Zero-sized problems launch nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <cuda_runtime_api.h>

namespace lightning_moe {

// Element type of the activation tensors. The values are part of no ABI; bindings.cpp maps
// at::ScalarType onto them.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ---------------------------------------------------------------------------------------------
// permute.cu

// out[r, :] = x[src_idx[r], :] * (row_scale ? row_scale[r] : 1) for r < R; src_idx[r] < 0 gives a
// zero row (padding). x: [S, H], out: [R, H], same dtype. Requires src_idx[r] < S.
cudaError_t permute_rows(const void* x, const int32_t* src_idx, const float* row_scale, void* out,
                         int64_t num_rows, int64_t num_src_rows, int64_t hidden, DType dtype,
                         cudaStream_t stream);

// out[slot_row[t, k], :] = x[t, :] for every slot_row >= 0: permute_rows' result (unscaled) when
// every row r < R is the destination of exactly one slot; rows no slot names are left unwritten.
// Reads each of x's rows once. x: [T, H], slot_row: [T, K] (entries < R or -1), out: [R, H].
cudaError_t scatter_rows(const void* x, const int32_t* slot_row, void* out, int64_t num_tokens,
                         int64_t top_k, int64_t num_rows, int64_t hidden, DType dtype, cudaStream_t stream);

// out[t, :] = sum_k w[t, k] * y[slot_row[t, k], :] over k with slot_row >= 0 (w = 1 when null).
// Accumulates in fp32, in increasing k (deterministic, no atomics); all -1 gives a zero row.
// y: [R, H], slot_row: [T, K], w: [T, K] fp32 or null, out: [T, H].
cudaError_t unpermute_sum(const void* y, const int32_t* slot_row, const float* w, void* out,
                          int64_t num_tokens, int64_t top_k, int64_t hidden, DType dtype,
                          cudaStream_t stream);

// grad_w[t, k] = <grad_out[t, :], y[slot_row[t, k], :]> in fp32 (0 where slot_row is -1).
// grad_out: [T, H], y: [R, H] (same dtype), slot_row: [T, K], grad_w: [T, K] fp32.
cudaError_t unpermute_weight_grad(const void* grad_out, const void* y, const int32_t* slot_row,
                                  float* grad_w, int64_t num_tokens, int64_t top_k, int64_t hidden,
                                  DType dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// swiglu.cu

// a[r, f] = silu(h[r, f]) * h[r, F + f] * (w ? w[r] : 1); fp32 math, output in h's dtype.
// h: [R, 2F], w: [R] fp32 or null, a: [R, F].
cudaError_t weighted_swiglu_fwd(const void* h, const float* w, void* a, int64_t num_rows,
                                int64_t ffn, DType dtype, cudaStream_t stream);

// grad_h[r, f]     = grad_a * w * up * silu'(gate)
// grad_h[r, F + f] = grad_a * w * silu(gate)
// grad_w[r]        = sum_f grad_a * silu(gate) * up      (only when grad_w is non-null)
// h, grad_h: [R, 2F]; grad_a: [R, F] (same dtype as h); w, grad_w: [R] fp32 or null.
// The row sum has a fixed order for a given F (deterministic).
cudaError_t weighted_swiglu_bwd(const void* h, const float* w, const void* grad_a, void* grad_h,
                                float* grad_w, int64_t num_rows, int64_t ffn, DType dtype,
                                cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// rope.cu

// Rotary embedding of R head rows of width D = 2 * half (rows token-major: row r is token r / heads):
//   forward:  out = [x1 * c - x2 * s, x2 * c + x1 * s]
//   backward: out = [x1 * c + x2 * s, x2 * c - x1 * s]   (x holding the output's gradient)
// with c, s the fp32 row (r / heads) % table_rows of cos_t / sin_t [table_rows, half]; fp32 math,
// each product and sum rounded separately, one rounding to x's dtype at the store.
cudaError_t rope(const void* x, const float* cos_t, const float* sin_t, void* out, int64_t num_rows,
                 int64_t half, int64_t heads, int64_t table_rows, bool backward, DType dtype,
                 cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// cross_entropy.cu

// Per-row cross-entropy of logits x [T, V] (fp32/bf16/fp16) against int64 labels [T]:
// lse[t] = logsumexp(x[t]), loss[t] = lse[t] - x[t, label[t]] (0 if ignored, NaN if out of range).
cudaError_t cross_entropy_fwd(const void* x, const int64_t* labels, float* loss, float* lse, int64_t rows,
                              int64_t vocab, int64_t ignore_index, DType dtype, cudaStream_t stream);

// grad_x[t, v] = (exp(x[t, v] - lse[t]) - [v == label[t]]) * grad_loss[t], 0 for ignored rows.
cudaError_t cross_entropy_bwd(const void* x, const int64_t* labels, const float* lse, const float* grad_loss,
                              void* grad_x, int64_t rows, int64_t vocab, int64_t ignore_index, DType dtype,
                              cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// qk_norm_rope.cu

// Per-head RMSNorm (weight w [D]) then the rotary embedding of R rows of width D (64, 128, 192 or
// 256; rows token-major, row r reads table row (r / heads) % table_rows of cos_t/sin_t [P, D/2]).
// Forward writes y [R, D] and rstd [R] (fp32); backward writes dx [R, D] and dw_partial
// [qk_norm_rope_grid(R), D] (fp32 per-block sums of dw, to be summed over the first dim).
int qk_norm_rope_grid(int64_t rows);
cudaError_t qk_norm_rope_fwd(const void* x, const void* w, const float* cos_t, const float* sin_t, void* y,
                             float* rstd, int64_t rows, int64_t dim, int64_t heads, int64_t table_rows, float eps,
                             DType dtype, cudaStream_t stream);
cudaError_t qk_norm_rope_bwd(const void* x, const void* w, const float* cos_t, const float* sin_t,
                             const float* rstd, const void* g, void* dx, float* dw_partial, int64_t rows, int64_t dim,
                             int64_t heads, int64_t table_rows, DType dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// routing.cu

// Bytes of scratch that build_permutation needs for (num_slots = T*K, num_experts); 16-byte
// multiple, never 0. The caller allocates it (the torch caching allocator, in bindings.cpp).
size_t build_permutation_workspace_bytes(int64_t num_slots, int64_t num_experts);

// Stable counting sort of the N = T*K flattened slots s = t*K + k by expert id.
//   counts[e]  = slots routed to e;  offsets[e] = counts[0] + ... + counts[e] (inclusive)
//   rows of expert e are offsets[e]-counts[e] .. offsets[e]-1, in increasing s;
//   src_idx[r] = s / K (the token of row r); slot_row[t, k] = r.
// ids outside [0, E) are dropped: slot_row = -1 and no row; the N - offsets[E-1] unused tail
// rows of src_idx are set to -1. Deterministic (no order-dependent atomics).
// topk_ids: [T, K] int32 (ids_are_int64 = false) or int64; src_idx: [N]; slot_row: [T, K];
// counts, offsets: [E]; 1 <= E <= kMaxPermuteExperts.
constexpr int64_t kMaxPermuteExperts = 8192;
cudaError_t build_permutation(const void* topk_ids, bool ids_are_int64, int64_t num_tokens,
                              int64_t top_k, int64_t num_experts, int32_t* src_idx,
                              int32_t* slot_row, int32_t* counts, int32_t* offsets, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

enum class ScoreFunc : int { kSoftmax = 0, kSigmoid = 1 };

// Forward expert selection of a top-k router, one warp per token (see routing.cu for the exact
// semantics of each score function, the expert bias and group-limited routing).
// logits: [T, E] fp32; bias: [E] fp32 or null (selection only); outputs [T, K] int32 / fp32.
// Limits (checked by bindings.cpp): E <= kMaxRouterExperts, 1 <= K <= kMaxRouterTopK, and with
// num_groups > 0: num_groups <= 32, E % num_groups == 0, 1 <= group_topk <= num_groups,
// K >= group_topk and K <= group_topk * E / num_groups.
constexpr int64_t kMaxRouterExperts = 1024;
constexpr int64_t kMaxRouterTopK = 32;
constexpr int64_t kMaxRouterGroups = 32;
cudaError_t router_topk(const float* logits, const float* bias, int64_t num_tokens,
                        int64_t num_experts, int64_t top_k, ScoreFunc score_func, bool pre_softmax,
                        bool norm_topk_prob, float scaling_factor, int64_t num_groups,
                        int64_t group_topk, int64_t* topk_ids, float* topk_weights,
                        cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// router_gemm.cu

// logits[t, e] = sum_h x[t, h] * w[e, h] with fp32 accumulation and output (the router's GEMM).
// x: [T, H], w: [E, H], both bf16 or both fp16 (dtype), contiguous and 16-byte aligned;
// logits: [T, E] fp32. Requires H % 8 == 0; any T and E. tile_tokens: tokens a block (64 or 128;
// 0 = the default, 64).
cudaError_t router_logits(const void* x, const void* w, float* logits, int64_t num_tokens, int64_t hidden,
                          int64_t num_experts, DType dtype, int tile_tokens, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// fp8_quant.cu

// FP8 format of quantized rows: float8_e4m3fn or float8_e5m2 (one byte a value).
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

// Quantizes rows to FP8 with fp32 dequantization scales (x ~= data * scale), exactly as
// lightning_moe/ops/fp8/quantize.py does: per unit amax, scale = max(amax / FP8_MAX, FLT_MIN) (1 for
// amax == 0; rounded up to a power of two when pow2_scales), data = fp8(clamp(x / scale, +-FP8_MAX))
// with round to nearest even; a unit holding NaN or +-inf gets a NaN scale (and NaN data).
// Units: blockwise: 1 x 128 tiles along the row (the last one partial), scale [R, ceil(H / 128)];
// else one per row, scale [R, 1]. Row r reads x[src_idx[r]] (src_idx null: x[r]; negative: a row of
// zeros, scale 1). x: [S, H] (dtype), data: [R, H] fp8 bytes, scale row-major fp32. Requires
// src_idx[r] < S (S = num_src_rows; R when src_idx is null).
cudaError_t quantize_rows_fp8(const void* x, const int32_t* src_idx, void* data, float* scale, int64_t num_rows,
                              int64_t num_src_rows, int64_t hidden, Fp8Format fmt, bool blockwise, bool pow2_scales, DType dtype,
                              cudaStream_t stream);

// The weighted SwiGLU of h = [gate | up] (weighted_swiglu_fwd's values, rounded to h's dtype as it
// stores them) quantized like quantize_rows_fp8: data [R, F] fp8 bytes and scale [R, U] fp32 from
// h: [R, 2F] (dtype) and w: [R] fp32 or null.
cudaError_t swiglu_quantize_fp8(const void* h, const float* w, void* data, float* scale, int64_t num_rows, int64_t ffn,
                                Fp8Format fmt, bool blockwise, bool pow2_scales, DType dtype, cudaStream_t stream);

}  // namespace lightning_moe

// =============================================================================================
// Device-side helpers shared by the .cu files (invisible to the host-only bindings compile).
#ifdef __CUDACC__

namespace lightning_moe {
namespace detail {

constexpr int kThreads = 256;  // every elementwise kernel: 8 warps, 8 blocks fill an SM
// Second __launch_bounds__ argument (register cap 64 at 256 threads). With the first argument
// alone ptxas -v showed ptxas squeezing some row kernels into 32 registers and spilling 4-8
// bytes; at least 4 resident blocks (half occupancy) is plenty for these bandwidth-bound loops.
constexpr int kMinBlocks = 4;

// Element tags. Storage is a plain trivially-copyable type (float or the 16-bit pattern), not
// __nv_bfloat16 / __half: torch compiles .cu files with __CUDA_NO_{HALF,BFLOAT16}_CONVERSIONS__,
// and raw patterns never depend on those types' operators. Conversions round to nearest even,
// like torch's `.to(dtype)`, and use the sm_80+ paired instructions (two values per 32-bit
// register) so that converted rows are stored as full 16-byte vectors, not 2-byte pieces.
struct F32 {
  using storage = float;
};
struct BF16 {
  using storage = uint16_t;
  // bf16 is the top half of an fp32: widening is a shift (exact).
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  static __device__ __forceinline__ float one(uint16_t v) { return lo(v); }
  static __device__ __forceinline__ uint32_t pack2(float l, float h) {
    uint32_t d;  // PTX puts the first source in the upper half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(h), "f"(l));
    return d;
  }
  static __device__ __forceinline__ uint16_t pack1(float v) {
    uint16_t d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(v));
    return d;
  }
};
struct F16 {
  using storage = uint16_t;
  static __device__ __forceinline__ float one(uint16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
  static __device__ __forceinline__ float lo(uint32_t w) { return one(static_cast<uint16_t>(w)); }
  static __device__ __forceinline__ float hi(uint32_t w) { return one(static_cast<uint16_t>(w >> 16)); }
  static __device__ __forceinline__ uint32_t pack2(float l, float h) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(h), "f"(l));
    return d;
  }
  static __device__ __forceinline__ uint16_t pack1(float v) {
    uint16_t d;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(d) : "f"(v));
    return d;
  }
};

// One memory transaction of kBytes: the widest type the hardware moves in one instruction.
template <int kBytes> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = uint32_t; };
template <> struct RawVec<2> { using type = uint16_t; };

// kN consecutive elements moved as one kN*sizeof(storage)-byte access (16 bytes = 8 x bf16 or
// 4 x fp32) and converted to / from kN fp32 registers. Element i of a word-sized pack lives in
// 32-bit word i / 2 (low half for even i) for 16-bit types, word i for fp32 (little endian).
template <typename Tag, int kN>
struct Vec {
  using storage = typename Tag::storage;
  static constexpr int kBytes = kN * static_cast<int>(sizeof(storage));
  using raw_t = typename RawVec<kBytes>::type;
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;

  // Words <-> raw by value (no union, which nvcc lowered through memory).
  static __device__ __forceinline__ void words(raw_t v, uint32_t (&w)[kWords]) {
    if constexpr (kBytes == 16) {
      w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (kBytes == 8) {
      w[0] = v.x; w[1] = v.y;
    } else {
      w[0] = v;
    }
  }
  static __device__ __forceinline__ raw_t from_words(const uint32_t (&w)[kWords]) {
    if constexpr (kBytes == 16) {
      return make_uint4(w[0], w[1], w[2], w[3]);
    } else if constexpr (kBytes == 8) {
      return make_uint2(w[0], w[1]);
    } else {
      return static_cast<raw_t>(w[0]);
    }
  }

  static __device__ __forceinline__ raw_t load(const storage* p) {
    return *reinterpret_cast<const raw_t*>(p);
  }
  static __device__ __forceinline__ void store(storage* p, raw_t v) {
    // __stwb is an ordinary (write-back) store; a plain `*p = v` of a uint4 assembled from
    // converted halves was emitted as four 4-byte stores.
    __stwb(reinterpret_cast<raw_t*>(p), v);
  }
  static __device__ __forceinline__ raw_t zero() { return raw_t{}; }

  static __device__ __forceinline__ void to_float(raw_t v, float (&f)[kN]) {
    if constexpr (sizeof(storage) == 2 && kN == 1) {
      f[0] = Tag::one(v);
    } else {
      uint32_t w[kWords];
      words(v, w);
      if constexpr (sizeof(storage) == 4) {
#pragma unroll
        for (int i = 0; i < kN; ++i) f[i] = __uint_as_float(w[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) {
          f[2 * i] = Tag::lo(w[i]);
          f[2 * i + 1] = Tag::hi(w[i]);
        }
      }
    }
  }

  static __device__ __forceinline__ raw_t from_float(const float (&f)[kN]) {
    if constexpr (sizeof(storage) == 2 && kN == 1) {
      return Tag::pack1(f[0]);
    } else {
      uint32_t w[kWords];
      if constexpr (sizeof(storage) == 4) {
#pragma unroll
        for (int i = 0; i < kN; ++i) w[i] = __float_as_uint(f[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) w[i] = Tag::pack2(f[2 * i], f[2 * i + 1]);
      }
      return from_words(w);
    }
  }

  static __device__ __forceinline__ void load_float(const storage* p, float (&f)[kN]) {
    to_float(load(p), f);
  }
  static __device__ __forceinline__ void store_float(storage* p, const float (&f)[kN]) {
    store(p, from_float(f));
  }
};

__device__ __forceinline__ float warp_sum(float v) {
  // xor butterfly: every lane ends with the same sum, in a fixed order (deterministic).
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Largest access (16, 8, 4 bytes, else one element) such that every row of every listed buffer
// starts on that boundary: each row pitch (in bytes) is a multiple of it and each base pointer
// is aligned to it. Rows whose pitch is not a
// multiple of 16 bytes (odd H, H % 8 != 0 in bf16) are not 16-byte aligned row by row, so a
// "vector body + scalar tail" split would still need misaligned vector loads; choosing the
// widest width that divides every pitch handles those shapes with no tail at all.
inline int pick_vec_bytes(int elem_bytes, std::initializer_list<int64_t> pitches_bytes,
                          std::initializer_list<const void*> ptrs) {
  for (int vb = 16; vb > elem_bytes; vb >>= 1) {
    bool ok = true;
    for (int64_t p : pitches_bytes) ok = ok && (p % vb == 0);
    for (const void* q : ptrs) ok = ok && (reinterpret_cast<uintptr_t>(q) % vb == 0);
    if (ok) return vb;
  }
  return elem_bytes;
}

// One element as fp32, and one fp32 stored rounded to the tag's dtype (Vec of width 1).
template <typename Tag>
__device__ __forceinline__ float load1(const typename Tag::storage* p) {
  float f[1];
  Vec<Tag, 1>::load_float(p, f);
  return f[0];
}

template <typename Tag>
__device__ __forceinline__ void store1(typename Tag::storage* p, float v) {
  const float f[1] = {v};
  Vec<Tag, 1>::store_float(p, f);
}

inline int elem_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// Blocks for a grid-stride loop over `work_blocks` blocks of work: at most `blocks_per_sm`
// resident blocks per SM (8 of 256 threads; 4 of 512), one wave; more blocks only add scheduling.
inline int grid_size(int64_t work_blocks, int blocks_per_sm = 8) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) sms = v;
  }
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  return static_cast<int>(work_blocks < cap ? (work_blocks > 0 ? work_blocks : 1) : cap);
}

// Threads per row (a power of two <= 256) for `vecs` vector accesses per row: small rows share
// a block (several rows per block) instead of idling most of it.
inline int threads_per_row_log2(int64_t vecs) {
  int l = 0;
  while (l < 8 && (int64_t{1} << l) < vecs) ++l;
  return l;
}

// Calls f(Tag{}) for the runtime dtype.
template <typename Fn>
cudaError_t dispatch_dtype(DType dt, Fn&& f) {
  switch (dt) {
    case DType::kFloat32: return f(F32{});
    case DType::kBFloat16: return f(BF16{});
    case DType::kFloat16: return f(F16{});
  }
  return cudaErrorInvalidValue;
}

template <int kV> struct IntTag { static constexpr int value = kV; };

// Calls f(IntTag<elements per access>{}) for a vector width in bytes picked by pick_vec_bytes.
template <typename Tag, typename Fn>
cudaError_t dispatch_vec(int vec_bytes, Fn&& f) {
  constexpr int kE = static_cast<int>(sizeof(typename Tag::storage));
  switch (vec_bytes) {
    case 16: return f(IntTag<16 / kE>{});
    case 8: return f(IntTag<8 / kE>{});
    case 4: return f(IntTag<(4 / kE > 0 ? 4 / kE : 1)>{});
    default: return f(IntTag<1>{});
  }
}

// Calls f(std::bool_constant<b>{}): a runtime flag becomes a kernel template argument, read
// back as decltype(flag)::value.
template <typename Fn>
void dispatch_bool(bool b, Fn&& f) {
  if (b) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Launch shape of the row kernels (permute.cu, swiglu.cu): a block of kThreads is cut into
// groups of 2^log2_threads_per_row threads, each owning one row per grid-stride step.
struct RowLaunch {
  int64_t vecs;              // kN-wide vectors per row
  int log2_threads_per_row;  // threads_per_row_log2(vecs)
  int grid;                  // blocks: one wave at most (grid_size)
};

// The same layout seen from inside a row kernel: this thread's group owns row first(), then every
// step() rows after it; the group's threads walk the row's vectors tpr apart, starting at lane.
// row_in(base) is the group's row in the step starting at base (for loops whose bound must stay
// uniform across the block).
struct RowGroups {
  int log2;
  int64_t tpr, lane, per_block;
  __device__ __forceinline__ explicit RowGroups(int tpr_log2)
      : log2(tpr_log2),
        tpr(int64_t{1} << tpr_log2),
        lane(threadIdx.x & ((int64_t{1} << tpr_log2) - 1)),
        per_block(kThreads >> tpr_log2) {}
  __device__ __forceinline__ int64_t first_base() const { return blockIdx.x * per_block; }
  __device__ __forceinline__ int64_t row_in(int64_t base) const { return base + (threadIdx.x >> log2); }
  __device__ __forceinline__ int64_t first() const { return row_in(first_base()); }
  __device__ __forceinline__ int64_t step() const { return static_cast<int64_t>(gridDim.x) * per_block; }
};

// Threads per row (log2) when each thread should own at least `m` of the row's `vecs` vectors:
// the power of two, at most vecs / m, that leaves the fewest idle lanes (ties: more threads).
// 96 vectors, m = 2: 32 threads, 3 vectors each (threads_per_row_log2 gives 128, 32 of them idle).
inline int threads_per_row_log2_at_least(int64_t vecs, int m) {
  if (m <= 1 || vecs < 2) return threads_per_row_log2(vecs);
  int best = 0;
  double best_use = 0.0;
  for (int l = 0; l <= 8 && (int64_t{1} << l) * m <= vecs; ++l) {
    const int64_t p = int64_t{1} << l;
    const double use = static_cast<double>(vecs) / static_cast<double>(p * ((vecs + p - 1) / p));
    if (use >= best_use) best = l, best_use = use;  // ties: more threads
  }
  return best;
}

inline RowLaunch row_launch(int64_t width, int kN, int64_t rows, int min_vecs_per_thread) {
  RowLaunch p;
  p.vecs = width / kN;
  p.log2_threads_per_row = threads_per_row_log2_at_least(p.vecs, min_vecs_per_thread);
  const int64_t rows_per_block = kThreads >> p.log2_threads_per_row;
  p.grid = grid_size((rows + rows_per_block - 1) / rows_per_block);
  return p;
}

// The row launchers' common part: dispatches dtype and vector width, then calls
// f(Tag{}, IntTag<kN>{}, row_launch(width, kN, rows, min_vecs_per_thread)), which launches, and returns
// cudaGetLastError(). `width` is the row length in elements, `rows` the number of rows;
// `min_vecs_per_thread` > 1 gives each thread several of a row's vectors (row_launch).
template <typename Fn>
cudaError_t launch_rows(DType dt, int vec_bytes, int64_t width, int64_t rows, Fn&& f, int min_vecs_per_thread = 1) {
  return dispatch_dtype(dt, [&](auto tag) {
    return dispatch_vec<decltype(tag)>(vec_bytes, [&](auto n) {
      f(tag, n, row_launch(width, decltype(n)::value, rows, min_vecs_per_thread));
      return cudaGetLastError();
    });
  });
}

}  // namespace detail
}  // namespace lightning_moe

#endif  // __CUDACC__
