// The wgmma SpMM (src/spmm/wgmma_kernel.cuh) on its own, for kernel work without the torch front end:
// `check` compares the product (bf16, CSR view, odd sizes, cluster splits) with a float32 loop over
// the same bf16 values; `time` also times it against cuBLAS bf16 on the dense twin (warm L2: CUDA
// events around 50 back-to-back calls, the second of two rounds), the tile lists' build included.
// bench/spmm.py --variants wgmma gives the cold-L2 figures of the library path. Not part of the build:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DSNACK_WGMMA_BUILT -Iinclude -Isrc \
//     -o wgmma_spmm bench/micro/wgmma_spmm.cu src/spmm/wgmma.cu -lcublas
//   ./wgmma_spmm check | time [M K N density]
#include <cublas_v2.h>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include <cstring>
#include <string>
#include "spmm/views.cuh"
#include "spmm/wgmma.h"

using namespace snack;
using namespace snack::cuda::detail;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void naive(const int32_t* ptr, const int32_t* idx, const bfloat16* vals, const bfloat16* x, int64_t n, int64_t K, int64_t M, float* y) {
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n * M) return;
  int64_t b = i / M, o = i % M;
  float s = 0;
  for (int e = ptr[o]; e < ptr[o + 1]; ++e) s += to_float(vals[e]) * to_float(x[b * K + idx[e]]);
  y[i] = s;
}
__global__ void densify(const int32_t* ptr, const int32_t* idx, const bfloat16* vals, int64_t M, int64_t K, bfloat16* w) {
  int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (o >= M) return;
  for (int e = ptr[o]; e < ptr[o + 1]; ++e) w[o * K + idx[e]] = vals[e];
}
static uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
static float b2f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; memcpy(&f, &u, 4); return f; }

