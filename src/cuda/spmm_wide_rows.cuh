// The wide_rows forward SpMM kernel: a batch of one row, W's slot arrays read with 16-byte loads.
//
// Why a kernel of its own: the row kernels (spmm_kernels.cuh) give each lane one slot of a row at a
// time, so at one batch row their loads of W are 4- and 2-byte scalars whose chain (row pointer ->
// slots -> X) keeps little of W in flight, and X's row is gathered through L1, where the stream of W
// evicts it (H200, 16384x4096 at 90%: ~1.6 TB/s of W, docs/kernels.md). Here a warp owns a group of
// consecutive rows, whose slots are one contiguous range: each lane reads 8 consecutive slots (values
// and indices as 16-byte vectors) per chunk, the next chunk requested before the current one is used,
// and X's row sits in shared memory, whose gathers cost a few bank cycles per warp instead of an L1
// wavefront per slot.
#pragma once

#include "spmm_kernels.cuh"

namespace snack::cuda::detail {

constexpr int kWideThreads = 256;
constexpr int kWideWarps = kWideThreads / 32;
constexpr int kWideSlots = 8;                        // consecutive slots per lane per chunk
constexpr int kWideChunk = 32 * kWideSlots;          // slots per warp per chunk
constexpr int kWideMaxRows = 16;                     // rows per warp group, at most
constexpr int kWidePartialStride = kWideMaxRows + 1; // odd: a row's 32 lane partials fall in 32 banks
constexpr int kWideXPerThread = 8;                   // X values a thread stages per round
constexpr int kWideMinBlocks = 4;                    // blocks per SM its 64-register bound allows
constexpr int kWideLongPerWarp = 8;                  // long rows a warp can hand to its block

// Dynamic shared memory of the kernel: X's row (in_dim values), rounded up to 16 bytes.
__host__ __device__ inline size_t wide_rows_smem_bytes(size_t value_bytes, int64_t in_dim) {
  return (size_t(in_dim) * value_bytes + 15) / 16 * 16;
}

// Static shared memory of the kernel (per-lane partial sums, the groups' row pointers, the list of
// deferred long rows).
template <typename T>
constexpr size_t wide_rows_static_smem() {
  return sizeof(accum_t<T>) * kWideWarps * 32 * kWidePartialStride +
         sizeof(int32_t) * kWideWarps * (kWideMaxRows + 1 + 3 * kWideLongPerWarp + 1);
}

// One lane's chunk: kWideSlots consecutive slots, values widened, indices as loaded (packed words).
template <typename T, typename Index>
struct WideChunk {
  static constexpr int kIndexWords = kWideSlots * int(sizeof(Index)) / 4;
  accum_t<T> val[kWideSlots];
  uint32_t idx[kIndexWords];
  __device__ __forceinline__ int32_t column(int u) const {
    if constexpr (sizeof(Index) == 2) {
      return int32_t((idx[u / 2] >> (16 * (u & 1))) & 0xffffu);
    } else {
      return int32_t(idx[u]);
    }
  }
  // Slots [s, s + kWideSlots): 16-byte vectors where `vec` (both arrays 16-byte aligned) and the chunk
  // lies inside the arrays, else scalars; slots past nnz read as value 0, column 0.
  __device__ __forceinline__ void load(const T* __restrict__ values, const Index* __restrict__ col_idx, int32_t s,
                                       int32_t nnz, bool vec) {
    if (vec && s + kWideSlots <= nnz) {
      load_vec<T, kWideSlots>(values + s, val);
      const uint4* p = reinterpret_cast<const uint4*>(col_idx + s);
#pragma unroll
      for (int q = 0; q < kIndexWords / 4; ++q) {
        const uint4 w = __ldg(p + q);
        idx[4 * q] = w.x; idx[4 * q + 1] = w.y; idx[4 * q + 2] = w.z; idx[4 * q + 3] = w.w;
      }
    } else {
#pragma unroll
      for (int u = 0; u < kIndexWords; ++u) idx[u] = 0;
#pragma unroll
      for (int u = 0; u < kWideSlots; ++u) {
        const bool ok = s + u < nnz;
        val[u] = ok ? to_accum(load_ro(values + s + u)) : accum_t<T>(0);
        const uint32_t c = ok ? uint32_t(load_ro(col_idx + s + u)) : 0u;
        if constexpr (sizeof(Index) == 2) {
          idx[u / 2] |= c << (16 * (u & 1));
        } else {
          idx[u] = c;
        }
      }
    }
  }
};

// y[b, o] = act(sum_s values[s] x[b, col_idx[s]] + bias[o]) for the batch row b = batch0 + blockIdx.y.
//
// Rows are taken in groups of rows_per_warp (<= kWideMaxRows) consecutive rows, one group per warp at
// a time (groups strided over the grid's warps). A lane walks the group's slot range in chunks of 8
// slots (lane l: slots start + 8 l .. + 7, then + 256), keeps one running sum, and parks it in its
// column of `partial` when its slots move on to the next row; the group's rows are then summed over
// the 32 lanes in lane order.
// A row longer than long_threshold would keep its warp busy long after the others (power-law row
// lengths): the warp walks around the first such row of its group and hands it to its block (up to
// kWideLongPerWarp rows per warp, the first ones in the warp's fixed order of groups); once their
// groups are done, each of the block's 8 warps sums a slice of every such row, and the slices are
// added in warp order.
// Every sum has a fixed order: the result is bitwise reproducible.
// `vec`: values and col_idx are 16-byte aligned (else every slot is a scalar load).
template <typename T, typename Index>
__global__ void __launch_bounds__(kWideThreads, kWideMinBlocks)
    spmm_wide_rows_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx,
                          const T* __restrict__ values, int32_t nnz, int64_t out_dim, int64_t in_dim,
                          const T* __restrict__ x, int64_t batch0, const T* __restrict__ bias, T* __restrict__ y,
                          Activation act, int rows_per_warp, int32_t long_threshold, bool vec) {
  using A = accum_t<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);
  __shared__ A partial[kWideWarps][32 * kWidePartialStride];
  __shared__ int32_t bounds[kWideWarps][kWideMaxRows + 1];
  __shared__ int32_t long_rows[kWideWarps][kWideLongPerWarp];   // a deferred row,
  __shared__ int32_t long_range[kWideWarps][kWideLongPerWarp][2];  // and its slots [begin, end)
  __shared__ int long_count[kWideWarps];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t b = batch0 + blockIdx.y;
  const T* xrow = x + b * in_dim;
  T* yrow = y + b * out_dim;
  const int64_t groups = ceil_div(out_dim, rows_per_warp);
  const int64_t warp_count = int64_t(gridDim.x) * kWideWarps;
  A* my_partial = partial[warp] + lane * kWidePartialStride;
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
  int64_t g = int64_t(blockIdx.x) * kWideWarps + warp;
  int32_t bnd = load_bounds(g);
  {
    const int cols = int(in_dim);  // fits in shared memory, so far below 2^31
    int c0 = threadIdx.x;
    T xv[kWideXPerThread];
#pragma unroll
    for (int u = 0; u < kWideXPerThread; ++u) {
      const int c = c0 + u * kWideThreads;
      xv[u] = c < cols ? xrow[c] : T{};
    }
    if (g < groups) load_first_chunk(g, bnd);
    for (;;) {
#pragma unroll
      for (int u = 0; u < kWideXPerThread; ++u) {
        const int c = c0 + u * kWideThreads;
        if (c < cols) xs[c] = xv[u];
      }
      c0 += kWideXPerThread * kWideThreads;
      if (c0 >= cols) break;
#pragma unroll
      for (int u = 0; u < kWideXPerThread; ++u) {
        const int c = c0 + u * kWideThreads;
        xv[u] = c < cols ? xrow[c] : T{};
      }
    }
  }
  __syncthreads();

  A acc = A(0);
  int k = 0;            // this lane's current row in its warp's group
  int32_t row_end = 0;  // and where that row ends
  // Adds slots [lo, hi) into acc; with track_rows, acc is parked in my_partial[k] whenever the
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
            my_partial[k] = acc;
            acc = A(0);
            ++k;
            row_end = bounds[warp][k + 1];
          }
        }
        acc += cur.val[u] * to_accum(xs[cur.column(u)]);
      }
      cur = next;
    }
  };

  for (; g < groups; g += warp_count) {
    const int rows = group_rows(g);
    if (lane <= rows) bounds[warp][lane] = bnd;
    for (int r = 0; r < rows; ++r) my_partial[r] = A(0);
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

    acc = A(0);
    k = 0;
    row_end = bounds[warp][1];
    if (deferred < 0) {
      walk(begin, end, true, std::true_type{});
    } else {
      walk(begin, deferred_begin, true, std::true_type{});
      walk(deferred_end, end, false, std::true_type{});
    }
    my_partial[k] = acc;
    __syncwarp();
    if (lane < rows && lane != deferred) {
      A total = A(0);
      for (int j = 0; j < 32; ++j) total += partial[warp][j * kWidePartialStride + lane];
      const int64_t o = g * rows_per_warp + lane;
      if (bias) total += to_accum(bias[o]);
      yrow[o] = from_accum<T>(apply_activation(total, act));
    }
    __syncwarp();

    if (g + warp_count < groups) load_first_chunk(g + warp_count, bnd);
  }

  // The deferred rows: each warp sums its slice of every one, without waiting for the others; then
  // a thread per row adds the row's slices in warp order.
  if (lane == 0) long_count[warp] = my_long_rows;
  if (!__syncthreads_or(my_long_rows > 0)) return;
  A* slice_sums = &partial[0][0];  // [warp that deferred the row][its list entry][slice]
  static_assert(kWideWarps * kWideLongPerWarp * kWideWarps <= kWideWarps * 32 * kWidePartialStride);
  for (int w = 0; w < kWideWarps; ++w) {  // block-uniform
    for (int i = 0; i < long_count[w]; ++i) {
      const int32_t rb = long_range[w][i][0], re = long_range[w][i][1];
      const int32_t slice = int32_t(ceil_div(re - rb, kWideWarps * kWideSlots)) * kWideSlots;
      const int32_t lo = rb + warp * slice;
      acc = A(0);
      walk(lo, lo + slice < re ? lo + slice : re, false, std::false_type{});
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if (lane == 0) slice_sums[(w * kWideLongPerWarp + i) * kWideWarps + warp] = acc;
    }
  }
  __syncthreads();
  const int w = threadIdx.x / kWideLongPerWarp, i = threadIdx.x % kWideLongPerWarp;
  if (w < kWideWarps && i < long_count[w]) {
    const int64_t o = long_rows[w][i];
    A total = A(0);
    for (int v = 0; v < kWideWarps; ++v) total += slice_sums[threadIdx.x * kWideWarps + v];
    if (bias) total += to_accum(bias[o]);
    yrow[o] = from_accum<T>(apply_activation(total, act));
  }
}

}  // namespace snack::cuda::detail
