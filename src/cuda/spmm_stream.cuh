// The `stream` forward SpMM: W's slot arrays streamed through shared memory by the bulk-copy engine,
// the products summed per row by a block-wide segmented scan. Built for a batch of one row, where
// the row kernels are bound by how much of W each SM keeps in flight with its threads' own loads
// (docs/kernels.md, "Batch 1: the stream kernel").
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <type_traits>

#include "cuda_utils.cuh"
#include "snack/activation_math.h"
#include "snack/pattern.h"

namespace snack::cuda::detail {

constexpr int kStreamThreads = 256;                            // threads per block
constexpr int kStreamItems = 8;                                // consecutive slots per thread per stage
constexpr int kStreamStage = kStreamThreads * kStreamItems;    // slots per stage
constexpr int kStreamStages = 4;                               // stages of the ring in shared memory
constexpr int kStreamSliceRows = 1024;                         // row pointers kept in shared memory
// Stages start at multiples of kStreamItems slots: 16-byte aligned for every value and index type.
static_assert(kStreamItems * sizeof(uint16_t) % 16 == 0, "a thread's slots must be whole 16-byte groups");

// Dynamic shared memory of the stream kernel: the ring of slot arrays, then the row of X.
template <typename T, typename Index>
constexpr size_t stream_ring_bytes() {
  return size_t(kStreamStages) * kStreamStage * (sizeof(T) + sizeof(Index));
}
inline size_t stream_smem_bytes(size_t value_bytes, size_t index_bytes, int64_t in_dim) {
  return size_t(kStreamStages) * kStreamStage * (value_bytes + index_bytes) +
         ((size_t(in_dim) * value_bytes + 15) & ~size_t(15));
}

// kStreamItems consecutive elements from shared memory (16-byte aligned), widened.
template <typename T, typename Out>
__device__ __forceinline__ void load_items_shared(const T* p, Out (&out)[kStreamItems]) {
  constexpr int kWords = kStreamItems * int(sizeof(T)) / 16;
  uint4 raw[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];
  const T* items = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int j = 0; j < kStreamItems; ++j) {
    if constexpr (std::is_integral_v<T>) {
      out[j] = Out(items[j]);
    } else {
      out[j] = to_accum(items[j]);
    }
  }
}

// (has a row boundary, value) pairs of the segmented sum: `later` after `earlier`.
template <typename A>
struct Segment {
  bool closed;
  A value;
};
template <typename A>
__device__ __forceinline__ Segment<A> combine(Segment<A> earlier, Segment<A> later) {
  return {earlier.closed || later.closed, later.closed ? later.value : earlier.value + later.value};
}

// The largest i in [0, rows] with rp[i] <= p, for rp[0] <= p (rp ascending: row pointers).
__device__ __forceinline__ int32_t last_row_at(const int32_t* rp, int32_t rows, int32_t p) {
  int32_t l = 0, h = rows + 1;
  while (h - l > 1) {
    const int32_t m = (l + h) >> 1;
    if (rp[m] <= p) l = m; else h = m;
  }
  return l;
}

// One output: y_row[o] = act(sum + bias[o]). Not inlined: the kernel calls it from several
// places, and its activation code would otherwise be copied into each of them.
template <typename T, typename A>
__device__ __noinline__ void stream_write_row(int64_t o, A sum, const T* __restrict__ bias, T* __restrict__ y_row,
                                              Activation act) {
  y_row[o] = from_accum<T>(apply_activation(sum + (bias ? to_accum(bias[o]) : A(0)), act));
}

// The products of a thread's slots p0 .. p0 + kStreamItems - 1 where some lie outside the block's
// [lo, hi) (those are 0, even against an infinite input: no 0 * inf), or where the ring does not
// hold them (`from_ring` false: the arrays' last partial 16-byte group, or unaligned arrays).
template <typename T, typename Index, typename A>
__device__ __forceinline__ void stream_edge_products(const T* __restrict__ values, const Index* __restrict__ col_idx,
                                                  const T* ring_values, const Index* ring_index, bool from_ring,
                                                  int32_t p0, int32_t lo, int32_t hi, const T* xs,
                                                  A (&q)[kStreamItems]) {
#pragma unroll
  for (int j = 0; j < kStreamItems; ++j) {
    const int32_t p = p0 + j;
    q[j] = A(0);
    if (p >= lo && p < hi) {
      const A v = to_accum(from_ring ? ring_values[j] : values[p]);
      q[j] = v * to_accum(xs[int32_t(from_ring ? ring_index[j] : col_idx[p])]);
    }
  }
}

