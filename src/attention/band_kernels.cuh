// The band of a sparse attention pattern on tensor cores (16-bit q, k, v; head_dim 64 and 128).
//
// Sparse attention patterns are mostly a local window (each query's nearest keys) plus a few other
// keys: in a row sorted by key, the window is one run of consecutive keys. Neighbouring queries'
// runs overlap, so a block of kBandRows queries needs one range of keys for all of its runs, which
// tensor cores multiply as dense tiles (masked to each row's run) at a fraction of the cost of the
// lane-per-position kernels, which read each position's key and value rows from L2 on their own.
// So each row is split (attention_band_rows_kernel): its longest run of consecutive keys, where the
// rule below keeps it, goes to the bands, the row's other positions to the lane-per-position kernels.
// Forward: attention_band_forward_kernel writes the band's softmax-normalised output and log-sum-exp
// in float32, which the warp per row merges with its own part (attention.cu). Backward:
// attention_band_dq_kernel (two passes, around the warp per row's dQ) and attention_band_dkdv_kernel
// (by blocks of keys) write float32 parts that the warps add before their one rounding. Every sum has
// a fixed order: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "snack/attention.h"

namespace snack::cuda::detail {
namespace {

// The attention kernels (these and attention.cu's) take exponentials in log2 units (exp2) and store
// natural log-sum-exps.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kBandRows = kAttentionBandRows;  // queries per block: 4 warps of 16 (one m16 tile each)
constexpr int kBandKeys = 64;     // keys per tile of the key range
constexpr int kBandWarps = kBandRows / 16;
constexpr int kMinBandRun = 16;   // shorter runs stay with the lane-per-position kernels
constexpr int kBandMinFill = 4;   // a block's runs fill at least 1/4 of its key range x kBandRows
constexpr int kBandOutlier = 4;   // a run longer than 4x the block's mean (and than a tile) stays out

// A row's band: its run of slots [run_begin, run_end) in the CSR view, whose keys are [key_first,
// key_last]. An empty run (run_begin == run_end == the row's first slot, key_first > key_last) leaves
// the whole row to the lane-per-position kernels.
struct BandRow {
  int32_t run_begin, run_end, key_first, key_last;
};

// Block b's rows [64 b, 64 b + 64): each thread finds its row's longest run of consecutive keys (with
// causal, among the keys j <= i), of at least kMinBandRun keys; a run more than kBandOutlier times the
// block's mean run (and longer than a tile) is left out too, a global token's row, which would stretch
// the block's key range and every key block's range of queries; then the block keeps the runs if they
// fill at least 1 / kBandMinFill of their common key range x kBandRows, and writes each row's BandRow
// and the block's range (key_first > key_last where it keeps none).
template <typename Index>
__global__ void __launch_bounds__(kBandRows)
    attention_band_rows_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx, int64_t lq,
                               bool causal, BandRow* __restrict__ rows, int2* __restrict__ block_keys) {
  static_assert(kBandRows == 64, "two warps");
  __shared__ int s_first[2], s_last[2], s_runs[2];
  __shared__ long long s_covered[2];
  const int64_t i = int64_t(blockIdx.x) * kBandRows + threadIdx.x;
  int32_t begin = 0, best_begin = 0, best_length = 0;
  if (i < lq) {
    begin = row_ptr[i];
    const int32_t end = row_ptr[i + 1];
    int32_t run_begin = begin;
    int64_t previous = -2;
    best_begin = begin;
    for (int32_t e = begin; e < end; ++e) {
      const int64_t key = int64_t(col_idx[e]);
      if (causal && key > i) break;  // the keys ascend: the rest are masked
      if (key != previous + 1) run_begin = e;
      previous = key;
      if (e + 1 - run_begin > best_length) best_length = e + 1 - run_begin, best_begin = run_begin;
    }
  }
  if (best_length < kMinBandRun) best_length = 0;
  // The block's key range, the positions its runs cover and how many runs: two warps, then across them.
  int32_t lo, hi, runs;
  long long covered;
  const auto reduce = [&]() {
    lo = best_length > 0 ? int32_t(col_idx[best_begin]) : INT_MAX;
    hi = best_length > 0 ? lo + best_length - 1 : INT_MIN;
    covered = best_length, runs = best_length > 0;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
      hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
      covered += __shfl_xor_sync(0xffffffffu, covered, offset);
      runs += __shfl_xor_sync(0xffffffffu, runs, offset);
    }
    __syncthreads();  // the previous round's values are read
    if ((threadIdx.x & 31) == 0) {
      const int w = threadIdx.x >> 5;
      s_first[w] = lo, s_last[w] = hi, s_covered[w] = covered, s_runs[w] = runs;
    }
    __syncthreads();
    lo = min(s_first[0], s_first[1]);
    hi = max(s_last[0], s_last[1]);
    covered = s_covered[0] + s_covered[1];
    runs = s_runs[0] + s_runs[1];
  };
  reduce();
  if (best_length > kBandKeys && (long long)best_length * runs > kBandOutlier * covered) best_length = 0;
  reduce();
  const bool keep = covered > 0 && covered * kBandMinFill >= (long long)(hi - lo + 1) * kBandRows;
  if (i < lq) {
    rows[i] = keep && best_length > 0
                  ? BandRow{best_begin, best_begin + best_length, int32_t(col_idx[best_begin]),
                            int32_t(col_idx[best_begin]) + best_length - 1}
                  : BandRow{begin, begin, 1, 0};
  }
  if (threadIdx.x == 0) block_keys[blockIdx.x] = keep ? make_int2(lo, hi) : make_int2(1, 0);
}

