// The SDDMM kernels (slot, vector, rows) and the bias-gradient kernel, each with an epilogue from
// epilogues.cuh. Each output is reduced by one thread in a fixed order: bitwise reproducible.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cuda_utils.cuh"
#include "../device/transpose.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/pattern.h"

namespace snack::cuda {
namespace {

using detail::accum_t;
using detail::to_accum;
constexpr int kThreads = detail::kSddmmThreads;

// One thread per slot; neighbouring threads share a row, so dY[n, r] is mostly a broadcast.
template <typename T, typename Index, typename Out>
__global__ void __launch_bounds__(kThreads) sddmm_thread_slot_kernel(SlotPattern<Index> w, const T* __restrict__ dy,
                                                                     const T* __restrict__ x, int64_t n, Out out) {
  out.begin();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < w.nnz; s += stride) {
    const auto fetched = out.fetch(s);
    const int64_t r = __ldg(w.row_idx + s), c = __ldg(w.col_idx + s);
    accum_t<T> acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += to_accum(dy[i * w.rows + r]) * to_accum(x[i * w.cols + c]);
    out.apply(s, acc, fetched);
  }
}

// dv[s] = <dy_t[row(s)], x_t[col(s)]> with both operands transposed to rows of np (a multiple of 4)
// batch values, so one slot's two vectors are contiguous: G lanes per slot read them as 16-byte
// vectors, 32 / G slots per warp, and a fixed butterfly sums the G lanes (deterministic).
// Consecutive slots share a row, so dy_t[row] is reused from L1.
template <typename T, typename Index, int G, typename Out>
__global__ void __launch_bounds__(kThreads) sddmm_vector_kernel(SlotPattern<Index> w, const T* __restrict__ dy_t,
                                                                const T* __restrict__ x_t, int64_t np, Out out) {
  using A = accum_t<T>;
  constexpr int kSlotsPerWarp = 32 / G;
  constexpr int kUnrollSlots = detail::kSddmmVectorSlotsPerLane;
  const int lane = threadIdx.x & 31, g = lane % G, slot_lane = lane / G;
  const int64_t warp_global = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warp_count = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t per_step = int64_t(kSlotsPerWarp) * kUnrollSlots;
  detail::wait_for_prior_grid();  // dy_t and x_t come from the transposes just before
  out.begin();
  for (int64_t s0 = warp_global * per_step; s0 < w.nnz; s0 += warp_count * per_step) {
    A acc[kUnrollSlots];
    int64_t r[kUnrollSlots], c[kUnrollSlots];
    typename Out::Fetched fetched[kUnrollSlots];
#pragma unroll
    for (int u = 0; u < kUnrollSlots; ++u) {
      const int64_t slot = s0 + u * kSlotsPerWarp + slot_lane;
      const bool ok = slot < w.nnz;
      r[u] = ok ? int64_t(w.row_idx[slot]) : 0;
      c[u] = ok ? int64_t(w.col_idx[slot]) : 0;
      if (ok && g == 0) fetched[u] = out.fetch(slot);
      acc[u] = A(0);
    }
#pragma unroll
    for (int u = 0; u < kUnrollSlots; ++u) {
      for (int64_t k = 4 * g; k < np; k += 4 * G) {
        A a[4], b[4];
        detail::load_vec<T, 4>(dy_t + r[u] * np + k, a);
        detail::load_vec<T, 4>(x_t + c[u] * np + k, b);
        acc[u] += detail::dot4(a, b);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnrollSlots; ++u) {
#pragma unroll
      for (int offset = 1; offset < G; offset <<= 1) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], offset);
      const int64_t slot = s0 + u * kSlotsPerWarp + slot_lane;
      if (g == 0 && slot < w.nnz) out.apply(slot, acc[u], fetched[u]);
    }
  }
}

