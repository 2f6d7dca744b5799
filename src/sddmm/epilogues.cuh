// What the SDDMM kernels do with a slot's gradient: store it, or apply AdamW's step with it.
#pragma once

#include <cuda_runtime.h>

#include "../device/cuda_utils.cuh"
#include "snack/optimizer_math.h"

namespace snack::cuda {
namespace {

// What the SDDMM kernels do with a slot's gradient g (float accumulation): store it (sddmm), or
// apply AdamW's step to the slot's value with it at once (sddmm_adamw), so that the gradient never
// goes to memory. fetch(e) loads what apply(e, g, fetched) needs; the kernels issue it before they
// compute g, so its loads overlap the products; prefetch_l2(begin, end) asks L2 for what fetch()
// will read of a run of slots, for kernels that know their runs ahead. apply_rounded() takes a
// gradient already rounded to T, and apply8_rounded() eight consecutive ones at once where
// stores_vectors() allows (the tensor-core kernel, whose tile holds T). begin() runs once per thread
// after the kernel has waited for the grids before it.
template <typename T>
struct StoreGradient {
  static constexpr bool kUpdatesState = false;  // apply() writes only the gradient
  T* __restrict__ dvalues;
  struct Fetched {};
  float* count() const { return nullptr; }  // no step count to advance
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Fetched fetch(int64_t) const { return {}; }
  __device__ __forceinline__ void prefetch_l2(int64_t, int64_t) const {}  // nothing is read
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched) const { dvalues[e] = from_accum<T>(g); }
  // apply() for a gradient already rounded to T.
  __device__ __forceinline__ void apply_rounded(int64_t e, T g, Fetched) const { dvalues[e] = g; }
  // The same store with its slots counted from `first`, for a kernel that holds a band's slots as
  // 32-bit offsets from its first (the tile view's entries): each store's address is then one 32-bit
  // multiply-add onto this pointer. The empty asm keeps the pointer whole (the optimiser would
  // otherwise fold each offset back into a 64-bit sum with `first`, two instructions more a slot), and
  // the assumption keeps its stores global ones.
  __device__ __forceinline__ StoreGradient from_slot(int64_t first) const {
    T* band = dvalues + first;
    asm("" : "+l"(band));
    __builtin_assume(__isGlobal(band));
    return {band};
  }
  // Whether apply8_rounded() may run: 16-bit gradients and dvalues on a 16-byte boundary.
  __device__ __forceinline__ bool stores_vectors() const {
    return sizeof(T) == 2 && (reinterpret_cast<uintptr_t>(dvalues) & 15) == 0;
  }
  // The gradients of slots [e, e + 8) (e a multiple of 8), rounded to 16-bit T and packed in pairs,
  // as one 16-byte store.
  __device__ __forceinline__ void apply8_rounded(int64_t e, uint4 packed) const {
    *reinterpret_cast<uint4*>(dvalues + e) = packed;
  }
};

// T: the operands' type, to which the gradient is rounded; P: the parameter's and its moments'
// (T, or float32 master values for 16-bit operands under mixed precision).
template <typename T, typename P = T>
struct AdamWUpdate {
  static constexpr bool kUpdatesState = true;  // apply() reads and writes each slot's value and moments
  using A = accum_t<P>;
  P* __restrict__ values;
  P* __restrict__ exp_avg;
  P* __restrict__ exp_avg_sq;
  float* step;  // device memory: a replayed CUDA graph reads the current count
  AdamWConfig config;
  AdamWStep<A> constants;
  struct Fetched {
    P value, m, v;
  };
  float* count() const { return step; }  // advanced by one before the kernel that reads it
  __device__ __forceinline__ void begin() { constants = AdamWStep<A>::make(config, A(*step)); }
  __device__ __forceinline__ Fetched fetch(int64_t e) const { return {values[e], exp_avg[e], exp_avg_sq[e]}; }
  // What fetch() will read for slots [begin, end), requested into L2 ahead of time.
  __device__ __forceinline__ void prefetch_l2(int64_t begin, int64_t end) const {
    detail::prefetch_l2(values, begin * int64_t(sizeof(P)), end * int64_t(sizeof(P)));
    detail::prefetch_l2(exp_avg, begin * int64_t(sizeof(P)), end * int64_t(sizeof(P)));
    detail::prefetch_l2(exp_avg_sq, begin * int64_t(sizeof(P)), end * int64_t(sizeof(P)));
  }
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched f) const {
    // The gradient rounded to T first, as the update from a stored gradient would see it.
    apply_rounded(e, from_accum<T>(g), f);
  }
  // Whether apply8_rounded() may run: 16-bit gradients, each state array on a 16-byte boundary.
  __device__ __forceinline__ bool stores_vectors() const {
    return sizeof(T) == 2 && ((reinterpret_cast<uintptr_t>(values) | reinterpret_cast<uintptr_t>(exp_avg) |
                               reinterpret_cast<uintptr_t>(exp_avg_sq)) & 15) == 0;
  }
  // AdamW's step of slots [e, e + 8) (e a multiple of 8) from their gradients rounded to 16-bit T and
  // packed in pairs: each slot's arithmetic as apply_rounded(), the values and moments moved in
  // 16-byte vectors.
  __device__ __forceinline__ void apply8_rounded(int64_t e, uint4 packed) const {
    constexpr int kVectors = int(8 * sizeof(P) / 16);
    union Run {
      uint4 vectors[kVectors];
      P elements[8];
    };
    Run v, m, s;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      v.vectors[i] = reinterpret_cast<const uint4*>(values + e)[i];
      m.vectors[i] = reinterpret_cast<const uint4*>(exp_avg + e)[i];
      s.vectors[i] = reinterpret_cast<const uint4*>(exp_avg_sq + e)[i];
    }
    const uint32_t pairs[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      constants.apply_stored(T{uint16_t(pairs[j / 2] >> (16 * (j % 2)))}, v.elements[j], m.elements[j],
                             s.elements[j]);
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      reinterpret_cast<uint4*>(values + e)[i] = v.vectors[i];
      reinterpret_cast<uint4*>(exp_avg + e)[i] = m.vectors[i];
      reinterpret_cast<uint4*>(exp_avg_sq + e)[i] = s.vectors[i];
    }
  }
  // apply() for a gradient already rounded to T.
  __device__ __forceinline__ void apply_rounded(int64_t e, T g, Fetched f) const {
    constants.apply_stored(g, f.value, f.m, f.v);
    values[e] = f.value;
    exp_avg[e] = f.m;
    exp_avg_sq[e] = f.v;
  }
};

}  // namespace
}  // namespace snack::cuda