// The general walk over a thread's slots when two or more rows end in them: rows that start and
// end inside are written; `head` gets the part of row `first` (open at p0), `run` the part of the
// row open at the end.
template <typename T, typename A>
__device__ __forceinline__ void stream_walk_rows(const A (&q)[kStreamItems], int32_t p0, int32_t first, int32_t rows,
                                              const int32_t* rp, int64_t r_lo, const T* __restrict__ bias,
                                              T* __restrict__ y_row, Activation act, A& head, A& run) {
  int32_t i = first;
  bool closed = false;
  A sum = A(0);
#pragma unroll
  for (int j = 0; j < kStreamItems; ++j) {
    const int32_t p = p0 + j;
    while (i < rows && rp[i + 1] <= p) {  // row i ends before p
      if (closed) stream_write_row(r_lo + i, sum, bias, y_row, act);
      else head = sum;
      closed = true;
      sum = A(0);
      ++i;
    }
    sum += q[j];
  }
  run = sum;
}

// y[b, o] = act(sum_s values[s] x[b, col_idx[s]] (+ bias[o])) over the rows' slots s, for the batch
// rows b = b0 + blockIdx.y.
//
// Work split: block j of the G = gridDim.x blocks of a batch row owns the rows [R_j, R_j+1), with
// R_j the row of slot j nnz / G: every block gets about nnz / G slots whatever the row lengths, and
// a row belongs to one block (no partial sums cross blocks). Its slots [lo, hi) are walked in
// stages of kStreamStage, copied into a ring of kStreamStages buffers by the bulk-copy engine
// (`bulk`: both slot arrays 16-byte aligned, sm_90) or, otherwise, read by the threads themselves;
// the row of X sits in shared memory. Thread t of a stage takes kStreamItems consecutive slots,
// multiplies them, sums the runs of equal rows, writes the rows that start and end in its slots,
// and hands its first and last runs to a segmented scan over the block, which completes the rows
// that cross threads (and, through a carry, stages). Every sum is taken in a fixed order: the
// result is bitwise reproducible.
template <typename T, typename Index>
__global__ void __launch_bounds__(kStreamThreads)
    spmm_stream_kernel(SlotPattern<Index> w, const T* __restrict__ values, const T* __restrict__ x, int64_t b0,
                       const T* __restrict__ bias, T* __restrict__ y, Activation act, bool bulk) {
  using A = accum_t<T>;
  constexpr int kWarps = kStreamThreads / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* ring_values = reinterpret_cast<T*>(smem_raw);
  Index* ring_index = reinterpret_cast<Index*>(smem_raw + size_t(kStreamStages) * kStreamStage * sizeof(T));
  T* xs = reinterpret_cast<T*>(smem_raw + stream_ring_bytes<T, Index>());
  __shared__ __align__(8) uint64_t filled[kStreamStages];
  __shared__ __align__(8) uint64_t x_filled;
  __shared__ int32_t slice[kStreamSliceRows + 1];
  __shared__ int64_t block_rows[2];
  __shared__ int32_t block_slots[2];
  __shared__ A warp_value[2][kWarps];
  __shared__ bool warp_closed[2][kWarps];
  __shared__ A stage_carry[2];

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t batch_row = b0 + blockIdx.y;
  const int64_t out_dim = w.rows, in_dim = w.cols;
  const int32_t nnz = int32_t(w.nnz);
  const int32_t nnz_bulk = bulk ? (nnz & ~(kStreamItems - 1)) : 0;  // whole 16-byte groups inside the arrays
  T* y_row = y + batch_row * out_dim;

  // The stage k of slots [base + k C, base + (k + 1) C) copied into ring buffer k % kStreamStages:
  // [base + k C, end), where end stops at the block's last 16-byte group and the arrays' last whole one.
  auto stage_end = [&](int32_t c0, int32_t hi) {
    return min(c0 + kStreamStage, min((hi + kStreamItems - 1) & ~(kStreamItems - 1), nnz_bulk));
  };
  auto issue = [&](int32_t k, int32_t base, int32_t hi) {  // one thread
    const int buf = k % kStreamStages;
    const int32_t c0 = base + k * kStreamStage;
    const int32_t c1 = stage_end(c0, hi);
    const uint32_t count = c1 > c0 ? uint32_t(c1 - c0) : 0u;
    mbarrier_arrive_expect_bytes(&filled[buf], count * uint32_t(sizeof(T) + sizeof(Index)));
    if (count) {
      bulk_copy_to_shared(ring_values + size_t(buf) * kStreamStage, values + c0, count * uint32_t(sizeof(T)),
                          &filled[buf]);
      bulk_copy_to_shared(ring_index + size_t(buf) * kStreamStage, w.col_idx + c0, count * uint32_t(sizeof(Index)),
                          &filled[buf]);
    }
  };
  auto first_row_of = [&](int64_t j) -> int64_t {  // R_j
    if (j == 0) return 0;
    if (j >= int64_t(gridDim.x) || nnz == 0) return out_dim;
    return int64_t(w.row_idx[j * int64_t(nnz) / int64_t(gridDim.x)]);
  };

  // The row of X: its 16-byte groups by a bulk copy where it is aligned, the rest by the threads.
  const T* x_row = x + batch_row * in_dim;
  const uint32_t x_bulk_bytes =
      bulk && reinterpret_cast<uintptr_t>(x_row) % 16 == 0 ? uint32_t(in_dim * int64_t(sizeof(T))) & ~15u : 0u;
  if (t == 0 && x_bulk_bytes) {  // first: every stage needs it
    mbarrier_init(&x_filled, 1);
    mbarrier_arrive_expect_bytes(&x_filled, x_bulk_bytes);
    bulk_copy_to_shared(xs, x_row, x_bulk_bytes, &x_filled);
  }
  if (t == 0) {
    const int64_t r_lo = first_row_of(blockIdx.x), r_hi = first_row_of(int64_t(blockIdx.x) + 1);
    const int32_t lo = w.row_ptr[r_lo], hi = w.row_ptr[r_hi];
    block_rows[0] = r_lo;
    block_rows[1] = r_hi;
    block_slots[0] = lo;
    block_slots[1] = hi;
    stage_carry[0] = A(0);
    if (bulk) {
      for (int s = 0; s < kStreamStages; ++s) mbarrier_init(&filled[s], 1);

      const int32_t base = lo & ~(kStreamItems - 1);
      const int32_t stages = hi > lo ? (hi - base) / kStreamStage + 1 : 0;
      for (int32_t k = 0; k < stages && k < kStreamStages; ++k) issue(k, base, hi);
    }
  }
#pragma unroll 4
  for (int32_t c = int32_t(x_bulk_bytes / sizeof(T)) + t; c < int32_t(in_dim); c += kStreamThreads)
    xs[c] = load_ro(x_row + c);
  __syncthreads();
  const int64_t r_lo = block_rows[0];
  const int32_t rows = int32_t(block_rows[1] - r_lo);
  const int32_t lo = block_slots[0], hi = block_slots[1];
  if (hi <= lo && x_bulk_bytes) mbarrier_wait(&x_filled, 0);  // no copy may outlive the block
  if (hi <= lo && rows == 0) return;
  const bool slice_shared = rows <= kStreamSliceRows;
  if (slice_shared)
    for (int32_t i = t; i <= rows; i += kStreamThreads) slice[i] = w.row_ptr[r_lo + i];
  __syncthreads();
  // rp[i] = row_ptr[r_lo + i], i in [0, rows]: rp[0] = lo, rp[rows] = hi.
  const int32_t* rp = slice_shared ? slice : w.row_ptr + r_lo;

  if (hi <= lo) {  // only empty rows
    for (int32_t i = t; i < rows; i += kStreamThreads) stream_write_row(r_lo + i, A(0), bias, y_row, act);
    return;
  }
  const int32_t base = lo & ~(kStreamItems - 1);
  // One stage more than the slots need when they end on a stage boundary: some thread then holds
  // position hi, which closes the block's last row and the empty rows after it.
  const int32_t stages = (hi - base) / kStreamStage + 1;
  for (int32_t k = 0; k < stages; ++k) {
    const int buf = k % kStreamStages;
    const int32_t c0 = base + k * kStreamStage;
    const int32_t p0 = c0 + t * kStreamItems;
    // The row open just before p0 (row 0 before the block's first slot, so that empty rows there
    // are closed at lo): the largest i with rp[i] <= p0 - 1. Searched before the wait for the slots.
    const int32_t first = p0 <= lo ? 0 : (slice_shared ? last_row_at(slice, rows, p0 - 1)
                                                       : last_row_at(w.row_ptr + r_lo, rows, p0 - 1));
    const int32_t first_end = first < rows ? (slice_shared ? slice[first + 1] : w.row_ptr[r_lo + first + 1])
                                           : INT32_MAX;
    if (k == 0 && x_bulk_bytes) mbarrier_wait(&x_filled, 0);  // (hi > lo: k = 0 runs)
    if (bulk) mbarrier_wait(&filled[buf], uint32_t(k / kStreamStages) & 1u);
    A q[kStreamItems];  // the products of this thread's slots; 0 outside [lo, hi)
    if (bulk && p0 >= lo && p0 + kStreamItems <= hi && p0 + kStreamItems <= stage_end(c0, hi)) {
      A v[kStreamItems];
      int32_t col[kStreamItems];
      load_items_shared(ring_values + size_t(buf) * kStreamStage + t * kStreamItems, v);
      load_items_shared(ring_index + size_t(buf) * kStreamStage + t * kStreamItems, col);
#pragma unroll
      for (int j = 0; j < kStreamItems; ++j) q[j] = v[j] * to_accum(xs[col[j]]);
    } else {
      stream_edge_products(values, w.col_idx, ring_values + size_t(buf) * kStreamStage + t * kStreamItems,
                           ring_index + size_t(buf) * kStreamStage + t * kStreamItems,
                           bulk && p0 + kStreamItems <= stage_end(c0, hi), p0, lo, hi, xs, q);
    }

    // Row `first` ends at first_end; one more row ending inside this thread's slots (short or
    // empty rows) takes the general walk.
    const bool closed = first_end < p0 + kStreamItems;
    A head = A(0), run = A(0);  // head: this thread's part of row `first` if it closes here; run: the open row's
    if (!closed) {
#pragma unroll
      for (int j = 0; j < kStreamItems; ++j) run += q[j];
    } else if (first + 1 >= rows ||
               (slice_shared ? slice[first + 2] : w.row_ptr[r_lo + first + 2]) >= p0 + kStreamItems) {
      const int32_t b = first_end - p0;  // slots of row `first` in this thread
#pragma unroll
      for (int j = 0; j < kStreamItems; ++j) {
        if (j < b) head += q[j]; else run += q[j];
      }
    } else {
      stream_walk_rows(q, p0, first, rows, rp, r_lo, bias, y_row, act, head, run);
    }

    // Segmented scan over the block: what the threads before this one hold of the row open at p0.
    // Within the warp: a lane adds the partial sum from d lanes below while no lane of its current
    // range has closed a row (the ranges double each step).
    const unsigned closed_lanes = __ballot_sync(0xffffffffu, closed);
    const unsigned upto_me = closed_lanes & (0xffffffffu >> (31 - lane));
    const int last_closed = upto_me ? 31 - __clz(upto_me) : -1;
    A inclusive = run;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const A below = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d && last_closed < lane - d + 1) inclusive = below + inclusive;
    }
    const int half = k & 1;
    if (lane == 31) {
      warp_value[half][warp] = inclusive;
      warp_closed[half][warp] = closed_lanes != 0;
    }
    __syncthreads();
    // Every thread has read its slots of buffer `buf`: it can be refilled.
    if (bulk && t == 0 && k + kStreamStages < stages) issue(k + kStreamStages, base, hi);
    Segment<A> before{true, stage_carry[half]};
    for (int u = 0; u < warp; ++u) before = combine(before, Segment<A>{warp_closed[half][u], warp_value[half][u]});
    const A below = __shfl_up_sync(0xffffffffu, inclusive, 1);
    if (lane > 0) before = combine(before, Segment<A>{(closed_lanes & ((1u << lane) - 1u)) != 0, below});
    if (closed) stream_write_row(r_lo + first, before.value + head, bias, y_row, act);
    if (t == kStreamThreads - 1) stage_carry[half ^ 1] = combine(before, Segment<A>{closed, run}).value;
  }
}

}  // namespace snack::cuda::detail