// Four consecutive indices, widened (one 8- or 16-byte load; the caller guarantees alignment).
template <typename Index>
__device__ __forceinline__ void load_index4(const Index* __restrict__ p, int32_t* out) {
  if constexpr (sizeof(Index) == 2) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    out[0] = int32_t(q.x & 0xffffu); out[1] = int32_t(q.x >> 16);
    out[2] = int32_t(q.y & 0xffffu); out[3] = int32_t(q.y >> 16);
  } else {
    static_assert(sizeof(Index) == 4, "indices are 16 or 32 bits");
    const int4 q = __ldg(reinterpret_cast<const int4*>(p));
    out[0] = q.x; out[1] = q.y; out[2] = q.z; out[3] = q.w;
  }
}

// The same products over the rows of W, for np <= 4 GN NC (x_t: [cols, np], zero past n; the SDDMM's
// own transpose, or the forward's copy): a warp takes rows_per_warp rows at a time and
// lanes_per_row lanes of each split the row's slots in groups of 4 (one vector load of the
// column indices per group). GN lanes along the batch each hold NC chunks of 4 values of the row's
// dY column, read in place from dy [n, rows] (kept in registers for the whole row: chunk c covers
// batch values 4 (GN c + lane_n) .. + 3; a row's 4 n values are strided, but the rows of a block
// are neighbours, so their reads share sectors and no transpose of dY is needed); every slot's x_t
// vectors are gathered through L1, as in the forward's global_xt. A lane's kU slots
// are then summed over the GN batch lanes by a reduce-scatter: each round of shuffles halves the
// values a lane holds (kU - kU / GN shuffles instead of kU log2 GN); rounds past one value per lane
// are butterfly rounds. The rounds add at lane distance 1, 2, 4, the order of sddmm_vector_kernel's
// butterfly, so for NC = 1 (np <= 32) the results are bitwise equal to it.
// The column indices of the next kU slots are requested before this chunk's gathers.
// With with_bias, bias_out also receives each row's bias gradient db[o] = sum_n dY[n, o] (the
// row's dY is in registers already; bias_grad_kernel's work without its launch).
template <typename T, typename Index, int GN, int NC, typename Out>
__global__ void __launch_bounds__(kThreads, detail::kSddmmRowsBlocksPerSm)
    sddmm_rows_kernel(SlotPattern<Index> w, bool vector_ok, const T* __restrict__ dy, int64_t n,
                      const T* __restrict__ x_t, int64_t np, int lanes_per_row, Out out, Out bias_out, bool with_bias) {
  using A = accum_t<T>;
  constexpr int kGroup = 4;
  constexpr int kU = detail::rows_slots_per_lane(GN, NC, Out::kUpdatesState);
  constexpr int kG = kU / kGroup;
  constexpr int GS = 32 / GN;
  constexpr int kKept = kU >= GN ? kU / GN : 1;  // sums a lane holds after the reduction
  static_assert(GN >= 1 && GN <= 8 && NC >= 1, "up to 8 batch lanes");
  const int lane = threadIdx.x & 31;
  const int lane_n = lane % GN, lane_s = lane / GN;
  const int sub = lane_s / lanes_per_row, lane_e = lane_s % lanes_per_row;
  const int rows_per_warp = GS / lanes_per_row;
  const int64_t warp_global = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warp_count = (int64_t(gridDim.x) * blockDim.x) >> 5;
  // Which of the kU slots this lane's kept sums belong to (a scatter round keeps the upper half
  // where the lane's batch bit is set), and whether it stores them (after butterfly rounds the
  // partner lanes hold the same sums: the one with those bits clear stores).
  int kept_first = 0;
  bool stores = true;
#pragma unroll
  for (int r = 0; (1 << r) < GN; ++r) {
    const bool upper = (lane_n >> r) & 1;
    if ((kU >> (r + 1)) >= 1) kept_first += upper ? (kU >> (r + 1)) : 0;
    else stores = stores && !upper;
  }
  detail::wait_for_prior_grid();  // x_t comes from the transpose just before
  out.begin();

  // Column indices of the kU slots of groups g0, g0 + g_step, ...; -1 for slots outside [lo, hi).
  auto load_cols = [&](int32_t g0, int g_step, int32_t lo, int32_t hi, int32_t (&col)[kU]) {
#pragma unroll
    for (int u = 0; u < kG; ++u) {
      const int32_t e0 = kGroup * (g0 + u * g_step);
      int32_t* c = col + u * kGroup;
      if (vector_ok && e0 >= lo - (kGroup - 1) && e0 < hi && e0 <= w.nnz - kGroup) {
        load_index4(w.col_idx + e0, c);
#pragma unroll
        for (int i = 0; i < kGroup; ++i) c[i] = e0 + i >= lo && e0 + i < hi ? c[i] : -1;
      } else {
#pragma unroll
        for (int i = 0; i < kGroup; ++i) c[i] = e0 + i >= lo && e0 + i < hi ? int32_t(w.col_idx[e0 + i]) : -1;
      }
    }
  };

  for (int64_t o_base = warp_global * rows_per_warp; o_base < w.rows; o_base += warp_count * rows_per_warp) {
    const int64_t o = o_base + sub;
    const bool row_ok = o < w.rows;
    const int32_t lo = row_ok ? w.row_ptr[o] : 0, hi = row_ok ? w.row_ptr[o + 1] : 0;
    const int32_t g_end = lo < hi ? hi / kGroup + (hi % kGroup != 0) : 0;
    const int g_step = lanes_per_row;
    A a[NC][4];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int64_t k = 4 * (int64_t(GN) * c + lane_n);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        a[c][j] = row_ok && (lo < hi || with_bias) && k + j < n ? to_accum(dy[(k + j) * w.rows + o]) : A(0);
    }
    if (with_bias) {  // warp-uniform: every lane takes part in the shuffles
      A db = A(0);
#pragma unroll
      for (int c = 0; c < NC; ++c) {
#pragma unroll
        for (int j = 0; j < 4; ++j) db += a[c][j];
      }
#pragma unroll
      for (int offset = 1; offset < GN; offset <<= 1) db += __shfl_xor_sync(0xffffffffu, db, offset);
      if (row_ok && lane_n == 0 && lane_e == 0) {
        // The step constants per row, not per kernel: a warp meets a few rows, and registers kept
        // through the slot loop would cost more.
        Out bias_epilogue = bias_out;
        bias_epilogue.begin();
        bias_epilogue.apply(o, db, bias_epilogue.fetch(o));
      }
    }
    // Every lane runs the warp's longest chunk count: the shuffles need all lanes.
    int32_t g0 = lo / kGroup + lane_e;
    int32_t chunks = g_end > g0 ? (g_end - g0 + kG * g_step - 1) / (kG * g_step) : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) chunks = max(chunks, __shfl_xor_sync(0xffffffffu, chunks, offset));
    int32_t col[kU];
    load_cols(g0, g_step, lo, hi, col);
    for (int32_t step = 0; step < chunks; ++step, g0 += kG * g_step) {
      int32_t next_col[kU];
      load_cols(g0 + kG * g_step, g_step, lo, hi, next_col);
      // The slots whose sums this lane keeps, and what the epilogue needs of them.
      int32_t kept_slot[kKept];
      typename Out::Fetched fetched[kKept];
#pragma unroll
      for (int i = 0; i < kKept; ++i) {
        const int u = kept_first + i;
        kept_slot[i] = kGroup * (g0 + (u / kGroup) * g_step) + u % kGroup;
        if (stores && kept_slot[i] >= lo && kept_slot[i] < hi) fetched[i] = out.fetch(kept_slot[i]);
      }
      A part[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        part[u] = A(0);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int64_t k = 4 * (int64_t(GN) * c + lane_n);
          if (col[u] >= 0 && k < np) {
            A b[4];
            detail::load_vec<T, 4>(x_t + int64_t(col[u]) * np + k, b);
            part[u] += detail::dot4(a[c], b);
          }
        }
      }
