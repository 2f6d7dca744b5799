// What the stand-alone microbenchmarks share: a checked CUDA call, and the median time of a launch
// with a cold L2 (a 256 MiB memset before each call, optionally the GPU held busy after it so that the
// host's launch of the timed work is not counted, as bench/spmm.py times).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                               \
  do {                                                                                            \
    cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// Keeps the GPU busy for `cycles` clock cycles.
__global__ void hold_gpu_cycles(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

class ColdL2Timer {
 public:
  ColdL2Timer() {
    CHECK(cudaMalloc(&flush_, kFlushBytes));
    CHECK(cudaEventCreate(&t0_));
    CHECK(cudaEventCreate(&t1_));
  }
  ~ColdL2Timer() {
    cudaFree(flush_);
    cudaEventDestroy(t0_);
    cudaEventDestroy(t1_);
  }
  ColdL2Timer(const ColdL2Timer&) = delete;
  ColdL2Timer& operator=(const ColdL2Timer&) = delete;

  // Median microseconds of `launch` over `reps` calls after `warmup` untimed ones, each after an L2
  // flush and then `hold_cycles` of a busy GPU (0: none).
  template <typename Launch>
  float median_us(Launch&& launch, int reps, int warmup, long long hold_cycles) {
    std::vector<float> us;
    for (int rep = 0; rep < warmup + reps; ++rep) {
      CHECK(cudaMemsetAsync(flush_, rep, kFlushBytes));
      if (hold_cycles > 0) hold_gpu_cycles<<<1, 1>>>(hold_cycles);
      CHECK(cudaEventRecord(t0_));
      launch();
      CHECK(cudaEventRecord(t1_));
      CHECK(cudaEventSynchronize(t1_));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, t0_, t1_));
      if (rep >= warmup) us.push_back(ms * 1000.f);
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }

 private:
  static constexpr size_t kFlushBytes = size_t(256) << 20;
  char* flush_ = nullptr;
  cudaEvent_t t0_{}, t1_{};
};
