// A tensor-core SpMM for small batches of bf16 values (tiles of 16 rows), measured and not kept (docs/kernels.md,
// "Measured and not kept"): one block of 16 warps per SM walks a contiguous run of bands of 8 output
// rows. A band's slots are one contiguous range of the CSR view, so the whole block streams them with
// 16-byte loads and scatters them into a zeroed 8 x K window in shared memory; each warp keeps its
// share of K of the batch tile of X (16 rows) in registers as mma.sync A fragments, loaded once, and
// multiplies it with the window (W as the B operand of m16n8k16, fp32 accumulators); the warps'
// partial tiles are summed in a fixed order. Three windows rotate, so that at step i the block
// scatters band i + 1, multiplies band i and zeroes band i - 1's window with one barrier per step;
// the block's slot range is prefetched into L2 when it starts. Correct (float64 reference on sampled
// rows, poisoned output, compute-sanitizer memcheck and racecheck clean) but no faster than the
// planner's kernels where it was meant to win.
//
// The benchmark times the kernel and cuBLAS bf16 (cold L2: a 256 MiB memset, then the GPU held 200000
// cycles so that the launch is not counted; CUDA events; median of 20). Not part of the build; K up
// to 4096 (the A fragments of 16 k-steps per warp):
//   nvcc -O3 -arch=sm_90 -std=c++17 -Iinclude -o band_spmm bench/micro/band_spmm.cu -lcublas
//   ./band_spmm M K density N [N ...]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "../../src/spmm/tensor_core_kernel.cuh"
#include "cold_l2_timer.cuh"

namespace snack::cuda::detail {

constexpr int kBandRows = 8;   // the n8 of m16n8k16: W is the B operand
constexpr int kBatchTile = 16; // the m16: X is the A operand
constexpr int kBandWarps = 16;
constexpr int kBandThreads = kBandWarps * 32;

__host__ __device__ constexpr int band_stride(int k) { return (k + 15) / 16 * 16 + 8; }  // 16 bytes of skew per row

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r0), "=r"(r1)
               : "r"(shared_address(smem)));
}

__device__ __forceinline__ uint16_t word_half(const uint4& v, int j) {
  const uint32_t w = j < 2 ? v.x : j < 4 ? v.y : j < 6 ? v.z : v.w;
  return uint16_t((j & 1) ? (w >> 16) : (w & 0xffffu));
}

// Writes the slots [e8, e8 + 8) inside [s0, s1) into the window, tracking each slot's band row
// (rp: the band's row offsets in shared memory): vectors at the band's ends or across short rows.
__device__ __forceinline__ void scatter8(uint16_t* window, int stride, const int32_t* rp, int32_t e8, int32_t s0,
                                         int32_t s1, const uint4& cols, const uint4& vals) {
  int r = 0;
  int32_t next = rp[1];
  while (e8 >= next && r < kBandRows - 1) next = rp[++r + 1];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int32_t e = e8 + j;
    if (e >= s0 && e < s1) {
      while (e >= next) next = rp[++r + 1];
      window[r * stride + word_half(cols, j)] = word_half(vals, j);
    }
  }
}

// Writes the slots [e8, e8 + 8) of the band (row offsets rp[0..8]) into the window. The common cases, a
// vector inside one row or across one row boundary, take no per-slot row search: the row is counted from
// the offsets at once, and each slot picks one of two row bases.
__device__ __forceinline__ void scatter_vector(uint16_t* window, int stride, const int32_t* rp, int32_t e8,
                                               const uint4& cols, const uint4& vals) {
  const int4 lo = *reinterpret_cast<const int4*>(rp), hi = *reinterpret_cast<const int4*>(rp + 4);
  const int r = (lo.y <= e8) + (lo.z <= e8) + (lo.w <= e8) + (hi.x <= e8) + (hi.y <= e8) + (hi.z <= e8) + (hi.w <= e8);
  const int32_t next = rp[r + 1], after = rp[min(r + 2, kBandRows)];
  if (e8 >= lo.x && e8 + 8 <= after) {
    uint16_t* row0 = window + r * stride;
    uint16_t* row1 = row0 + stride;
    const uint32_t c[4] = {cols.x, cols.y, cols.z, cols.w}, v[4] = {vals.x, vals.y, vals.z, vals.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint16_t* row = e8 + j < next ? row0 : row1;
      row[(c[j / 2] >> (16 * (j % 2))) & 0xffffu] = uint16_t(v[j / 2] >> (16 * (j % 2)));
    }
  } else {
    scatter8(window, stride, rp, e8, lo.x, rp[kBandRows], cols, vals);
  }
}