// Rows r0 .. r0 + kRows of a [rows][D] array (q, k, v or dout) into a swizzled tile, zeros past `rows`,
// by the block's kThreads threads (the caller commits).
template <int D, int kThreads, int kRows, typename T>
__device__ __forceinline__ void stage_tile(uint16_t* dst, const T* src, int64_t rows, int64_t r0) {
  stage_16bit_rows_swizzled_vec<kRows, D, kThreads>(reinterpret_cast<unsigned char*>(dst), src, rows, D, r0, 0,
                                                    int(threadIdx.x));
}

// The address of element (row, col) of a swizzled tile (ldmatrix's row addresses).
template <int D>
__device__ __forceinline__ const void* swizzled_at(const uint16_t* tile, int row, int col) {
  return reinterpret_cast<const unsigned char*>(tile) + swizzled_16bit<D>(row, col);
}

// The A operands (m16 x k16, one per 16 of D) of rows row0 .. row0 + 15 of a swizzled tile.
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[D / 16][4], const uint16_t* tile, int row0) {
  const int lane = threadIdx.x & 31, mat = lane >> 3, mrow = lane & 7;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    ldmatrix_x4(a[ks], swizzled_at<D>(tile, row0 + mrow + 8 * (mat & 1), ks * 16 + 8 * (mat >> 1)));
}

// c = a b^T for the 16 rows of `a` and the kN rows of the swizzled tile `b` (the product over D):
// q k^T, dout v^T and their transposes. c[n / 8] is the n8 tile of columns n .. n + 7.
template <typename T, int D, int kN>
__device__ __forceinline__ void multiply_rows(float (&c)[kN / 8][4], const uint32_t (&a)[D / 16][4],
                                              const uint16_t* b) {
  const int lane = threadIdx.x & 31, mat = lane >> 3, mrow = lane & 7;
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, swizzled_at<D>(b, np * 16 + mrow + 8 * (mat >> 1), ks * 16 + 8 * (mat & 1)));
      mma_16816<T>(c[2 * np], a[ks], r[0], r[1]);
      mma_16816<T>(c[2 * np + 1], a[ks], r[2], r[3]);
    }
  }
}