#pragma unroll
      for (int r = 0; (1 << r) < GN; ++r) {
        const int half = kU >> (r + 1);  // a constant once the loop is unrolled
        if (half >= 1) {  // reduce-scatter round
          const bool upper = (lane_n >> r) & 1;
#pragma unroll
          for (int i = 0; i < half; ++i) {
            const A keep = upper ? part[half + i] : part[i];
            const A send = upper ? part[i] : part[half + i];
            part[i] = keep + __shfl_xor_sync(0xffffffffu, send, 1 << r);
          }
        } else {  // butterfly round
          part[0] += __shfl_xor_sync(0xffffffffu, part[0], 1 << r);
        }
      }
      if (stores) {
#pragma unroll
        for (int i = 0; i < kKept; ++i) {
          if (kept_slot[i] >= lo && kept_slot[i] < hi) out.apply(kept_slot[i], part[i], fetched[i]);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) col[u] = next_col[u];
    }
  }
}

// db[r] = sum_n dy[n, r], handed to the same epilogues as the SDDMM's (stored, or AdamW's step). A
// block per 32 columns, a lane per column, its 32 warps splitting the rows (a thread per column alone
// left a training batch latency-bound: 768 columns, N = 8192 ran on 3 SMs); the warps' partial
// sums are added in a fixed order, so the result does not depend on the launch.
constexpr int kBiasColumns = 32;
constexpr int kBiasWarps = 32;
template <typename T, typename Out>
__global__ void __launch_bounds__(kBiasColumns * kBiasWarps) bias_grad_kernel(const T* __restrict__ dy, int64_t n,
                                                                              int64_t m, Out out) {
  __shared__ accum_t<T> partial[kBiasWarps][kBiasColumns + 1];
  out.begin();
  const int lane = int(threadIdx.x % kBiasColumns), warp = int(threadIdx.x / kBiasColumns);
  for (int64_t c0 = int64_t(blockIdx.x) * kBiasColumns; c0 < m; c0 += int64_t(gridDim.x) * kBiasColumns) {
    const int64_t r = c0 + lane;
    accum_t<T> acc = 0;
    if (r < m) {
#pragma unroll 4
      for (int64_t i = warp; i < n; i += kBiasWarps) acc += to_accum(dy[i * m + r]);
    }
    partial[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && r < m) {
      const auto fetched = out.fetch(r);
      accum_t<T> sum = 0;
      for (int w = 0; w < kBiasWarps; ++w) sum += partial[w][lane];
      out.apply(r, sum, fetched);
    }
    __syncthreads();
  }
}