// Step i: band i + 1 scattered, band i multiplied, band i - 1's window zeroed and its partial tiles
// summed; band i + 2's first vector requested. One barrier per step.
constexpr int kMaxStepsPerWarp = 16;  // k-steps of 16 per warp: K <= 16 x 16 x kBandWarps = 4096
constexpr int kWindows = 3;

__host__ __device__ constexpr size_t band_smem_bytes(int k, int bands_per_block) {
  return sizeof(uint16_t) * kWindows * kBandRows * size_t(band_stride(k)) +
         sizeof(float) * 2 * kBandWarps * kBatchTile * kBandRows + sizeof(int32_t) * (bands_per_block * kBandRows + 1);
}

template <typename T>
__global__ void __launch_bounds__(kBandThreads, 1)
    band_spmm_kernel(const int32_t* __restrict__ row_ptr, const uint16_t* __restrict__ col_idx,
                     const uint16_t* __restrict__ values, const T* __restrict__ x, int n, int k, int m,
                     int bands_per_block, T* __restrict__ out) {
  static_assert(std::is_same_v<T, bfloat16>, "the products are bf16 (mma_16816<T>) and so are the stores");
  extern __shared__ __align__(16) unsigned char smem[];
  const int stride = band_stride(k);
  uint16_t* windows = reinterpret_cast<uint16_t*>(smem);  // [3][8][stride]
  float* partials = reinterpret_cast<float*>(windows + kWindows * kBandRows * stride);  // [2][warps][16 x 8]
  int32_t* rps = reinterpret_cast<int32_t*>(partials + 2 * kBandWarps * kBatchTile * kBandRows);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int bands = (m + kBandRows - 1) / kBandRows;
  const int b_begin = blockIdx.x * bands_per_block, b_end = min(bands, b_begin + bands_per_block);
  if (b_begin >= b_end) return;
  const int count = b_end - b_begin;
  const int64_t n0 = int64_t(blockIdx.y) * kBatchTile;

  // The block's slots, requested into L2 at once, so that the bands after the first few find them there.
  const int rows_here = count * kBandRows;
  for (int i = tid; i <= rows_here; i += kBandThreads) rps[i] = row_ptr[min(b_begin * kBandRows + i, m)];
  __syncthreads();
  if (tid == 0) prefetch_l2(col_idx, int64_t(rps[0]) * 2, int64_t(rps[rows_here]) * 2 + 16);
  if (tid == 32) prefetch_l2(values, int64_t(rps[0]) * 2, int64_t(rps[rows_here]) * 2 + 16);

  // The batch tile of X through the windows' memory ([16][stride], zeros past n and k), then each warp's
  // k-steps as A fragments in registers (ldmatrix), then the windows zeroed.
  uint16_t* xs = windows;
  const int segs = stride / 8;
  const uint16_t* xr = reinterpret_cast<const uint16_t*>(x);
  for (int s = tid; s < kBatchTile * segs; s += kBandThreads) {
    const int row = s / segs, col = (s % segs) * 8;
    const int64_t b = n0 + row;
    uint16_t* dst = xs + row * stride + col;
    if (b < n && col + 8 <= k && k % 8 == 0) {
      cp_async_16(dst, x + b * k + col, 16);
    } else {
      for (int j = 0; j < 8; ++j) dst[j] = b < n && col + j < k ? xr[b * k + col + j] : uint16_t(0);
    }
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  const int ksteps = (k + 15) / 16;
  const int ks_begin = ksteps * warp / kBandWarps, ks_count = ksteps * (warp + 1) / kBandWarps - ks_begin;
  uint32_t a[kMaxStepsPerWarp][4];
#pragma unroll
  for (int s = 0; s < kMaxStepsPerWarp; ++s) {
    if (s < ks_count) {
      ldmatrix_x4(a[s], xs + (lane % 16) * stride + (ks_begin + s) * 16 + (lane / 16) * 8);
    } else {
      a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0u;
    }
  }
  __syncthreads();
  for (int s = tid; s < kWindows * kBandRows * stride / 8; s += kBandThreads)
    reinterpret_cast<uint4*>(windows)[s] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  auto first_e8 = [&](int i) { return (rps[i * kBandRows] & ~7) + tid * 8; };
  auto load_first = [&](int i, uint4& cols, uint4& vals) {
    cols = vals = make_uint4(0, 0, 0, 0);
    if (i < count) {
      const int32_t e8 = first_e8(i);
      if (e8 < rps[(i + 1) * kBandRows]) {
        cols = __ldg(reinterpret_cast<const uint4*>(col_idx + e8));
        vals = __ldg(reinterpret_cast<const uint4*>(values + e8));
      }
    }
  };
  // Band i's slots into its window: the first vector from registers, the rest loaded here.
  auto write_band = [&](int i, const uint4& cols, const uint4& vals) {
    if (i < 0 || i >= count) return;
    const int32_t* rp = rps + i * kBandRows;
    const int32_t s1 = rp[kBandRows];
    uint16_t* window = windows + (i % kWindows) * kBandRows * stride;
    int32_t e8 = first_e8(i);
    if (e8 < s1) scatter_vector(window, stride, rp, e8, cols, vals);
    for (e8 += kBandThreads * 8; e8 < s1; e8 += kBandThreads * 8) {
      const uint4 c = __ldg(reinterpret_cast<const uint4*>(col_idx + e8));
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(values + e8));
      scatter_vector(window, stride, rp, e8, c, v);
    }
  };
  // Band i's window back to zeros, 16 bytes per store.
  auto zero_band = [&](int i) {
    uint4* window = reinterpret_cast<uint4*>(windows + (i % kWindows) * kBandRows * stride);
    for (int v = tid; v < kBandRows * stride / 8; v += kBandThreads) window[v] = make_uint4(0, 0, 0, 0);
  };

  uint4 cols_next, vals_next, cols_ahead, vals_ahead;
  load_first(0, cols_next, vals_next);
  load_first(1, cols_ahead, vals_ahead);
  write_band(0, cols_next, vals_next);
  cols_next = cols_ahead;
  vals_next = vals_ahead;
  __syncthreads();
  for (int i = 0; i <= count; ++i) {
    // cols_next / vals_next: band i + 1's first vector.
    write_band(i + 1, cols_next, vals_next);
    load_first(i + 2, cols_ahead, vals_ahead);
    if (i < count) {
      const uint16_t* window = windows + (i % kWindows) * kBandRows * stride;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const uint16_t* wb = window + (lane % 8) * stride + ks_begin * 16 + ((lane / 8) % 2) * 8;
      if (ks_count == kMaxStepsPerWarp) {
#pragma unroll
        for (int s = 0; s < kMaxStepsPerWarp; ++s) {
          uint32_t b0, b1;
          ldmatrix_x2(b0, b1, wb + s * 16);
          mma_16816<T>(acc[s % 2], a[s], b0, b1);
        }
      } else {
#pragma unroll
        for (int s = 0; s < kMaxStepsPerWarp; ++s) {
          if (s < ks_count) {
            uint32_t b0, b1;
            ldmatrix_x2(b0, b1, wb + s * 16);
            mma_16816<T>(acc[s % 2], a[s], b0, b1);
          }
        }
      }
      float* p = partials + ((i % 2) * kBandWarps + warp) * kBatchTile * kBandRows;
      p[g * kBandRows + 2 * t] = acc[0][0] + acc[1][0];
      p[g * kBandRows + 2 * t + 1] = acc[0][1] + acc[1][1];
      p[(g + 8) * kBandRows + 2 * t] = acc[0][2] + acc[1][2];
      p[(g + 8) * kBandRows + 2 * t + 1] = acc[0][3] + acc[1][3];
    }
    if (i >= 1) {
      zero_band(i - 1);
      // Band i - 1's output: four threads per element, each summing four warps, in a fixed order.
      const float* p = partials + ((i - 1) % 2) * kBandWarps * kBatchTile * kBandRows;
      const int e = tid / 4, q = tid % 4;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kBandWarps / 4; ++w) sum += p[(q * (kBandWarps / 4) + w) * kBatchTile * kBandRows + e];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int64_t b = n0 + e / kBandRows;
      const int o = (b_begin + i - 1) * kBandRows + e % kBandRows;
      if (q == 0 && b < n && o < m) out[b * m + o] = to_bfloat16(sum);
    }
    cols_next = cols_ahead;
    vals_next = vals_ahead;
    __syncthreads();
  }
}

}  // namespace snack::cuda::detail