int main(int argc, char** argv) {
  struct Case { int64_t M, K, n; double density; int splits; bool time; };
  if ((argc != 2 && argc != 6) || (std::string(argv[1]) != "check" && std::string(argv[1]) != "time")) {
    printf("usage: %s check | time [M K N density]\n", argv[0]);
    return 2;
  }
  std::vector<Case> cases = {{256, 128, 128, 0.5, 1, false}, {1000, 776, 200, 0.1, 1, false}, {1000, 776, 200, 0.3, 2, false},
                             {3072, 768, 1024, 0.1, 1, false}, {768, 3072, 512, 0.1, 4, false}, {128, 64, 1, 1.0, 1, false},
                             {300, 2048, 130, 0.05, 8, false},
                             {3072, 768, 512, 0.1, 1, true}, {3072, 768, 1024, 0.1, 1, true}, {768, 3072, 512, 0.1, 1, true},
                             {768, 3072, 512, 0.1, 4, true}, {768, 3072, 1024, 0.1, 2, true}, {2304, 768, 1024, 0.1, 1, true},
                             {4096, 4096, 1024, 0.1, 1, true}, {4096, 4096, 4096, 0.1, 1, true}, {4096, 4096, 1024, 0.2, 1, true},
                             {4096, 4096, 1024, 0.05, 1, true}, {4096, 4096, 8192, 0.1, 1, true}, {3072, 768, 1024, 0.2, 1, true}};
  cublasHandle_t h; cublasCreate(&h);
  std::mt19937 rng(1);
  int fails = 0;
  if (argc == 6) cases = {{atol(argv[2]), atol(argv[3]), atol(argv[4]), atof(argv[5]), 1, true}};
  const bool quick = std::string(argv[1]) == "check";
  for (auto c : cases) {
    if (quick && c.time) continue;
    std::vector<int32_t> ptr(c.M + 1, 0), idx; std::vector<uint16_t> vals;
    std::uniform_real_distribution<float> u(-1, 1), p(0, 1);
    for (int64_t o = 0; o < c.M; ++o) {
      for (int64_t k = 0; k < c.K; ++k) if (p(rng) < c.density) { idx.push_back(int32_t(k)); vals.push_back(f2b(u(rng))); }
      ptr[o + 1] = int32_t(idx.size());
    }
    std::vector<uint16_t> x(c.n * c.K); for (auto& v : x) v = f2b(u(rng));
    int32_t *dptr, *didx; bfloat16 *dvals, *dx, *dy, *dw; float* dref;
    CK(cudaMalloc(&dptr, ptr.size() * 4)); CK(cudaMalloc(&didx, std::max<size_t>(1, idx.size()) * 4)); CK(cudaMalloc(&dvals, std::max<size_t>(1, vals.size()) * 2));
    CK(cudaMalloc(&dx, x.size() * 2)); CK(cudaMalloc(&dy, c.n * c.M * 2)); CK(cudaMalloc(&dref, c.n * c.M * 4)); CK(cudaMalloc(&dw, c.M * c.K * 2));
    CK(cudaMemcpy(dptr, ptr.data(), ptr.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dvals, vals.data(), vals.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dy, 0xff, c.n * c.M * 2));
    CsrView<bfloat16, int32_t> view{dptr, didx, dvals};
    void* ws; CK(cudaMalloc(&ws, wgmma_workspace_bytes(c.M, c.K, idx.size())));
    const int64_t nnz = idx.size();
    Status st = launch_spmm_wgmma<bfloat16>(view, nnz, c.M, c.K, dx, c.n, (const bfloat16*)nullptr, dy, Activation::kNone, c.splits, ws, nullptr);
    if (!st.ok()) { printf("launch failed: %s\n", st.message().c_str()); return 1; }
    CK(cudaDeviceSynchronize());
    naive<<<(c.n * c.M + 255) / 256, 256>>>(dptr, didx, dvals, dx, c.n, c.K, c.M, dref);
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> y(c.n * c.M); std::vector<float> ref(c.n * c.M);
    CK(cudaMemcpy(y.data(), dy, y.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost));
    double maxerr = 0; int64_t bad = 0, first_bad = -1;
    for (size_t i = 0; i < y.size(); ++i) {
      double e = fabs(double(b2f(y[i])) - ref[i]) / (1.0 + fabs(ref[i]));
      if (!(e <= 1e-2)) { if (first_bad < 0) first_bad = i; ++bad; }
      if (e > maxerr || e != e) maxerr = e;
    }
    printf("M=%ld K=%ld n=%ld d=%.2f splits=%d: maxrel %.3g bad %ld", c.M, c.K, c.n, c.density, c.splits, maxerr, bad);
    if (bad) { printf(" first (b=%ld,o=%ld) got %g want %g", first_bad / c.M, first_bad % c.M, b2f(y[first_bad]), ref[first_bad]); ++fails; }
    if (c.time) {
      CK(cudaMemset(dw, 0, c.M * c.K * 2));
      densify<<<(c.M + 255) / 256, 256>>>(dptr, didx, dvals, c.M, c.K, dw);
      cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      float alpha = 1, beta = 0;
      auto gemm = [&] { cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, c.M, c.n, c.K, &alpha, dw, CUDA_R_16BF, c.K, dx, CUDA_R_16BF, c.K, &beta, dy, CUDA_R_16BF, c.M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT); };
      auto sp = [&] { (void)launch_spmm_wgmma<bfloat16>(view, nnz, c.M, c.K, dx, c.n, (const bfloat16*)nullptr, dy, Activation::kNone, c.splits, ws, nullptr); };
      float tg = 0, ts = 0;
      for (int rep = 0; rep < 2; ++rep) {
        for (int i = 0; i < 5; ++i) { gemm(); sp(); }
        cudaEventRecord(a); for (int i = 0; i < 50; ++i) gemm(); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&tg, a, b);
        cudaEventRecord(a); for (int i = 0; i < 50; ++i) sp(); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ts, a, b);
      }
      CK(cudaGetLastError());
      double flops = 2.0 * c.M * c.K * c.n;
      printf("  | cublas %.1f us (%.0f TF)  wgmma %.1f us (%.0f TF dense-eq)  ratio dense/sparse %.2f", tg * 20, flops / (tg * 20e-6) / 1e12, ts * 20, flops / (ts * 20e-6) / 1e12, tg / ts);
    }
    printf("\n");
    cudaFree(dptr); cudaFree(didx); cudaFree(dvals); cudaFree(dx); cudaFree(dy); cudaFree(dref); cudaFree(dw); cudaFree(ws);
  }
  printf("%s\n", fails ? "FAILURES" : "ALL OK");
  return fails != 0;
}