// acc += p b for the 16 x kK operand p (A operands from pack_a) and the kK rows of the swizzled tile b
// (the product over b's rows): P v, dS k, P^T dout, dS^T q.
template <typename T, int D, int kK>
__device__ __forceinline__ void accumulate_rows(float (&acc)[D / 8][4], const uint32_t (&p)[kK / 16][4],
                                                const uint16_t* b) {
  const int lane = threadIdx.x & 31, mat = lane >> 3, mrow = lane & 7;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, swizzled_at<D>(b, kk * 16 + mrow + 8 * (mat & 1), dp * 16 + 8 * (mat >> 1)));
      mma_16816<T>(acc[2 * dp], p[kk], r[0], r[1]);
      mma_16816<T>(acc[2 * dp + 1], p[kk], r[2], r[3]);
    }
  }
}

// An accumulator tile (16 x kN, n8 tiles) rounded to T as the A operands of the next product: the
// C tiles 2 kk and 2 kk + 1 side by side are the k16 step kk.
template <typename T, int kN>
__device__ __forceinline__ void pack_a(uint32_t (&a)[kN / 16][4], const float (&c)[kN / 8][4]) {
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
    a[n >> 1][(n & 1) * 2] = round_pair<T>(c[n][0], c[n][1]);
    a[n >> 1][(n & 1) * 2 + 1] = round_pair<T>(c[n][2], c[n][3]);
  }
}

// Runs body(t, stage) for the tiles t = 0 .. tiles - 1, whose operands stage(t, stage) copies into one
// of two stages by cp.async (the block's threads; tile 0's copies issued by the caller as the newest
// group): each next tile's copies issued while the current one is used, with the barriers that make
// a stage safe to read and then to refill.
template <typename Stage, typename Body>
__device__ __forceinline__ void double_buffered(int tiles, Stage&& stage, Body&& body) {
  for (int tile = 0; tile < tiles; ++tile) {
    if (tile + 1 < tiles) {
      stage(tile + 1, (tile + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    body(tile, tile & 1);
    __syncthreads();  // every warp is done with this stage before the next tile refills it
  }
}

// The stage function of double_buffered over a block's key range from key `first`: key tile t's rows of
// k and v into stage `stage` of sk and sv ([2][kBandKeys][D] each). tiles(): the range's tiles.
template <typename T, int D, int kThreads>
struct KeyTiles {
  uint16_t *sk, *sv;
  const T *k, *v;  // this (batch, head)'s rows
  int64_t lk;
  int2 range;
  __device__ __forceinline__ void operator()(int t, int stage) const {
    const int64_t key0 = int64_t(range.x) + int64_t(t) * kBandKeys;
    stage_tile<D, kThreads, kBandKeys>(sk + stage * kBandKeys * D, k, lk, key0);
    stage_tile<D, kThreads, kBandKeys>(sv + stage * kBandKeys * D, v, lk, key0);
  }
  __device__ __forceinline__ int tiles() const { return int((int64_t(range.y) - range.x) / kBandKeys + 1); }
};

// fn(nt, c, h, key) for each of this lane's elements [nt][c] of a warp's 16 x kBandKeys tile of keys
// from key0 in mma's C layout: row g + 8 h of the warp's 16 (h = c / 2), key key0 + 8 nt + 2 (lane %
// 4) + c % 2.
template <typename Fn>
__device__ __forceinline__ void for_each_key(int64_t key0, Fn&& fn) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int nt = 0; nt < kBandKeys / 8; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) fn(nt, c, c >> 1, key0 + nt * 8 + 2 * t4 + (c & 1));
  }
}

// The runs of this lane's two query rows (g = lane / 4 and g + 8 of the warp's 16 from row0): their
// first and last keys, empty (first > last) past lq.
__device__ __forceinline__ void lane_runs(const BandRow* __restrict__ band_rows, int64_t lq, int64_t row0,
                                          int32_t (&first)[2], int32_t (&last)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + ((threadIdx.x & 31) >> 2) + 8 * h;
    const BandRow b = row < lq ? band_rows[row] : BandRow{0, 0, 1, 0};
    first[h] = b.key_first, last[h] = b.key_last;
  }
}

