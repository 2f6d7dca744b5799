// The band of a sparse attention pattern on tensor cores (16-bit q, k, v; head_dim 64 and 128).
//
// Sparse attention patterns are mostly a local window (each query's nearest keys) plus a few other
// keys: in a row sorted by key, the window is one run of consecutive keys. Neighbouring queries'
// runs overlap, so a block of kBandRows queries needs one range of keys for all of its runs, which
// tensor cores multiply as dense tiles (masked to each row's run) at a fraction of the cost of the
// lane-per-position kernels, which read each position's key and value rows from L2 on their own.
// The forward therefore splits every row: its longest run of consecutive keys (where it is at least
// kMinBandRun long and the block's runs fill at least 1 / kBandMinFill of the block's key range) goes
// to attention_band_forward_kernel, which writes that part's softmax-normalised output and
// log-sum-exp in float32; the lane-per-position forward takes the row's other positions and merges
// the two parts (attention.cu). Both parts sum in fixed orders: deterministic.
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

constexpr int kBandRows = kAttentionBandRows;  // queries per block: 4 warps of 16 (one m16 tile each)
constexpr int kBandKeys = 64;     // keys per tile of the key range
constexpr int kBandWarps = kBandRows / 16;
constexpr int kMinBandRun = 16;   // shorter runs stay with the lane-per-position kernels
constexpr int kBandMinFill = 4;   // a block's runs fill at least 1/4 of its key range x kBandRows

// A row's band: its run of slots [run_begin, run_end) in the CSR view, whose keys are [key_first,
// key_last]. An empty run (run_begin == run_end == the row's first slot, key_first > key_last) leaves
// the whole row to the lane-per-position kernels.
struct BandRow {
  int32_t run_begin, run_end, key_first, key_last;
};

// Element (row, col) of a [rows][D] tile of 16-bit values in shared memory, its 16-byte segments
// swizzled by row (segment s of row r at s ^ (r % 8)), so that ldmatrix's eight rows of one segment
// lie in eight different bank groups.
template <int D>
__device__ __forceinline__ int swizzled(int row, int col) {
  static_assert(D % 64 == 0, "rows of at least 8 segments");
  return row * D + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
}

// Block b's rows [64 b, 64 b + 64): each thread finds its row's longest run of consecutive keys (with
// causal, among the keys j <= i), then the block keeps the runs if they are long enough and fill enough
// of their common key range, and writes each row's BandRow and the block's range (key_first >
// key_last where it keeps none).
template <typename Index>
__global__ void __launch_bounds__(kBandRows)
    attention_band_rows_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx, int64_t lq,
                               bool causal, BandRow* __restrict__ rows, int2* __restrict__ block_keys) {
  static_assert(kBandRows == 64, "two warps");
  __shared__ int s_first[2], s_last[2];
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
  const int32_t first = best_length > 0 ? int32_t(col_idx[best_begin]) : INT_MAX;
  const int32_t last = best_length > 0 ? first + best_length - 1 : INT_MIN;
  // The block's key range and the positions its runs cover: two warps, then across them.
  int32_t lo = first, hi = last;
  long long covered = best_length;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
    covered += __shfl_xor_sync(0xffffffffu, covered, offset);
  }
  if ((threadIdx.x & 31) == 0) {
    const int w = threadIdx.x >> 5;
    s_first[w] = lo, s_last[w] = hi, s_covered[w] = covered;
  }
  __syncthreads();
  lo = min(s_first[0], s_first[1]);
  hi = max(s_last[0], s_last[1]);
  covered = s_covered[0] + s_covered[1];
  const bool keep = covered > 0 && covered * kBandMinFill >= (long long)(hi - lo + 1) * kBandRows;
  if (i < lq) {
    rows[i] = keep && best_length > 0 ? BandRow{best_begin, best_begin + best_length, first, last}
                                      : BandRow{begin, begin, 1, 0};
  }
  if (threadIdx.x == 0) block_keys[blockIdx.x] = keep ? make_int2(lo, hi) : make_int2(1, 0);
}

