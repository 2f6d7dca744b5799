// Microbenchmark: the read bandwidth of an 80 MiB array streamed (a) through a shared-memory ring
// by cp.async.bulk (one thread issues, all threads wait on mbarriers, a block barrier per stage, as
// the `stream` SpMM kernel did: docs/kernels.md, "Measured and not kept"), (b) by plain 16-byte
// loads; no compute. L2 is flushed before each run (a 256 MiB memset); CUDA events around one launch, best of
// 10 (launch overhead included). Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -o ring_read bench/micro/ring_read.cu && ./ring_read
// Its H200 figures are quoted in docs/kernels.md (`stream`: the ring streams 2.66-2.84 TB/s).
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ uint32_t sa(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
template <int STAGES, int CHUNK>
__global__ void __launch_bounds__(256) ring(const char* src, int64_t bytes, float* sink) {
  extern __shared__ __align__(16) char buf[];
  __shared__ __align__(8) uint64_t bar[STAGES];
  const int64_t share = bytes / gridDim.x / 16 * 16, lo = blockIdx.x * share;
  const int stages = int(share / CHUNK);
  auto issue = [&](int k) {
    const int b = k % STAGES;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar[b])), "r"(CHUNK) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(buf + b * CHUNK)), "l"(src + lo + int64_t(k) * CHUNK), "r"(CHUNK), "r"(sa(&bar[b])) : "memory");
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int k = 0; k < stages && k < STAGES; ++k) issue(k);
  }
  __syncthreads();
  float acc = 0;
  for (int k = 0; k < stages; ++k) {
    const int b = k % STAGES;
    const uint32_t par = (k / STAGES) & 1;
    asm volatile("{\n .reg .pred d;\nW_%=:\n mbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n @!d bra W_%=;\n}" ::"r"(sa(&bar[b])), "r"(par) : "memory");
    acc += reinterpret_cast<const float*>(buf + b * CHUNK)[threadIdx.x * (CHUNK / 4 / 256)];
    __syncthreads();
    if (threadIdx.x == 0 && k + STAGES < stages) issue(k + STAGES);
  }
  if (acc == 12345.f) sink[0] = acc;
}
__global__ void __launch_bounds__(256) plain(const float4* src, int64_t n4, float* sink) {
  float acc = 0;
  for (int64_t i = blockIdx.x * 256LL + threadIdx.x; i < n4; i += int64_t(gridDim.x) * 256) { float4 v = __ldg(src + i); acc += v.x + v.w; }
  if (acc == 12345.f) sink[0] = acc;
}
int main() {
  const int64_t bytes = 80LL << 20;
  char* src; float* sink; char* flush;
  cudaMalloc(&src, bytes); cudaMalloc(&sink, 4); cudaMalloc(&flush, 256 << 20);
  cudaMemset(src, 1, bytes);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto time = [&](auto launch) {
    float best = 1e9, sum = 0;
    for (int r = 0; r < 10; ++r) {
      cudaMemsetAsync(flush, r, 256 << 20);
      cudaEventRecord(a); launch(); cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); best = ms < best ? ms : best;
    }
    return bytes / (best * 1e-3) / 1e9;
  };
#define RING(ST, CH, PER)                                                                                        \
  {                                                                                                            \
    auto k = ring<ST, CH>;                                                                                     \
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, ST * CH);                             \
    const int g = sms * PER;                                                                                   \
    double gbs = time([&] { k<<<g, 256, ST * CH>>>(src, bytes, sink); });                                      \
    printf("ring stages=%d chunk=%d blocks/SM=%d: %.0f GB/s (%s)\n", ST, CH, PER, gbs,                         \
           cudaGetErrorString(cudaGetLastError()));                                                            \
  }
  RING(4, 12288, 3) RING(4, 8192, 3) RING(4, 16384, 3) RING(8, 8192, 2) RING(4, 32768, 1) RING(8, 16384, 1)
  RING(2, 24576, 3) RING(4, 4096, 8) RING(6, 16384, 2)
  for (int per : {2, 4, 8, 16}) {
    double gbs = time([&] { plain<<<sms * per, 256>>>(reinterpret_cast<const float4*>(src), bytes / 16, sink); });
    printf("plain float4 loads, blocks/SM=%d: %.0f GB/s\n", per, gbs);
  }
  return 0;
}