// The forward over the bands: a block takes kBandRows queries of one (batch, head), a warp 16 of
// them, and walks the block's key range in tiles of kBandKeys keys: S = q k^T on mma.sync (fp32
// accumulation), each row masked to its run, an online softmax in registers, then P (rounded to T)
// times v on mma.sync. K and V tiles are double-buffered in shared memory by cp.async. Writes, for
// each row with a run, its part's output normalised by its own sum (band_out, float32 [Lq][D]) and
// that sum's log (band_lse, natural log, as lse).
template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32, 1)
    attention_band_forward_kernel(const BandRow* __restrict__ band_rows, const int2* __restrict__ block_keys,
                                  int64_t lq, int64_t lk, const T* __restrict__ q, const T* __restrict__ k,
                                  const T* __restrict__ v, float scale_log2, float* __restrict__ band_out,
                                  float* __restrict__ band_lse) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int kThreads = kBandWarps * 32;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* const sq = smem;                    // [kBandRows][D]
  uint16_t* const sk = sq + kBandRows * D;      // [2][kBandKeys][D]
  uint16_t* const sv = sk + 2 * kBandKeys * D;  // [2][kBandKeys][D]
  const int2 range = block_keys[blockIdx.x];
  if (range.x > range.y) return;  // no band in this block
  const int64_t bh = blockIdx.y, i0 = int64_t(blockIdx.x) * kBandRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const KeyTiles<T, D, kThreads> stage_keys{sk, sv, k + bh * lk * D, v + bh * lk * D, lk, range};
  stage_tile<D, kThreads, kBandRows>(sq, q + bh * lq * D, lq, i0);  // q with the first key tile
  stage_keys(0, 0);
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  int32_t first[2], last[2];
  lane_runs(band_rows, lq, i0 + warp * 16, first, last);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 8][4] = {};
  double_buffered(stage_keys.tiles(), stage_keys, [&](int tile, int now) {
    const int64_t key0 = int64_t(range.x) + int64_t(tile) * kBandKeys;
    float s[kBandKeys / 8][4];
    {
      uint32_t qa[D / 16][4];  // the warp's 16 queries, reloaded per tile: registers go to the products
      load_a<D>(qa, sq, warp * 16);
      multiply_rows<T, D, kBandKeys>(s, qa, sk + now * kBandKeys * D);
    }
    // Mask each row to its run, scale to log2 units, and update the running maximum and sums.
    float tile_max[2] = {-INFINITY, -INFINITY};
    for_each_key(key0, [&](int nt, int c, int h, int64_t key) {
      s[nt][c] = key >= first[h] && key <= last[h] ? s[nt][c] * scale_log2 : -INFINITY;
      tile_max[h] = fmaxf(tile_max[h], s[nt][c]);
    });
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // a row's four lanes (lane % 4) hold its 64 scores between them
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(m[h], tile_max[h]);
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);  // exp2(-inf) = 0 where m was -inf
      m[h] = m_new;
      l[h] *= alpha[h];
    }
    for_each_key(key0, [&](int nt, int c, int h, int64_t) {
      s[nt][c] = s[nt][c] == -INFINITY ? 0.f : exp2f(s[nt][c] - m[h]);
      l[h] += s[nt][c];
    });
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
    }
    uint32_t pa[kBandKeys / 16][4];
    pack_a<T, kBandKeys>(pa, s);
    accumulate_rows<T, D, kBandKeys>(o, pa, sv + now * kBandKeys * D);
  });

  // Each row's sum over its four lanes, then the normalised output and the log-sum-exp.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int64_t row = i0 + warp * 16 + g + 8 * h;
    if (row >= lq || first[h] > last[h]) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float* const out_row = band_out + (bh * lq + row) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(out_row + dt * 8 + 2 * t4) = make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    if (t4 == 0) band_lse[bh * lq + row] = l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
  }
}