// kDenseBlocks: the slots of rows [first_row, first_row + rows) read out of the caller's dense block
// g = dY[:, rows]^T X ([rows, ld]): a warp per row, its lanes along the row's slots.
template <typename T, typename Index, typename Out>
__global__ void __launch_bounds__(kThreads) sddmm_from_block_kernel(const int32_t* __restrict__ row_ptr,
                                                                    const Index* __restrict__ col_idx,
                                                                    const T* __restrict__ g, int64_t ld,
                                                                    int64_t first_row, int64_t rows, Out out) {
  out.begin();
  const int lane = int(threadIdx.x & 31);
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t r = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; r < rows; r += warps) {
    const T* g_row = g + r * ld;
    const int32_t end = row_ptr[first_row + r + 1];
    for (int32_t s = row_ptr[first_row + r] + lane; s < end; s += 32) {
      const auto fetched = out.fetch(s);
      out.apply(s, to_accum(g_row[col_idx[s]]), fetched);
    }
  }
}

// The SDDMM kernel after it is launched programmatically: it starts at once and waits for this grid
// (griddepcontrol.wait) before it reads the counts.
__global__ void advance_counts_kernel(detail::StepCounts counts) {
  detail::allow_dependent_launch();
  counts.advance();
}

}  // namespace
}  // namespace snack::cuda
