// Value types of the ops: float, double, and two 16-bit storage types computed in float.
//
// bfloat16 and float16 hold the bit patterns of torch.bfloat16 and torch.float16 (IEEE binary16),
// so tensors of those dtypes are passed by pointer as they are. Every kernel reads them, converts
// to its accumulation type (float for both), and rounds the result back to nearest-even once, at
// the store (the one exception: the opt-in coo_atomic kernel, whose 16-bit atomicAdd rounds every
// partial sum). The conversions are written out here so that the CPU and CUDA code round the same
// way: the bfloat16 ones are the same integer arithmetic on both, float16 uses the hardware
// conversion instructions on the GPU. Only NaN payloads may differ between the two (the GPU's
// float16 conversion returns its canonical NaN).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define SNACK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SNACK_HOST_DEVICE inline
#endif

namespace snack {

/// bfloat16: 1 sign, 8 exponent, 7 mantissa bits (the upper half of a float).
struct bfloat16 {
  uint16_t bits;
};
/// float16: IEEE binary16, 1 sign, 5 exponent, 10 mantissa bits.
struct float16 {
  uint16_t bits;
};

template <typename T>
inline constexpr bool kIsHalfType = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

namespace detail {
// The bits of `from` read as a To of the same size (memcpy: compiles to a register move).
template <typename To, typename From>
SNACK_HOST_DEVICE To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}
}  // namespace detail

SNACK_HOST_DEVICE float to_float(bfloat16 v) { return detail::bit_cast<float>(uint32_t(v.bits) << 16); }

/// Rounds to the nearest bfloat16, ties to even; NaN stays NaN (quiet).
SNACK_HOST_DEVICE bfloat16 to_bfloat16(float f) {
  uint32_t u = detail::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{uint16_t((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{uint16_t(u >> 16)};
}

SNACK_HOST_DEVICE float to_float(float16 v) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return detail::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return detail::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

/// Rounds to the nearest float16, ties to even; overflow gives infinity, NaN stays NaN (quiet).
SNACK_HOST_DEVICE float16 to_float16(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return float16{h};
#else
  const uint32_t u = detail::bit_cast<uint32_t>(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return float16{uint16_t(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
  if (magnitude >= 0x477ff000u) return float16{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to infinity
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal (or zero) of mantissa round(|f| / 2^-24)
    const float scaled = detail::bit_cast<float>(magnitude) * 16777216.0f;  // exact: a power of two
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;  // may carry into the smallest normal: same bits
    return float16{uint16_t(sign | m)};
  }
  uint32_t rebased = magnitude - (112u << 23);  // exponent re-biased from 127 to 15
  rebased += 0xfffu + ((rebased >> 13) & 1u);   // ties to even on the 13 dropped bits
  return float16{uint16_t(sign | (rebased >> 13))};
#endif
}

/// Accumulation type: the type itself for float and double, float for the 16-bit types.
template <typename T>
struct Accum {
  using type = T;
};
template <>
struct Accum<bfloat16> {
  using type = float;
};
template <>
struct Accum<float16> {
  using type = float;
};
template <typename T>
using accum_t = typename Accum<T>::type;

SNACK_HOST_DEVICE float to_accum(float v) { return v; }
SNACK_HOST_DEVICE double to_accum(double v) { return v; }
SNACK_HOST_DEVICE float to_accum(bfloat16 v) { return to_float(v); }
SNACK_HOST_DEVICE float to_accum(float16 v) { return to_float(v); }

template <typename T>
SNACK_HOST_DEVICE T from_accum(accum_t<T> v) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(v);
  } else if constexpr (std::is_same_v<T, float16>) {
    return to_float16(v);
  } else {
    return v;
  }
}

}  // namespace snack