// The forward over the bands: a block takes kBandRows queries of one (batch, head), a warp 16 of
// them, and walks the block's key range in tiles of kBandKeys keys: S = q k^T on mma.sync (fp32
// accumulation), each row masked to its run, an online softmax in registers, then P (rounded to T)
// times v on mma.sync. K and V tiles are double-buffered in shared memory by cp.async. Writes, for
// each row with a run, its part's output normalised by its own sum (band_out, float32 [Lq][D]) and
// that sum's log (band_lse, natural log, as lse).
template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32)
    attention_band_forward_kernel(const BandRow* __restrict__ band_rows, const int2* __restrict__ block_keys,
                                  int64_t lq, int64_t lk, const T* __restrict__ q, const T* __restrict__ k,
                                  const T* __restrict__ v, float scale_log2, float* __restrict__ band_out,
                                  float* __restrict__ band_lse) {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int kThreads = kBandWarps * 32;
  constexpr int kSegments = D / 8;         // 16-byte segments of a row
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* const sq = smem;                             // [kBandRows][D]
  uint16_t* const sk = sq + kBandRows * D;               // [2][kBandKeys][D]
  uint16_t* const sv = sk + 2 * kBandKeys * D;           // [2][kBandKeys][D]
  const int2 range = block_keys[blockIdx.x];
  if (range.x > range.y) return;  // no band in this block
  const int64_t bh = blockIdx.y, i0 = int64_t(blockIdx.x) * kBandRows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* const qb = q + bh * lq * D;
  const T* const kb = k + bh * lk * D;
  const T* const vb = v + bh * lk * D;

  // Rows r0 .. r0 + count of a [rows][D] array into a swizzled tile, zeros past `rows`.
  const auto stage = [&](uint16_t* dst, const T* src, int64_t rows, int64_t r0, int count) {
    for (int s = tid; s < count * kSegments; s += kThreads) {
      const int r = s / kSegments, seg = s % kSegments;
      const bool inside = r0 + r < rows;
      cp_async_16(dst + swizzled<D>(r, seg * 8), inside ? src + (r0 + r) * D + seg * 8 : src, inside ? 16 : 0);
    }
  };
  const int tiles = int((int64_t(range.y) - range.x) / kBandKeys + 1);
  stage(sq, qb, lq, i0, kBandRows);
  cp_async_commit();
  stage(sk, kb, lk, range.x, kBandKeys);
  stage(sv, vb, lk, range.x, kBandKeys);
  cp_async_commit();

  // This lane's two rows (g and g + 8 of the warp's 16) and their runs.
  const int g = lane >> 2, t4 = lane & 3;
  int32_t first[2], last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = i0 + warp * 16 + g + 8 * h;
    const BandRow b = row < lq ? band_rows[row] : BandRow{0, 0, 1, 0};
    first[h] = b.key_first, last[h] = b.key_last;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 8][4] = {};
  // ldmatrix's addresses: matrix lane / 8, its row lane % 8.
  const int mat = lane >> 3, mrow = lane & 7;
  uint32_t qa[D / 16][4];  // the warp's 16 queries as A operands, one per 16 of D
  cp_async_wait<1>();
  __syncthreads();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    ldmatrix_x4(qa[ks], sq + swizzled<D>(warp * 16 + mrow + 8 * (mat & 1), ks * 16 + 8 * (mat >> 1)));

  for (int tile = 0; tile < tiles; ++tile) {
    const int stage_now = tile & 1;
    if (tile + 1 < tiles) {  // the next tile into the other stage, while this one is used
      const int64_t next0 = int64_t(range.x) + int64_t(tile + 1) * kBandKeys;
      stage(sk + (stage_now ^ 1) * kBandKeys * D, kb, lk, next0, kBandKeys);
      stage(sv + (stage_now ^ 1) * kBandKeys * D, vb, lk, next0, kBandKeys);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint16_t* const tk = sk + stage_now * kBandKeys * D;
    const uint16_t* const tv = sv + stage_now * kBandKeys * D;
    const int64_t key0 = int64_t(range.x) + int64_t(tile) * kBandKeys;

    // S = q k^T for the warp's 16 rows and the tile's 64 keys: 8 tiles of n8.
    float s[kBandKeys / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kBandKeys / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, tk + swizzled<D>(np * 16 + mrow + 8 * (mat >> 1), ks * 16 + 8 * (mat & 1)));
        mma_16816<T>(s[2 * np], qa[ks], b[0], b[1]);
        mma_16816<T>(s[2 * np + 1], qa[ks], b[2], b[3]);
      }
    }
    // Mask each row to its run, scale to log2 units, and update the running maximum and sums.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kBandKeys / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c >> 1;
        const int64_t key = key0 + nt * 8 + 2 * t4 + (c & 1);
        const bool inside = key >= first[h] && key <= last[h];
        s[nt][c] = inside ? s[nt][c] * scale_log2 : -INFINITY;
        tile_max[h] = fmaxf(tile_max[h], s[nt][c]);
      }
    }
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
    uint32_t pa[kBandKeys / 16][4];  // P as the A operand of P v: C tiles 2 kk and 2 kk + 1 side by side
#pragma unroll
    for (int nt = 0; nt < kBandKeys / 8; ++nt) {
      float p[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c >> 1;
        p[c] = s[nt][c] == -INFINITY ? 0.f : exp2f(s[nt][c] - m[h]);
        l[h] += p[c];
      }
      pa[nt >> 1][(nt & 1) * 2] = round_pair<T>(p[0], p[1]);
      pa[nt >> 1][(nt & 1) * 2 + 1] = round_pair<T>(p[2], p[3]);
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < kBandKeys / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, tv + swizzled<D>(kk * 16 + mrow + 8 * (mat & 1), dp * 16 + 8 * (mat >> 1)));
        mma_16816<T>(o[2 * dp], pa[kk], b[0], b[1]);
        mma_16816<T>(o[2 * dp + 1], pa[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
  }

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
    if (t4 == 0) band_lse[bh * lq + row] = l[h] > 0.f ? (m[h] + log2f(l[h])) * 0.6931471805599453f : -INFINITY;
  }
}

}  // namespace
}  // namespace snack::cuda::detail