// For each block of kBandKeys keys, the first and last query whose band holds one of its keys
// (query_first > query_last where none: both filled beforehand, with a large value and -1): atomic
// minima and maxima, whose results do not depend on their order.
__global__ void attention_band_keys_kernel(const BandRow* __restrict__ band_rows, int64_t lq,
                                           int32_t* __restrict__ query_first, int32_t* __restrict__ query_last) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= lq) return;
  const BandRow b = band_rows[i];
  if (b.run_begin == b.run_end) return;
  for (int32_t block = b.key_first / kBandKeys; block <= b.key_last / kBandKeys; ++block) {
    atomicMin(query_first + block, int32_t(i));
    atomicMax(query_last + block, int32_t(i));
  }
}

// Each CSC entry's query for the warp per key, or -1 where the entry lies in its query's band (the
// band kernel's): once per call, so that the warps of every head read one word per position instead
// of three dependent ones (the entry's slot, its query, the query's run).
template <typename Index>
__global__ void attention_band_csc_kernel(const int32_t* __restrict__ csc_perm, const Index* __restrict__ row_idx,
                                          int64_t nnz, const BandRow* __restrict__ band_rows,
                                          int32_t* __restrict__ residual_queries) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= nnz) return;
  const int32_t slot = csc_perm[e], query = int32_t(row_idx[slot]);
  const BandRow b = band_rows[query];
  residual_queries[e] = slot >= b.run_begin && slot < b.run_end ? -1 : query;
}

