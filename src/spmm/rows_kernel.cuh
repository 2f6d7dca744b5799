// The row kernel of the SpMM, shared by the forward (Y = X W^T over the CSR view) and the transposed
// product (dX = dY W over the CSC view): the global_x and global_xt variants.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "views.cuh"

namespace snack::cuda::detail {

// Where a row kernel reads its input X from (the template argument kX of spmm_rows_kernel).
enum class XLayout {
  kTransposed = 1,  // a transposed copy of the tile, [in_dim, NPAD], read as vectors through L1
  kRowMajor = 2,    // X itself, row-major, one scalar per batch row through L1: no copy, no extra launch
};

// out[n, o] = sum_e value(e) * in[n, input(e)] (+ bias[o]) for n in [n0, n0 + NPAD) ∩ [0, n).
//
// Lanes: see TileLayout; the GS lanes along the entries split one output row (or `rows_per_warp`
// rows) and walk it in chunks of kU entries each, the next chunk requested before the current one
// is used (so up to 2 kU entries per lane are in flight).
// kTransposed: `in` is the transposed tile [in_dim + 1, NPAD] in global memory (row in_dim zero):
//        one entry's NPAD inputs are contiguous, read with vector loads through L1.
// kRowMajor: `in` is X as given; a lane reads its V batch rows' values of one entry as V scalars
//        (rows past the batch read the last row and are never stored).
// prefetch_nnz > 0 (small products, whose time is the latency of their first misses): each block
//        first asks L2 for its share of the slot arrays (prefetch_nnz entries) and, for kRowMajor,
//        of the batch tile of X, so that the loads that follow do not each wait for HBM.
// kTransposed reads the output of the transpose kernel launched just before it, possibly with
//        programmatic serialization: the prefetch overlaps that kernel, the reads of `in` wait for it.
template <typename T, typename View, int NPAD, XLayout kX>
__global__ void __launch_bounds__(kSpmmWarps * 32, kRowsBlocksPerSm)
    spmm_rows_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in, int64_t n,
                     const T* __restrict__ bias, T* __restrict__ out, int lanes_per_row, int32_t long_threshold,
                     Activation act, int64_t prefetch_nnz) {
  using A = accum_t<T>;
  constexpr int kWarps = kSpmmWarps;
  constexpr int V = TileLayout<NPAD>::V;
  constexpr int GN = TileLayout<NPAD>::GN;
  constexpr int GS = TileLayout<NPAD>::GS;
  // blockIdx.y picks the batch tile: rows n0 .. n0 + NPAD of the batch.
  const int64_t n0 = int64_t(blockIdx.y) * NPAD;
  if constexpr (kX == XLayout::kTransposed) in += int64_t(blockIdx.y) * (in_dim + 1) * NPAD;  // this tile's copy

  if (prefetch_nnz > 0) {
    if (threadIdx.x == 0) view.prefetch_l2(prefetch_nnz);
    if constexpr (kX == XLayout::kRowMajor) {
      if (threadIdx.x == 32) {
        const int64_t rows = (n - n0) < NPAD ? (n - n0) : NPAD;
        const int64_t bytes = rows * in_dim * int64_t(sizeof(T));
        const int64_t chunk = (bytes + gridDim.x - 1) / gridDim.x;
        const int64_t begin = int64_t(blockIdx.x) * chunk;
        prefetch_l2(in + n0 * in_dim, begin, begin + chunk < bytes ? begin + chunk : bytes);
      }
    }
  }
  if constexpr (kX == XLayout::kTransposed) wait_for_prior_grid();


  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int lane_n = lane % GN;        // which batch rows
  const int lane_s = lane / GN;        // which entries (0..GS-1)
  const int sub = lane_s / lanes_per_row;  // which of the warp's rows
  const int lane_e = lane_s % lanes_per_row;
  const int rows_per_warp = GS / lanes_per_row;
  const int leader = sub * lanes_per_row * GN;  // first lane of this row's lanes
  // kRowMajor: this lane's first row of X and how many of its V rows exist; the rows past the batch
  // re-read the last one (those sums are never stored).
  const int64_t x_row0 = n0 + lane_n * V < n ? n0 + lane_n * V : n - 1;
  const T* x_first = in + x_row0 * in_dim;
  const int x_last = int(n - 1 - x_row0 < V - 1 ? n - 1 - x_row0 : V - 1);
  const int64_t warp_global = int64_t(blockIdx.x) * kWarps + warp;
  const int64_t warp_count = int64_t(gridDim.x) * kWarps;

  // Rows longer than long_threshold would keep one warp busy long after the others: each warp
  // defers up to kLongPerWarp of them, and the whole block sums each deferred row afterwards
  // (every warp a slice, then a fixed-order reduction), so the result stays deterministic.
  __shared__ int32_t long_rows[kWarps * kLongPerWarp];
  __shared__ int long_count[kWarps];
  __shared__ A partial[kWarps][NPAD];
  if (lane == 0) long_count[warp] = 0;
  __syncwarp();

  // Sum of value(e) * in[., input(e)] over e = first, first + step, ... < last, for this lane's batch rows.
  // Entries per lane per chunk: kUnroll, halved where one entry means V scalar reads of X (each
  // with its own 64-bit address) or where values are 8 bytes (fp64, the gradcheck type): both
  // would otherwise spill under the 64-register bound.
  constexpr int kU = ((kX == XLayout::kRowMajor && V > 2) || sizeof(A) == 8) ? kUnroll / 2 : kUnroll;
  // Software-pipelined: the next kU entries (value and column) are requested before this
  // chunk's inputs are gathered, so the stream of W from HBM stays in flight during the gathers.
  // Entries past the range must add nothing, even where an input is infinite or NaN (0 * inf is
  // NaN): the transposed copy of X has a zero slot, input column in_dim, that they read instead;
  // X read in place has none, so there those entries (column -1) are skipped, and only in a lane's
  // last chunk of a range, the one that can hold them (a predicate per entry in every chunk cost 5%
  // at N = 1 and, on the transposed layout, up to 26% at N = 128 on the H200).
  const int32_t past_range = kX == XLayout::kRowMajor ? -1 : int32_t(in_dim);
  auto accumulate = [&](int32_t first, int32_t last, int step, A (&acc)[V]) {
    auto load_chunk = [&](int32_t e0, A (&val)[kU], int32_t (&col)[kU]) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int32_t e = e0 + u * step;
        const bool ok = e < last;
        val[u] = ok ? to_accum(view.value(e)) : A(0);
        col[u] = ok ? view.input(e) : past_range;
      }
    };
    A val[kU];
    int32_t col[kU];
    // Multiplies a chunk's entries into acc, skipping those of column -1 if skip_past_range.
    auto multiply_chunk = [&](auto skip_past_range) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if constexpr (decltype(skip_past_range)::value) {
          if (col[u] < 0) continue;
        }
        if constexpr (kX == XLayout::kRowMajor) {
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += val[u] * to_accum(load_ro(x_first + (j < x_last ? j : x_last) * in_dim + col[u]));
        } else {
          A x[V];
          load_vec<T, V>(in + int64_t(col[u]) * NPAD + lane_n * V, x);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += val[u] * x[j];
        }
      }
    };
    if (first < last) load_chunk(first, val, col);
    for (int32_t e0 = first; e0 < last; e0 += kU * step) {
      A next_val[kU];
      int32_t next_col[kU];
      load_chunk(e0 + kU * step, next_val, next_col);
      if constexpr (kX == XLayout::kRowMajor) {
        if (e0 + (kU - 1) * step < last) {
          multiply_chunk(std::false_type{});
        } else {
          multiply_chunk(std::true_type{});
        }
      } else {
        multiply_chunk(std::false_type{});
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        val[u] = next_val[u];
        col[u] = next_col[u];
      }
    }
  };
  auto write_row = [&](int64_t o, const A (&acc)[V]) {
    const A b = bias ? to_accum(bias[o]) : A(0);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t nn = n0 + lane_n * V + j;
      if (nn < n) out[nn * out_dim + o] = from_accum<T>(apply_activation(acc[j] + b, act));
    }
  };

  for (int64_t o_base = warp_global * rows_per_warp; o_base < out_dim; o_base += warp_count * rows_per_warp) {
    const int64_t o = o_base + sub;
    const bool row_ok = o < out_dim;
    int32_t begin = row_ok ? view.ptr[o] : 0;
    int32_t end = row_ok ? view.ptr[o + 1] : 0;
    bool deferred = false;
    const bool is_long = row_ok && end - begin > long_threshold;
    const unsigned longs = __ballot_sync(0xffffffffu, is_long && lane == leader);
    if (longs) {  // warp-uniform
      const int have = long_count[warp];
      const int rank = __popc(longs & ((1u << leader) - 1u));
      deferred = is_long && have + rank < kLongPerWarp;
      if (deferred && lane == leader) long_rows[warp * kLongPerWarp + have + rank] = int32_t(o);
      __syncwarp();
      if (lane == 0) long_count[warp] = min(kLongPerWarp, have + __popc(longs));
      __syncwarp();
      if (deferred) end = begin;  // still takes part in the shuffles below
    }
    A acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = A(0);
    accumulate(begin + lane_e, end, lanes_per_row, acc);
    // Sum over the lanes that split this row: their lane ids differ in the bits GN .. GN*lanes_per_row.
    for (int offset = GN; offset < GN * lanes_per_row; offset <<= 1) {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);
    }
    if (row_ok && !deferred && lane_e == 0) write_row(o, acc);
  }

  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    for (int i = 0; i < long_count[w]; ++i) {  // block-uniform
      const int64_t o = long_rows[w * kLongPerWarp + i];
      const int32_t begin = view.ptr[o], end = view.ptr[o + 1];
      const int32_t slice = (end - begin + kWarps - 1) / kWarps;
      const int32_t lo = begin + warp * slice;
      const int32_t hi = min(end, lo + slice);
      A acc[V];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = A(0);
      accumulate(lo + lane_s, hi, GS, acc);
      for (int offset = GN; offset < 32; offset <<= 1) {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], offset);
      }
      if (lane_s == 0) {
#pragma unroll
        for (int j = 0; j < V; ++j) partial[warp][lane_n * V + j] = acc[j];
      }
      __syncthreads();
      if (threadIdx.x < NPAD) {
        A total = bias ? to_accum(bias[o]) : A(0);
        for (int k = 0; k < kWarps; ++k) total += partial[k][threadIdx.x];
        const int64_t nn = n0 + threadIdx.x;
        if (nn < n) out[nn * out_dim + o] = from_accum<T>(apply_activation(total, act));
      }
      __syncthreads();
    }
  }
}


}  // namespace snack::cuda::detail
