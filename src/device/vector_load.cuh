// Wide loads of values and indices, widened to the accumulation type, wide stores of runs of
// values, and the fixed-order dot product the kernels share.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "cuda_utils.cuh"

namespace snack::cuda::detail {

// The two 16-bit values of a 32-bit word (the lower address in the low half), widened.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t word, accum_t<T>& first, accum_t<T>& second) {
  first = to_accum(T{uint16_t(word & 0xffffu)});
  second = to_accum(T{uint16_t(word >> 16)});
}

// Reads V consecutive elements, widened: 16-byte vectors where V allows (8- and 4-byte ones for fewer
// 16-bit values); the caller guarantees alignment. kShared: p points to shared memory (plain loads),
// else to global memory (read-only loads).
template <typename T, int V, bool kShared = false>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, accum_t<T> (&out)[V]) {
  const auto ld = [](const auto* q) {
    if constexpr (kShared) {
      return *q;
    } else {
      return __ldg(q);
    }
  };
  if constexpr (std::is_same_v<T, float> && V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 q = ld(reinterpret_cast<const float4*>(p + j));
      out[j] = q.x; out[j + 1] = q.y; out[j + 2] = q.z; out[j + 3] = q.w;
    }
  } else if constexpr (std::is_same_v<T, float> && V == 2) {
    const float2 q = ld(reinterpret_cast<const float2*>(p));
    out[0] = q.x; out[1] = q.y;
  } else if constexpr (std::is_same_v<T, double> && V % 2 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const double2 q = ld(reinterpret_cast<const double2*>(p + j));
      out[j] = q.x; out[j + 1] = q.y;
    }
  } else if constexpr (kIsHalfType<T> && V % 8 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 8) {
      const uint4 q = ld(reinterpret_cast<const uint4*>(p + j));
      unpack_pair<T>(q.x, out[j], out[j + 1]);
      unpack_pair<T>(q.y, out[j + 2], out[j + 3]);
      unpack_pair<T>(q.z, out[j + 4], out[j + 5]);
      unpack_pair<T>(q.w, out[j + 6], out[j + 7]);
    }
  } else if constexpr (kIsHalfType<T> && V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const uint2 q = ld(reinterpret_cast<const uint2*>(p + j));
      unpack_pair<T>(q.x, out[j], out[j + 1]);
      unpack_pair<T>(q.y, out[j + 2], out[j + 3]);
    }
  } else if constexpr (kIsHalfType<T> && V == 2) {
    unpack_pair<T>(ld(reinterpret_cast<const unsigned*>(p)), out[0], out[1]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if constexpr (kShared) {
        out[j] = to_accum(p[j]);
      } else {
        out[j] = to_accum(load_ro(p + j));
      }
    }
  }
}

// kWords consecutive 32-bit words from global memory, read-only, as 16-byte vectors (p 16-byte aligned).
template <int kWords>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[kWords]) {
  static_assert(kWords % 4 == 0, "whole 16-byte vectors");
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < kWords / 4; ++i) {
    const uint4 v = __ldg(q + i);
    w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
  }
}

// Element u of the 16- or 32-bit integers (or raw 16-bit values) packed into words, the lower address
// in the low half.
template <typename Elem, int kWords>
__device__ __forceinline__ uint32_t packed_element(const uint32_t (&w)[kWords], int u) {
  if constexpr (sizeof(Elem) == 2) {
    return (w[u / 2] >> (16 * (u & 1))) & 0xffffu;
  } else {
    return w[u];
  }
}

// Stores element u (the low 16 or all 32 bits of `bits`) into words packed as packed_element reads
// them; the words start cleared.
template <typename Elem, int kWords>
__device__ __forceinline__ void packed_insert(uint32_t (&w)[kWords], int u, uint32_t bits) {
  if constexpr (sizeof(Elem) == 2) {
    w[u / 2] |= bits << (16 * (u & 1));
  } else {
    w[u] = bits;
  }
}

// kN values of T as a vector load leaves them in registers: 32-bit words, 16-bit values two to a word
// (the lower address in the low half), an 8-byte value in two. A chunk of slots in flight then holds
// 16-bit values two to a register, and each is widened where it is used.
template <typename T, int kN>
struct PackedValues {
  static constexpr int kWords = (kN * int(sizeof(T)) + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ accum_t<T> get(int u) const {
    if constexpr (sizeof(T) == 2) {
      return to_accum(T{uint16_t(packed_element<T>(w, u))});
    } else if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[u]);
    } else {
      return __hiloint2double(int(w[2 * u + 1]), int(w[2 * u]));
    }
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  // Value u, into words cleared before.
  __device__ __forceinline__ void set(int u, T v) {
    if constexpr (sizeof(T) == 2) {
      packed_insert<T>(w, u, v.bits);
    } else if constexpr (sizeof(T) == 4) {
      packed_insert<T>(w, u, __float_as_uint(v));
    } else {
      w[2 * u] = uint32_t(__double2loint(v));
      w[2 * u + 1] = uint32_t(__double2hiint(v));
    }
  }
};

// Stores kN values of T (to global or shared memory; p aligned to 16 bytes or to the whole run) as
// 16-, 8- or 4-byte vectors where they fill one.
template <typename T, int kN>
__device__ __forceinline__ void store_run(T* p, const T (&v)[kN]) {
  constexpr int kBytes = kN * int(sizeof(T));
  if constexpr (kBytes % 16 == 0 || kBytes == 8 || kBytes == 4) {
    constexpr int kWords = kBytes / 4;
    uint32_t w[kWords];
    memcpy(w, v, kBytes);  // a register move
    if constexpr (kBytes % 16 == 0) {
#pragma unroll
      for (int q = 0; q < kWords; q += 4) reinterpret_cast<uint4*>(p)[q / 4] = make_uint4(w[q], w[q + 1], w[q + 2], w[q + 3]);
    } else if constexpr (kBytes == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else {
      *reinterpret_cast<uint32_t*>(p) = w[0];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j) p[j] = v[j];
  }
}

// a[0] b[0] + a[1] b[1] + a[2] b[2] + a[3] b[3] as one fixed chain of fused multiply-adds, so that
// kernels sharing it round alike whatever the compiler would contract.
template <typename A>
__device__ __forceinline__ A dot4(const A (&a)[4], const A (&b)[4]) {
  if constexpr (std::is_same_v<A, double>) {
    return __fma_rn(a[3], b[3], __fma_rn(a[2], b[2], __fma_rn(a[1], b[1], __dmul_rn(a[0], b[0]))));
  } else {
    return __fmaf_rn(a[3], b[3], __fmaf_rn(a[2], b[2], __fmaf_rn(a[1], b[1], __fmul_rn(a[0], b[0]))));
  }
}

}  // namespace snack::cuda::detail