// dQ over the bands, blocks of kBandRows queries walking their key tiles as the forward does, in two
// launches. kPass 0: each banded row's sum of P dP over its band (dP = dout v^T) into row_dot, which
// the warp per row then completes with its other positions. kPass 1: dS = P (dP - row_dot) and the
// band's part of dQ = scale dS k (dS rounded to T for the product), added to the warp per row's part
// (dq_partial, float32 [Lq][D]) and stored. q and dout stay in shared memory for the whole range.
template <typename T, int D, int kPass>
__global__ void __launch_bounds__(kBandWarps * 32)
    attention_band_dq_kernel(const BandRow* __restrict__ band_rows, const int2* __restrict__ block_keys, int64_t lq,
                             int64_t lk, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const float* __restrict__ lse, const T* __restrict__ dout, float scale,
                             float* __restrict__ row_dot, const float* __restrict__ dq_partial, T* __restrict__ dq) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int kThreads = kBandWarps * 32;
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* const sq = smem;                    // [kBandRows][D]
  uint16_t* const sdo = sq + kBandRows * D;     // [kBandRows][D]
  uint16_t* const sk = sdo + kBandRows * D;     // [2][kBandKeys][D]
  uint16_t* const sv = sk + 2 * kBandKeys * D;  // [2][kBandKeys][D]
  const int2 range = block_keys[blockIdx.x];
  if (range.x > range.y) return;
  const int64_t bh = blockIdx.y, i0 = int64_t(blockIdx.x) * kBandRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const KeyTiles<T, D, kThreads> stage_keys{sk, sv, k + bh * lk * D, v + bh * lk * D, lk, range};
  stage_tile<D, kThreads, kBandRows>(sq, q + bh * lq * D, lq, i0);  // q and dout with the first key tile
  stage_tile<D, kThreads, kBandRows>(sdo, dout + bh * lq * D, lq, i0);
  stage_keys(0, 0);
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = scale * kLog2e;
  int32_t first[2], last[2];
  lane_runs(band_rows, lq, i0 + warp * 16, first, last);
  float lse_log2[2], di[2], rd[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = i0 + warp * 16 + g + 8 * h;
    lse_log2[h] = row < lq ? lse[bh * lq + row] * kLog2e : 0.f;
    di[h] = kPass == 1 && row < lq ? row_dot[bh * lq + row] : 0.f;
  }
  float acc[D / 8][4] = {};
  double_buffered(stage_keys.tiles(), stage_keys, [&](int tile, int now) {
    const int64_t key0 = int64_t(range.x) + int64_t(tile) * kBandKeys;
    const uint16_t* const tk = sk + now * kBandKeys * D;
    float s[kBandKeys / 8][4], dp[kBandKeys / 8][4];
    {
      uint32_t a[D / 16][4];  // reloaded per tile: registers go to the products
      load_a<D>(a, sq, warp * 16);
      multiply_rows<T, D, kBandKeys>(s, a, tk);
      load_a<D>(a, sdo, warp * 16);
      multiply_rows<T, D, kBandKeys>(dp, a, sv + now * kBandKeys * D);
    }
    for_each_key(key0, [&](int nt, int c, int h, int64_t key) {
      const float p = key >= first[h] && key <= last[h] ? exp2f(s[nt][c] * scale_log2 - lse_log2[h]) : 0.f;
      if constexpr (kPass == 0) rd[h] = fmaf(p, dp[nt][c], rd[h]);
      else s[nt][c] = p * (dp[nt][c] - di[h]);
    });
    if constexpr (kPass == 1) {
      uint32_t ds[kBandKeys / 16][4];
      pack_a<T, kBandKeys>(ds, s);
      accumulate_rows<T, D, kBandKeys>(acc, ds, tk);
    }
  });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = i0 + warp * 16 + g + 8 * h;
    if constexpr (kPass == 0) {
      rd[h] += __shfl_xor_sync(0xffffffffu, rd[h], 1);
      rd[h] += __shfl_xor_sync(0xffffffffu, rd[h], 2);
      if (row < lq && first[h] <= last[h] && t4 == 0) row_dot[bh * lq + row] = rd[h];
    } else {
      if (row >= lq || first[h] > last[h]) continue;
      const float* const part = dq_partial + (bh * lq + row) * D;
      T* const out = dq + (bh * lq + row) * D;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const int e = dt * 8 + 2 * t4;
        const float2 own = *reinterpret_cast<const float2*>(part + e);
        *reinterpret_cast<uint32_t*>(out + e) =
            round_pair<T>(fmaf(acc[dt][2 * h], scale, own.x), fmaf(acc[dt][2 * h + 1], scale, own.y));
      }
    }
  }
}

