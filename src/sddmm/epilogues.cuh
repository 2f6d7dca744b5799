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
// compute g, so its loads overlap the products. begin() runs once per thread after the kernel has
// waited for the grids before it.
template <typename T>
struct StoreGradient {
  static constexpr bool kUpdatesState = false;  // apply() writes only the gradient
  T* __restrict__ dvalues;
  struct Fetched {};
  float* count() const { return nullptr; }  // no step count to advance
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Fetched fetch(int64_t) const { return {}; }
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched) const { dvalues[e] = from_accum<T>(g); }
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
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched f) const {
    // The gradient rounded to T first, as the update from a stored gradient would see it.
    constants.apply_stored(from_accum<T>(g), f.value, f.m, f.v);
    values[e] = f.value;
    exp_avg[e] = f.m;
    exp_avg_sq[e] = f.v;
  }
};

}  // namespace
}  // namespace snack::cuda
