// The wide_rows forward SpMM kernel: a batch tile of 1-16 rows, W's slot arrays read with 16-byte loads.
//
// Why a kernel of its own: the row kernels (rows_kernel.cuh) give each lane one slot of a row at a
// time, so at small batches their loads of W are 4- and 2-byte scalars whose chain (row pointer ->
// slots -> X) keeps little of W in flight, and X is gathered through L1, one wavefront per slot,
// where the stream of W evicts it (H200, 16384x4096 at 90%: ~1.6 TB/s of W at one batch row,
// docs/kernels.md). Here a warp owns a group of consecutive rows, whose slots are one contiguous
// range: each lane reads 8 consecutive slots (values and indices as 16-byte vectors) per chunk, the
// next chunk requested before the current one is used, and the batch tile of X sits in shared memory
// (column-major: one column's tile values side by side), whose gathers cost a few bank cycles per
// warp instead of an L1 wavefront per slot.
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/activation.h"

namespace snack::cuda::detail {

// How one column's `tile` values are read: in 16-byte pieces of kElems values (the whole column where
// it is shorter). With two or more pieces, lane l reads piece q ^ rot (rot = l mod kPieces) into its
// accumulators q: neighbouring lanes then start in different bank groups, so that the 8 lanes of a
// 16-byte load's phase spread over all 8 groups instead of half of them.
template <typename T, int kTile>
struct WideTile {
  static constexpr int kElems = int(16 / sizeof(T)) < kTile ? int(16 / sizeof(T)) : kTile;
  static constexpr int kPieces = kTile / kElems;
};

// One lane's chunk: kWideSlots consecutive slots, values and indices as loaded (packed words), each
// value widened where it is used (measured on the H200 against values widened at the load, bf16 at
// N = 1-8: 16384x4096 at 90%, N = 1 19.6 -> 17.2 us, N = 4 21.2 -> 17.8; fp32 N = 4 23.2 -> 21.7).
template <typename T, typename Index>
struct WideChunk {
  static constexpr int kIndexWords = kWideSlots * int(sizeof(Index)) / 4;
  PackedValues<T, kWideSlots> val;
  uint32_t idx[kIndexWords];
  __device__ __forceinline__ int32_t column(int u) const {
    return int32_t(packed_element<Index>(idx, u));
  }
  // Slots [s, s + kWideSlots): 16-byte vectors where `vec` (both arrays 16-byte aligned) and the chunk
  // lies inside the arrays, else scalars; slots past nnz read as value 0, column 0.
  __device__ __forceinline__ void load(const T* __restrict__ values, const Index* __restrict__ col_idx, int32_t s,
                                       int32_t nnz, bool vec) {
    if (vec && s + kWideSlots <= nnz) {
      load_words(values + s, val.w);
      load_words(col_idx + s, idx);
    } else {
      val.clear();
#pragma unroll
      for (int u = 0; u < kIndexWords; ++u) idx[u] = 0;
#pragma unroll
      for (int u = 0; u < kWideSlots; ++u) {
        if (s + u >= nnz) continue;
        val.set(u, load_ro(values + s + u));
        packed_insert<Index>(idx, u, uint32_t(load_ro(col_idx + s + u)));
      }
    }
  }
};

// y[b, o] = act(sum_s values[s] x[b, col_idx[s]] + bias[o]) for the batch rows b of this block's tile,
// b0 = batch0 + kTile blockIdx.y .. min(b0 + kTile, n) - 1.
//
// Rows are taken in groups of rows_per_warp (<= kWideMaxRows) consecutive rows, one group per warp at
// a time (groups strided over the grid's warps). A lane walks the group's slot range in chunks of 8
// slots (lane l: slots start + 8 l .. + 7, then + 256), keeps one running sum per batch row of the
// tile, and parks them in its part of `partial` when its slots move on to the next row; the group's
// rows are then summed over the 32 lanes in lane order.
// A row longer than long_threshold would keep its warp busy long after the others (power-law row
// lengths): the warp walks around the first such row of its group and hands it to its block (up to
// kWideLongPerWarp rows per warp, the first ones in the warp's fixed order of groups); once their
// groups are done, each of the block's warps sums a slice of every such row, and the slices are
// added in warp order.
// Every sum has a fixed order: the result is bitwise reproducible.
// `vec`: values and col_idx are 16-byte aligned (else every slot is a scalar load).
template <typename T, typename Index, int kTile>
__global__ void __launch_bounds__(wide_rows_threads(kTile), wide_rows_warps_per_sm(kTile) * 32 / wide_rows_threads(kTile))
    spmm_wide_rows_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx,
                          const T* __restrict__ values, int32_t nnz, int64_t out_dim, int64_t in_dim,
                          const T* __restrict__ x, int64_t n, int64_t batch0, const T* __restrict__ bias,
                          T* __restrict__ y, Activation act, int rows_per_warp, int32_t long_threshold, bool vec) {
  using A = accum_t<T>;
  constexpr int kThreads = wide_rows_threads(kTile);
  constexpr int kWarps = kThreads / 32;
  constexpr int kE = WideTile<T, kTile>::kElems;
  constexpr int kPieces = WideTile<T, kTile>::kPieces;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);  // xs[c * kTile + b] = x[b0 + b, c]
  A* partial = reinterpret_cast<A*>(smem_raw + wide_rows_tile_bytes(sizeof(T), in_dim, kTile));
  __shared__ int32_t bounds[kWarps][kWideMaxRows + 1];
  __shared__ int32_t long_rows[kWarps][kWideLongPerWarp];     // a deferred row,
  __shared__ int32_t long_range[kWarps][kWideLongPerWarp][2];  // and its slots [begin, end)
  __shared__ int long_count[kWarps];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t b0 = batch0 + int64_t(blockIdx.y) * kTile;
  const int tile_rows = int(n - b0 < kTile ? n - b0 : kTile);
  const int stride = wide_rows_partial_stride(rows_per_warp, kTile);
  const int rot = lane & (kPieces - 1);  // this lane's first piece of a column (WideTile)
  const int64_t groups = ceil_div(out_dim, rows_per_warp);
  const int64_t warp_count = int64_t(gridDim.x) * kWarps;
  A* my_partial = partial + (warp * 32 + lane) * stride;
  int my_long_rows = 0;  // warp-uniform

  auto group_rows = [&](int64_t g) {
    const int64_t left = out_dim - g * rows_per_warp;
    return int(left < rows_per_warp ? left : rows_per_warp);
  };
  // Lane i <= the group's row count holds row_ptr[first row + i].
  auto load_bounds = [&](int64_t g) -> int32_t {
    return g < groups && lane <= group_rows(g) ? load_ro(row_ptr + g * rows_per_warp + lane) : 0;
  };
  WideChunk<T, Index> cur;
  // Requests this lane's first chunk of group g (row pointers in bnd) into cur.
  auto load_first_chunk = [&](int64_t g, int32_t bnd) {
    const int32_t begin = __shfl_sync(0xffffffffu, bnd, 0);
    const int32_t end = __shfl_sync(0xffffffffu, bnd, group_rows(g));
    const int32_t first = (begin & ~(kWideSlots - 1)) + lane * kWideSlots;
    if (first < end) cur.load(values, col_idx, first, nnz, vec);
  };

  // The first group's row pointers and first chunk are requested together with X, so that the
  // three first misses overlap.
  int64_t g = int64_t(blockIdx.x) * kWarps + warp;
  int32_t bnd = load_bounds(g);
  const int cols = int(in_dim);  // fits in shared memory, so far below 2^31
  if constexpr (kTile == 1) {
    // 256 threads stage the row: each keeps kWideXPerThread loads in flight (the first round issued
    // before the group's first chunk), where the column loop below keeps only two.
    const T* xrow = x + b0 * in_dim;
    int c0 = threadIdx.x;
    T xv[kWideXPerThread];
#pragma unroll
    for (int u = 0; u < kWideXPerThread; ++u) {
      const int c = c0 + u * kThreads;
      xv[u] = c < cols ? xrow[c] : T{};
    }
    if (g < groups) load_first_chunk(g, bnd);
    for (;;) {
#pragma unroll
      for (int u = 0; u < kWideXPerThread; ++u) {
        const int c = c0 + u * kThreads;
        if (c < cols) xs[c] = xv[u];
      }
      c0 += kWideXPerThread * kThreads;
      if (c0 >= cols) break;
#pragma unroll
      for (int u = 0; u < kWideXPerThread; ++u) {
        const int c = c0 + u * kThreads;
        xv[u] = c < cols ? xrow[c] : T{};
      }
    }
  } else {
    // A thread stages whole columns: the tile's rows are read coalesced (one row per load), and
    // the column is written as 16-byte vectors. Rows past the batch read as zero.
    if (g < groups) load_first_chunk(g, bnd);
    const T* xtile = x + b0 * in_dim;
#pragma unroll 2
    for (int c = threadIdx.x; c < cols; c += kThreads) {
      T column[kTile];
#pragma unroll
      for (int b = 0; b < kTile; ++b) column[b] = b < tile_rows ? xtile[int64_t(b) * in_dim + c] : T{};
      store_run<T, kTile>(xs + int64_t(c) * kTile, column);
    }
  }
  __syncthreads();

  A acc[kTile];
  int k = 0;            // this lane's current row in its warp's group
  int32_t row_end = 0;  // and where that row ends
  // acc[j] holds batch row j ^ (rot kE) of the tile (WideTile).
  auto park = [&](int row) {
#pragma unroll
    for (int j = 0; j < kTile; ++j) my_partial[row * kTile + (j ^ (rot * kE))] = acc[j];
  };
  // Adds slots [lo, hi) into acc; with track_rows, acc is parked in row k of my_partial whenever the
  // lane's next slot lies past row k. `preloaded`: cur already holds the lane's first chunk.
  auto walk = [&](int32_t lo, int32_t hi, bool preloaded, auto track_rows) {
    int32_t s0 = (lo & ~(kWideSlots - 1)) + lane * kWideSlots;
    if (!preloaded && s0 < hi) cur.load(values, col_idx, s0, nnz, vec);
    for (; s0 < hi; s0 += kWideChunk) {
      WideChunk<T, Index> next;
      if (s0 + kWideChunk < hi) next.load(values, col_idx, s0 + kWideChunk, nnz, vec);
#pragma unroll
      for (int u = 0; u < kWideSlots; ++u) {
        const int32_t s = s0 + u;
        if (s < lo || s >= hi) continue;  // a slot of a neighbouring range
        if constexpr (decltype(track_rows)::value) {
          while (s >= row_end) {  // this lane's slots moved on to a later row
            park(k);
#pragma unroll
            for (int j = 0; j < kTile; ++j) acc[j] = A(0);
            ++k;
            row_end = bounds[warp][k + 1];
          }
        }
        const A value = cur.val.get(u);
        const T* column = xs + cur.column(u) * kTile;  // below 2^31: the tile fits in shared memory
        if constexpr (kTile == 1) {
          acc[0] += value * to_accum(column[0]);
        } else {
#pragma unroll
          for (int q = 0; q < kPieces; ++q) {
            A xv[kE];
            load_vec<T, kE, true>(column + (q ^ rot) * kE, xv);
#pragma unroll
            for (int i = 0; i < kE; ++i) acc[q * kE + i] += value * xv[i];
          }
        }
      }
      cur = next;
    }
  };

  for (; g < groups; g += warp_count) {
    const int rows = group_rows(g);
    if (lane <= rows) bounds[warp][lane] = bnd;
    for (int t = 0; t < rows * kTile; ++t) my_partial[t] = A(0);
    const int32_t begin = __shfl_sync(0xffffffffu, bnd, 0);
    const int32_t end = __shfl_sync(0xffffffffu, bnd, rows);
    // The group's first row longer than long_threshold goes to the block (while the warp's list has room).
    const int32_t length = __shfl_down_sync(0xffffffffu, bnd, 1) - bnd;
    const unsigned longs = __ballot_sync(0xffffffffu, lane < rows && length > long_threshold);
    int deferred = -1;
    int32_t deferred_begin = 0, deferred_end = 0;  // its slots
    if (longs && my_long_rows < kWideLongPerWarp) {  // warp-uniform
      deferred = __ffs(longs) - 1;
      deferred_begin = __shfl_sync(0xffffffffu, bnd, deferred);
      deferred_end = __shfl_sync(0xffffffffu, bnd, deferred + 1);
      if (lane == 0) {
        long_rows[warp][my_long_rows] = int32_t(g * rows_per_warp + deferred);
        long_range[warp][my_long_rows][0] = deferred_begin;
        long_range[warp][my_long_rows][1] = deferred_end;
      }
      ++my_long_rows;
    }
    __syncwarp();
    bnd = load_bounds(g + warp_count);  // the next group's, in flight during this one

#pragma unroll
    for (int j = 0; j < kTile; ++j) acc[j] = A(0);
    k = 0;
    row_end = bounds[warp][1];
    if (deferred < 0) {
      walk(begin, end, true, std::true_type{});
    } else {
      walk(begin, deferred_begin, true, std::true_type{});
      walk(deferred_end, end, false, std::true_type{});
    }
    park(k);
    __syncwarp();
    // Lane t sums entry t of the lanes' partials (row t / kTile, batch row t % kTile) in lane order.
    for (int t = lane; t < rows * kTile; t += 32) {
      const int r = t / kTile, b = t % kTile;
      if (r == deferred || b >= tile_rows) continue;
      const A* column = partial + warp * 32 * stride + t;
      A total = A(0);
#pragma unroll
      for (int j = 0; j < 32; ++j) total += column[j * stride];
      const int64_t o = g * rows_per_warp + r;
      if (bias) total += to_accum(bias[o]);
      y[(b0 + b) * out_dim + o] = from_accum<T>(apply_activation(total, act));
    }
    __syncwarp();

    if (g + warp_count < groups) load_first_chunk(g + warp_count, bnd);
  }

  // The deferred rows, in rounds of as many as `partial` holds slices of: each warp sums its slice of
  // every row of the round, without waiting for the others; then a thread per (row, batch row) adds
  // the row's slices in warp order.
  if (lane == 0) long_count[warp] = my_long_rows;
  if (!__syncthreads_or(my_long_rows > 0)) return;
  int total_long = 0;
  for (int w = 0; w < kWarps; ++w) total_long += long_count[w];
  A* slice_sums = partial;  // [row of the round][warp][batch row]
  const int round_rows = 32 * stride / kTile;
  // The (warp, list entry) of deferred row e, in the block's fixed order.
  auto entry = [&](int e, int& w, int& i) {
    for (w = 0; e >= long_count[w]; ++w) e -= long_count[w];
    i = e;
  };
  for (int e0 = 0; e0 < total_long; e0 += round_rows) {  // block-uniform
    const int round_end = total_long - e0 < round_rows ? total_long : e0 + round_rows;
    for (int e = e0; e < round_end; ++e) {
      int w, i;
      entry(e, w, i);
      const int32_t rb = long_range[w][i][0], re = long_range[w][i][1];
      const int32_t slice = int32_t(ceil_div(re - rb, kWarps * kWideSlots)) * kWideSlots;
      const int32_t lo = rb + warp * slice;
#pragma unroll
      for (int j = 0; j < kTile; ++j) acc[j] = A(0);
      walk(lo, lo + slice < re ? lo + slice : re, false, std::false_type{});
      // Back to batch order before the lanes are summed (lanes of another rot hold other rows in acc[j]).
      A sum[kTile];
#pragma unroll
      for (int j = 0; j < kTile; ++j) {
        sum[j] = acc[j];
#pragma unroll
        for (int r = 1; r < kPieces; ++r)
          if (rot == r) sum[j] = acc[j ^ (r * kE)];
      }
#pragma unroll
      for (int j = 0; j < kTile; ++j)
        for (int offset = 16; offset > 0; offset >>= 1) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], offset);
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < kTile; ++j) slice_sums[((e - e0) * kWarps + warp) * kTile + j] = sum[j];
      }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < (round_end - e0) * kTile; t += kThreads) {
      const int b = t % kTile;
      if (b >= tile_rows) continue;
      int w, i;
      entry(e0 + t / kTile, w, i);
      const int64_t o = long_rows[w][i];
      A total = A(0);
      for (int v = 0; v < kWarps; ++v) total += slice_sums[((t / kTile) * kWarps + v) * kTile + b];
      if (bias) total += to_accum(bias[o]);
      y[(b0 + b) * out_dim + o] = from_accum<T>(apply_activation(total, act));
    }
    __syncthreads();
  }
}

}  // namespace snack::cuda::detail
