// The numbers of FP8 quantization, shared by the kernels of fp8_quant.cu and a host program that
// checks them against torch (tests/unit/test_fp8_kernels_compile.py): the fp32 -> fp8 encoding, the
// scale of a unit from its absolute maximum, and one value's quantization. Plain C++ on the host,
// __host__ __device__ under nvcc; no CUDA or torch headers.
//
// They follow lightning_moe/ops/fp8/quantize.py step for step in fp32:
//   scale = max(amax / FP8_MAX, FLT_MIN) (IEEE division), 1 where amax == 0, optionally rounded up to a
//           power of two (kept when it already is one); NaN when the unit held a NaN or an infinity
//   code  = fp8(clamp(v / scale, -FP8_MAX, FP8_MAX)), round to nearest even; a NaN is 0x7f with the
//           value's sign (what torch's conversion writes).
// The encoding is integer arithmetic, not an sm_89 conversion instruction, so it builds for sm_80;
// the value is clamped first, so it never overflows.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define LMOE_HD __host__ __device__ __forceinline__
#else
#define LMOE_HD inline
#endif

namespace lightning_moe {
namespace fp8 {

// A format's constants: largest finite value, mantissa bits, exponent bias.
template <bool kE5M2> struct Fmt;
template <> struct Fmt<false> {  // float8_e4m3fn
  static constexpr float kMax = 448.0f;
  static constexpr int kMant = 3;
  static constexpr int kBias = 7;
};
template <> struct Fmt<true> {  // float8_e5m2
  static constexpr float kMax = 57344.0f;
  static constexpr int kMant = 2;
  static constexpr int kBias = 15;
};

LMOE_HD uint32_t bits_of(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
#endif
}

LMOE_HD float float_of(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
#endif
}

LMOE_HD float divide(float a, float b) {  // IEEE round-to-nearest division on both sides
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The fp8 code of v, round to nearest even. |v| <= kMax or NaN (the caller clamps).
template <bool kE5M2>
LMOE_HD uint32_t code(float v) {
  using F = Fmt<kE5M2>;
  const uint32_t bits = bits_of(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7fu;  // NaN
  // Below the smallest normal 2^(1 - bias): multiples of 2^(1 - bias - mant), counted exactly by a
  // power-of-two scaling and rintf (ties to even); the count is the code (it reaches the smallest
  // normal's code when rounding carries into it).
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - F::kBias) << 23;
  if (mag < kMinNormalBits) {
    const float steps = rintf(float_of(mag) * static_cast<float>(1 << (F::kBias - 1 + F::kMant)));
    return sign | static_cast<uint32_t>(steps);
  }
  // Normal: drop 23 - mant mantissa bits with round-half-even (the carry may bump the exponent),
  // then rebias the exponent.
  constexpr int kDrop = 23 - F::kMant;
  const uint32_t rounded = mag + ((1u << (kDrop - 1)) - 1u) + ((mag >> kDrop) & 1u);
  return sign | ((rounded >> kDrop) - (static_cast<uint32_t>(127 - F::kBias) << F::kMant));
}

// amax -> dequantization scale (nonfinite: the unit held a NaN or an infinity).
template <bool kE5M2>
LMOE_HD float unit_scale(float amax, bool nonfinite, bool pow2) {
  if (nonfinite) return float_of(0x7fc00000u);  // NaN
  if (amax == 0.0f) return 1.0f;
  float s = fmaxf(divide(amax, Fmt<kE5M2>::kMax), FLT_MIN);
  if (pow2) {
    // Round up to a power of two: a positive normal with a non-zero mantissa goes to the next power.
    const uint32_t b = bits_of(s);
    if ((b & 0x007fffffu) != 0u) s = float_of((b & 0x7f800000u) + 0x00800000u);
  }
  return s;
}

// The code of v in a unit of dequantization scale `scale`.
template <bool kE5M2>
LMOE_HD uint32_t quantize_value(float v, float scale) {
  float q = divide(v, scale);
  if (!(q != q)) q = fminf(fmaxf(q, -Fmt<kE5M2>::kMax), Fmt<kE5M2>::kMax);  // NaN passes unclamped
  return code<kE5M2>(q);
}

}  // namespace fp8
}  // namespace lightning_moe

#undef LMOE_HD