using snack::cuda::detail::band_smem_bytes;
using snack::cuda::detail::band_spmm_kernel;
using snack::cuda::detail::kBandRows;
using snack::cuda::detail::kBandThreads;
using snack::cuda::detail::kBatchTile;

static float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s M K density N [N ...]\n", argv[0]);
    return 2;
  }
  const int m = std::atoi(argv[1]), k = std::atoi(argv[2]);
  const double density = std::atof(argv[3]);
  std::vector<int> ns;
  for (int i = 4; i < argc; ++i) ns.push_back(std::atoi(argv[i]));
  const int n_max = *std::max_element(ns.begin(), ns.end());
  if (k > 16 * 16 * snack::cuda::detail::kBandWarps) {
    std::fprintf(stderr, "K up to %d\n", 16 * 16 * snack::cuda::detail::kBandWarps);
    return 2;
  }

  // A uniform pattern: each position kept with probability `density`; rows sorted by column.
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> unit(0.f, 1.f), value(-1.f, 1.f);
  std::vector<int32_t> row_ptr(m + 1, 0);
  std::vector<uint16_t> cols, vals;
  std::vector<uint16_t> dense(size_t(m) * k, 0);
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < k; ++c)
      if (unit(rng) < density) {
        cols.push_back(uint16_t(c));
        const uint16_t v = float_to_bf16(value(rng));
        vals.push_back(v);
        dense[size_t(r) * k + c] = v;
      }
    row_ptr[r + 1] = int32_t(cols.size());
  }
  const int64_t nnz = int64_t(cols.size());
  // Room for the last vector: the kernel reads whole 16-byte vectors inside the slot arrays' allocation.
  cols.resize(nnz + 8, 0);
  vals.resize(nnz + 8, 0);
  std::vector<uint16_t> xh(size_t(n_max) * k);
  for (auto& v : xh) v = float_to_bf16(value(rng));

  int32_t* d_rp;
  uint16_t *d_cols, *d_vals, *d_x, *d_out, *d_dense, *d_dense_out;
  CHECK(cudaMalloc(&d_rp, sizeof(int32_t) * (m + 1)));
  CHECK(cudaMalloc(&d_cols, 2 * cols.size()));
  CHECK(cudaMalloc(&d_vals, 2 * vals.size()));
  CHECK(cudaMalloc(&d_x, 2 * xh.size()));
  CHECK(cudaMalloc(&d_out, 2 * size_t(n_max) * m));
  CHECK(cudaMalloc(&d_dense, 2 * dense.size()));
  CHECK(cudaMalloc(&d_dense_out, 2 * size_t(n_max) * m));
  CHECK(cudaMemcpy(d_rp, row_ptr.data(), sizeof(int32_t) * (m + 1), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_cols, cols.data(), 2 * cols.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_vals, vals.data(), 2 * vals.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_x, xh.data(), 2 * xh.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_dense, dense.data(), 2 * dense.size(), cudaMemcpyHostToDevice));

  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int bands = (m + kBandRows - 1) / kBandRows;
  const int bands_per_block = (bands + sms - 1) / sms;
  const int blocks = (bands + bands_per_block - 1) / bands_per_block;
  const size_t smem = band_smem_bytes(k, bands_per_block);
  CHECK(cudaFuncSetAttribute(band_spmm_kernel<snack::bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)));

  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    return 1;
  }
  // As bench/spmm.py times: the GPU held 200000 cycles after each flush; 5 warm-up calls, median of 20.
  ColdL2Timer timer;
  auto time_median = [&](auto&& launch) { return timer.median_us(launch, 20, 5, 200000); };

  std::printf("%dx%d density %.3f nnz %lld, %d blocks of %d bands, %zu bytes of shared memory\n", m, k, density,
              (long long)nnz, blocks, bands_per_block, smem);
  std::printf("| N | band us | cuBLAS us | vs cuBLAS | bytes at 4 TB/s, us | max rel err |\n|---|---|---|---|---|---|\n");
  for (int n : ns) {
    const int tiles = (n + kBatchTile - 1) / kBatchTile;
    auto launch = [&] {
      band_spmm_kernel<snack::bfloat16><<<dim3(blocks, tiles), kBandThreads, smem>>>(
          d_rp, d_cols, d_vals, reinterpret_cast<const snack::bfloat16*>(d_x), n, k, m, bands_per_block,
          reinterpret_cast<snack::bfloat16*>(d_out));
    };
    CHECK(cudaMemset(d_out, 0xff, 2 * size_t(n) * m));  // poisoned: a sampled output left unwritten shows
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(size_t(n) * m);
    CHECK(cudaMemcpy(got.data(), d_out, 2 * got.size(), cudaMemcpyDeviceToHost));
    double max_err = 0;
    for (int o = 0; o < m; o += std::max(1, m / 509)) {
      for (int b = 0; b < n; ++b) {
        double ref = 0, mag = 0;
        for (int s = row_ptr[o]; s < row_ptr[o + 1]; ++s) {
          const double p = double(bf16_to_float(vals[s])) * bf16_to_float(xh[size_t(b) * k + cols[s]]);
          ref += p;
          mag += std::fabs(p);
        }
        const double err = std::fabs(double(bf16_to_float(got[size_t(b) * m + o])) - ref) / std::max(mag, 1e-3);
        max_err = std::max(max_err, std::isfinite(err) ? err : 1e30);
      }
    }
    const float band_us = time_median(launch);
    const float alpha = 1.f, beta = 0.f;
    auto dense_launch = [&] {
      const cublasStatus_t status = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, d_dense, CUDA_R_16BF, k, d_x, CUDA_R_16BF, k,
                   &beta, d_dense_out, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (status != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasGemmEx failed: %d\n", int(status));
        std::exit(1);
      }
    };
    const float dense_us = time_median(dense_launch);
    const double bytes = double(nnz) * 4 + 4.0 * (m + 1) + 2.0 * n * k + 2.0 * n * m;
    std::printf("| %d | %.1f | %.1f | %.2fx | %.1f | %.2e |\n", n, band_us, dense_us, dense_us / band_us,
                bytes / 4.0e12 * 1e6, max_err);
  }
  return 0;
}