// dK and dV over the bands: a block takes kBandKeys keys (a warp 16), and walks the queries whose
// bands hold any of them (query_first .. query_last of its key block) in tiles of kQueries: S^T =
// k q^T and dP^T = v dout^T recomputed, P^T and dS^T = P^T (dP^T - row_dot) masked to each query's
// run, dV += P^T dout and dK += dS^T q (P and dS rounded to T for the products). Writes every key of
// the block's part, scale dK and dV, in float32 (dk_partial, dv_partial [Lk][D]), which the warp per
// key then adds to its own.
template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32)
    attention_band_dkdv_kernel(const BandRow* __restrict__ band_rows, const int32_t* __restrict__ query_first,
                               const int32_t* __restrict__ query_last, int64_t lq, int64_t lk,
                               const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                               const float* __restrict__ lse, const float* __restrict__ row_dot,
                               const T* __restrict__ dout, float scale, float* __restrict__ dk_partial,
                               float* __restrict__ dv_partial) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int kThreads = kBandWarps * 32;
  constexpr int kQueries = D == 128 ? 32 : 64;  // a query tile: fewer at 128 so that the sums fit registers
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* const sk = smem;                    // [kBandKeys][D]
  uint16_t* const sv = sk + kBandKeys * D;      // [kBandKeys][D]
  uint16_t* const sq = sv + kBandKeys * D;      // [2][kQueries][D]
  uint16_t* const sdo = sq + 2 * kQueries * D;  // [2][kQueries][D]
  // Per query of a tile (two stages): its run's keys, its log-sum-exp (log2 units), its row_dot.
  int32_t* const s_first = reinterpret_cast<int32_t*>(sdo + 2 * kQueries * D);
  int32_t* const s_last = s_first + 2 * kQueries;
  float* const s_lse = reinterpret_cast<float*>(s_last + 2 * kQueries);
  float* const s_dot = s_lse + 2 * kQueries;
  const int32_t qf = query_first[blockIdx.x], ql = query_last[blockIdx.x];
  if (qf > ql) return;
  const int64_t bh = blockIdx.y, key0 = int64_t(blockIdx.x) * kBandKeys;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* const qb = q + bh * lq * D;
  const T* const dob = dout + bh * lq * D;
  const auto stage_queries = [&](int t, int stage) {  // query tile t into stage `stage`; k and v with the first
    const int64_t r0 = int64_t(qf) + int64_t(t) * kQueries;
    stage_tile<D, kThreads, kQueries>(sq + stage * kQueries * D, qb, lq, r0);
    stage_tile<D, kThreads, kQueries>(sdo + stage * kQueries * D, dob, lq, r0);
    for (int t = tid; t < kQueries; t += kThreads) {
      const int64_t i = r0 + t;
      const BandRow b = i < lq ? band_rows[i] : BandRow{0, 0, 1, 0};
      s_first[stage * kQueries + t] = b.key_first, s_last[stage * kQueries + t] = b.key_last;
      s_lse[stage * kQueries + t] = i < lq ? lse[bh * lq + i] * kLog2e : 0.f;
      s_dot[stage * kQueries + t] = i < lq ? row_dot[bh * lq + i] : 0.f;
    }
  };
  stage_tile<D, kThreads, kBandKeys>(sk, k + bh * lk * D, lk, key0);
  stage_tile<D, kThreads, kBandKeys>(sv, v + bh * lk * D, lk, key0);
  stage_queries(0, 0);
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = scale * kLog2e;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  double_buffered((ql - qf) / kQueries + 1, stage_queries, [&](int, int now) {
    const uint16_t* const tq = sq + now * kQueries * D;
    const uint16_t* const tdo = sdo + now * kQueries * D;
    float st[kQueries / 8][4], dpt[kQueries / 8][4];
    {
      uint32_t a[D / 16][4];
      load_a<D>(a, sk, warp * 16);
      multiply_rows<T, D, kQueries>(st, a, tq);
      load_a<D>(a, sv, warp * 16);
      multiply_rows<T, D, kQueries>(dpt, a, tdo);
    }
#pragma unroll
    for (int nt = 0; nt < kQueries / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t key = key0 + warp * 16 + g + 8 * (c >> 1);
        const int t = now * kQueries + nt * 8 + 2 * t4 + (c & 1);
        const float p = key >= s_first[t] && key <= s_last[t] ? exp2f(st[nt][c] * scale_log2 - s_lse[t]) : 0.f;
        st[nt][c] = p;
        dpt[nt][c] = p * (dpt[nt][c] - s_dot[t]);
      }
    }
    {
      uint32_t a[kQueries / 16][4];
      pack_a<T, kQueries>(a, st);
      accumulate_rows<T, D, kQueries>(dv, a, tdo);
      pack_a<T, kQueries>(a, dpt);
      accumulate_rows<T, D, kQueries>(dk, a, tq);
    }
  });
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t key = key0 + warp * 16 + g + 8 * h;
    if (key >= lk) continue;
    float* const k_row = dk_partial + (bh * lk + key) * D;
    float* const v_row = dv_partial + (bh * lk + key) * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int e = dt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(k_row + e) = make_float2(dk[dt][2 * h] * scale, dk[dt][2 * h + 1] * scale);
      *reinterpret_cast<float2*>(v_row + e) = make_float2(dv[dt][2 * h], dv[dt][2 * h + 1]);
    }
  }
}

}  // namespace
}  // namespace snack::cuda::detail
