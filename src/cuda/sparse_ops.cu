// CUDA SDDMM (the weight gradient at the stored slots) and the bias gradient. The SpMM products
// live in spmm.cu. Each output is reduced by one thread in a fixed order: bitwise reproducible.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../common/op_checks.h"
#include "cuda_utils.cuh"
#include "snack/ops.h"
#include "snack/optimizer_math.h"
#include "spmm_kernels.cuh"

namespace snack::cuda {
namespace {

using detail::accum_t;
using detail::check_launch;
using detail::from_accum;
using detail::grid_for;
using detail::to_accum;
using detail::warp_sum;
using detail::ceil_div;
using detail::device_limits;
using detail::DeviceLimits;

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

// What the SDDMM kernels do with a slot's gradient g (float accumulation): store it (sddmm), or
// apply AdamW's step to the slot's value with it at once (sddmm_adamw), so that the gradient never
// goes to memory. fetch(e) loads what apply(e, g, fetched) needs; the kernels issue it before they
// compute g, so its loads overlap the products. begin() runs once per thread after the kernel has
// waited for the grids before it.
template <typename T>
struct StoreGradient {
  static constexpr bool kUpdatesState = false;  // apply() writes only the gradient
  T* __restrict__ dvalues;
  struct Fetched {};
  float* count() const { return nullptr; }  // no step count to advance
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Fetched fetch(int64_t) const { return {}; }
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched) const { dvalues[e] = from_accum<T>(g); }
};

template <typename T>
struct AdamWUpdate {
  static constexpr bool kUpdatesState = true;  // apply() reads and writes each slot's value and moments
  using A = accum_t<T>;
  T* __restrict__ values;
  T* __restrict__ exp_avg;
  T* __restrict__ exp_avg_sq;
  float* step;  // device memory: a replayed CUDA graph reads the current count
  AdamWConfig config;
  AdamWStep<A> constants;
  struct Fetched {
    T value, m, v;
  };
  float* count() const { return step; }  // advanced by one before the kernel that reads it
  __device__ __forceinline__ void begin() { constants = AdamWStep<A>::make(config, A(*step)); }
  __device__ __forceinline__ Fetched fetch(int64_t e) const { return {values[e], exp_avg[e], exp_avg_sq[e]}; }
  __device__ __forceinline__ void apply(int64_t e, A g, Fetched f) const {
    // The gradient rounded to T first, as the update from a stored gradient would see it.
    constants.apply_stored(from_accum<T>(g), f.value, f.m, f.v);
    values[e] = f.value;
    exp_avg[e] = f.m;
    exp_avg_sq[e] = f.v;
  }
};

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
  constexpr int kUnrollSlots = 4;
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

template <typename T, typename Index, int G, typename Out>
Status launch_sddmm_vector(const SlotPattern<Index>& w, const T* dy_t, const T* x_t, int64_t np, const Out& out,
                           Stream stream) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  const int64_t warps = ceil_div(w.nnz, int64_t(32 / G) * 4);
  // Eight resident blocks per SM; a grid-stride loop covers the rest.
  const unsigned blocks = grid_for(warps * 32, kThreads, int64_t(limits.sms) * 8);
  // Programmatic launch: starts during the transpose of X (see detail::launch_programmatic).
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(sddmm_vector_kernel<T, Index, G, Out>, dim3(blocks),
                                                         dim3(kThreads), 0, stream, w, dy_t, x_t, np, out));
  return check_launch("sddmm_vector_kernel");
}

int64_t sddmm_padded_batch(int64_t n) { return (n + 3) / 4 * 4; }

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

// Whether p is aligned for one load of 4 elements of `elem` bytes.
inline bool aligned_for_4(const void* p, size_t elem) {
  return reinterpret_cast<uintptr_t>(p) % (4 * elem < 16 ? 4 * elem : 16) == 0;
}

// Slots per lane per chunk of sddmm_rows_kernel (its kU; comment there).
constexpr int rows_slots_per_lane(int GN, int NC, bool updates_state) {
  return NC >= 4 || (updates_state && GN <= 4) ? 4 : 8;
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
__global__ void __launch_bounds__(kThreads, 4)
    sddmm_rows_kernel(SlotPattern<Index> w, bool vector_ok, const T* __restrict__ dy, int64_t n,
                      const T* __restrict__ x_t, int64_t np, int lanes_per_row, Out out, Out bias_out, bool with_bias) {
  using A = accum_t<T>;
  constexpr int kGroup = 4;
  // Slots per lane per chunk: fewer where the row's dY takes more registers, and with AdamW's step in the
  // epilogue up to 4 batch lanes, where a lane would otherwise keep 2-8 slots' sums, values and
  // moments (measured on the H200, session 10 call 7, with AdamW: 16384x4096, 90%, N = 8: 105
  // against 184 us, N = 16: 116 against 123 us; at N = 32, 8 batch lanes, 4 slots lost: 185
  // against 149 us).
  constexpr int kU = rows_slots_per_lane(GN, NC, Out::kUpdatesState);
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

template <typename T, typename Index, int GN, int NC, typename Out>
Status launch_sddmm_rows(const SlotPattern<Index>& w, const T* dy, int64_t n, const T* x_t, int64_t np,
                         const Out& out, const Out* bias_out, Stream stream) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  // Lanes per row as the forward plans them: about a group of 4 slots per lane at most, then, up to
  // a batch of 64, fewer (more rows per warp) while the launch keeps 16 warps per SM. Batches of
  // 65-128 hold fewer slots per lane (kU = 4) and want the warps: measured on the H200
  // (session 6, every lanes-per-row value forced), 5000x5000, N = 128: 221 us with 4 lanes per row
  // against 241 us with 2 (90%), 45.7 against 48.7 us (99%); at N = 16 the halving was best or
  // within 1%.
  constexpr int kFree = 32 / GN;
  const double avg = w.rows > 0 ? double(w.nnz) / double(w.rows) : 0.0;
  int lanes = 1;
  while (lanes < kFree && lanes * 4 <= avg) lanes <<= 1;
  const int64_t wanted = int64_t(limits.sms) * 16;
  if constexpr (NC < 4) {
    while (lanes > 1 && ceil_div(w.rows, kFree / (lanes / 2)) >= wanted) lanes >>= 1;
  }
  // With AdamW's epilogue, one row per warp where rows are long (each lane still walks at least 3
  // chunks of a row) and many (two rows per resident warp: 4 blocks of 8 warps per SM): the slots a
  // warp updates at once are then consecutive, so their value and moments move in full sectors
  // instead of one short run per row. Measured on the H200 (session 11, call 3: every lanes value
  // forced over 5 shapes x 80-99% x N = 8-64): 16384x4096, 90%: N = 16 112.0 -> 103.6 us, N = 8
  // 98.7 -> 82.8 us; 1.010x in geomean over the 100 rows, none below 0.968x. Fewer rows
  // (5000x5000, N = 8: 0.93x) or short ones (99%: 0.84x) lose.
  if constexpr (Out::kUpdatesState) {
    constexpr int kU = rows_slots_per_lane(GN, NC, true);
    if (avg >= 3.0 * kFree * kU && w.rows >= int64_t(limits.sms) * 32 * 2) lanes = kFree;
  }
  const int64_t warps = ceil_div(w.rows, kFree / lanes);
  const unsigned blocks = grid_for(warps * 32, kThreads, int64_t(limits.sms) * 8);
  const bool vector_ok = aligned_for_4(w.col_idx, sizeof(Index));
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(sddmm_rows_kernel<T, Index, GN, NC, Out>, dim3(blocks),
                                                         dim3(kThreads), 0, stream, w, vector_ok, dy, n, x_t, np,
                                                         lanes, out, bias_out ? *bias_out : out,
                                                         bias_out != nullptr));
  return check_launch("sddmm_rows_kernel");
}

// The rows kernel's instantiation for a padded batch np (a multiple of 4, at most kSddmmRowsMaxBatch).
template <typename T, typename Index, typename Out>
Status launch_sddmm_rows_for_batch(const SlotPattern<Index>& w, const T* dy, int64_t n, const T* x_t, int64_t np,
                                   const Out& out, const Out* bias_out, Stream stream) {
  if (np > 64) return launch_sddmm_rows<T, Index, 8, 4>(w, dy, n, x_t, np, out, bias_out, stream);
  if (np > 32) return launch_sddmm_rows<T, Index, 8, 2>(w, dy, n, x_t, np, out, bias_out, stream);
  switch (np / 4) {  // batch lanes: one per 4 values of np (3 lanes run as 4, 5..8 as 8)
    case 1: return launch_sddmm_rows<T, Index, 1, 1>(w, dy, n, x_t, np, out, bias_out, stream);
    case 2: return launch_sddmm_rows<T, Index, 2, 1>(w, dy, n, x_t, np, out, bias_out, stream);
    case 3:
    case 4: return launch_sddmm_rows<T, Index, 4, 1>(w, dy, n, x_t, np, out, bias_out, stream);
    default: return launch_sddmm_rows<T, Index, 8, 1>(w, dy, n, x_t, np, out, bias_out, stream);
  }
}

// db[r] = sum_n dy[n, r], handed to the same epilogues as the SDDMM's (stored, or AdamW's step).
template <typename T, typename Out>
__global__ void __launch_bounds__(kThreads) bias_grad_kernel(const T* __restrict__ dy, int64_t n, int64_t m, Out out) {
  out.begin();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < m; r += stride) {
    const auto fetched = out.fetch(r);
    accum_t<T> acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += to_accum(dy[i * m + r]);
    out.apply(r, acc, fetched);
  }
}

// The SDDMM kernel after it is launched programmatically: it starts at once and waits for this grid
// (griddepcontrol.wait) before it reads the counts.
__global__ void advance_counts_kernel(detail::StepCounts counts) {
  detail::allow_dependent_launch();
  counts.advance();
}

Status advance_counts(const detail::StepCounts& counts, Stream stream) {
  if (!counts.any()) return Status::Ok();
  advance_counts_kernel<<<1, 1, 0, stream>>>(counts);
  return check_launch("advance_counts_kernel");
}

template <typename T, typename Out>
Status launch_bias_grad(const T* dy, int64_t n, int64_t m, const Out& out, Stream stream) {
  bias_grad_kernel<T><<<grid_for(m, kThreads), kThreads, 0, stream>>>(dy, n, m, out);
  return check_launch("bias_grad_kernel");
}

// The kernel kAuto runs for a batch of n (padded to np); updates_state: an epilogue such as AdamW's.
SddmmVariant automatic_sddmm_variant(int64_t n, int64_t np, bool updates_state) {
  // Measured on the H200 (session 6, bench/results/backward_nvidia_h200.csv): the rows kernel is
  // faster than the vector kernel at every shape of the benchmark grid it runs (N = 16: 2.2x at
  // 16384x4096 and 90%, 1.7x at 4096x4096), and than the shared-memory kernel that it replaced
  // (N = 16: 1.4x at 16384x4096); below a batch of 4 the slot kernel, which needs no transposes,
  // is faster. With AdamW's step in the epilogue the vector kernel is faster at a padded batch of 4
  // (session 10, gpu_session10_nvidia_h200.log call 7: 16384x4096, 90%: 88 against 146 us), the
  // rows kernel from 8 (105 against 142 us at N = 8, 116 against 223 at N = 16). Their plain
  // SDDMMs are bitwise equal up to a batch of 32; with this epilogue they agree to rounding, not
  // bitwise (tested; the cause was not isolated).
  if (n < kSddmmVectorMinBatch) return SddmmVariant::kSlot;
  if (np > kSddmmRowsMaxBatch || (updates_state && np <= 4)) return SddmmVariant::kVector;
  return SddmmVariant::kRows;
}

// The SDDMM kernels with `out` as their epilogue: the variant, the transposes, the launch. With
// bias_out, the bias gradient goes to that epilogue too: inside the rows kernel, else by
// bias_grad_kernel after the product (bias_out's arrays have w.rows elements). given_x_t: X already
// transposed (the forward's copy), read by the rows kernel in place of a transpose of its own. The
// epilogues' step counts are advanced first, by the first transpose where there is one, else by a
// one-thread kernel.
template <typename T, typename Index, typename Out>
Status run_sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, const Out& out, void* workspace,
                 Stream stream, SddmmVariant variant, const Out* bias_out, TransposedInput<T> given_x_t) {
  const int64_t np = sddmm_padded_batch(n);
  if (variant == SddmmVariant::kAuto) variant = automatic_sddmm_variant(n, np, Out::kUpdatesState);
  const bool transposed = w.nnz > 0 && n > 0 && variant != SddmmVariant::kSlot;
  if (transposed && variant == SddmmVariant::kRows && np > kSddmmRowsMaxBatch)
    return InvalidArgument("sddmm: rows runs batches of at most " + std::to_string(kSddmmRowsMaxBatch));
  // X^T from the caller (the forward's copy) spares the rows kernel its transpose. The kernel takes
  // its stride as the padded batch: the extra values are zeros (and so are dY's past n), the same
  // instantiation runs (a power-of-two tile and n rounded up to 4 give the same batch lanes), and
  // the row kernel keeps one stride parameter (a separate one cost it 1-3%, session 12 call 7).
  const bool x_t_given = transposed && variant == SddmmVariant::kRows && given_x_t.data != nullptr;
  if (x_t_given && (given_x_t.stride < np || given_x_t.stride % 4 != 0 || given_x_t.stride > kSddmmRowsMaxBatch))
    return InvalidArgument("sddmm: the transposed input's stride (" + std::to_string(given_x_t.stride) +
                           ") must be a multiple of 4 from the padded batch (" + std::to_string(np) + ") to " +
                           std::to_string(kSddmmRowsMaxBatch));
  if (transposed && !x_t_given && workspace == nullptr)
    return InvalidArgument("sddmm: a workspace of sddmm_workspace_bytes() is required");
  const detail::StepCounts counts{out.count(), bias_out ? bias_out->count() : nullptr};
  if (w.nnz == 0 || !transposed) {
    SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
    if (w.nnz > 0) {
      sddmm_thread_slot_kernel<T, Index, Out><<<grid_for(w.nnz, kThreads), kThreads, 0, stream>>>(w, dy, x, n, out);
      SNACK_RETURN_IF_ERROR(check_launch("sddmm_thread_slot_kernel"));
    }
    return bias_out && w.rows > 0 ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
  }
  if (x_t_given) {
    SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
    return launch_sddmm_rows_for_batch(w, dy, n, given_x_t.data, given_x_t.stride, out, bias_out, stream);
  }
  // X transposed once into [cols, np] (zero-padded); the vector kernel also takes dY as [rows, np].
  T* x_t = static_cast<T*>(workspace);
  T* dy_t = x_t + w.cols * np;
  const dim3 block(32, 8);
  if (variant == SddmmVariant::kVector) {
    detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.rows, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                       stream>>>(dy, n, w.rows, w.rows, int(np), dy_t, counts);
    SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(dy)"));
  }
  detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.cols, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                     stream>>>(x, n, w.cols, w.cols, int(np), x_t,
                                               variant == SddmmVariant::kVector ? detail::StepCounts{} : counts);
  SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(x)"));
  if (variant == SddmmVariant::kRows) return launch_sddmm_rows_for_batch(w, dy, n, x_t, np, out, bias_out, stream);
  const Status status = [&] {
    switch (std::min<int64_t>(32, np / 4)) {  // batch lanes
      case 1: return launch_sddmm_vector<T, Index, 1>(w, dy_t, x_t, np, out, stream);
      case 2: return launch_sddmm_vector<T, Index, 2>(w, dy_t, x_t, np, out, stream);
      case 3:
      case 4: return launch_sddmm_vector<T, Index, 4>(w, dy_t, x_t, np, out, stream);
      case 5: case 6: case 7:
      case 8: return launch_sddmm_vector<T, Index, 8>(w, dy_t, x_t, np, out, stream);
      case 9: case 10: case 11: case 12: case 13: case 14: case 15:
      case 16: return launch_sddmm_vector<T, Index, 16>(w, dy_t, x_t, np, out, stream);
      default: return launch_sddmm_vector<T, Index, 32>(w, dy_t, x_t, np, out, stream);
    }
  }();
  SNACK_RETURN_IF_ERROR(status);
  return bias_out ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
}

}  // namespace

size_t sddmm_workspace_bytes(int64_t rows, int64_t cols, int64_t n, size_t value_bytes, SddmmVariant variant,
                             bool x_transposed_given) {
  if (variant == SddmmVariant::kSlot || (variant == SddmmVariant::kAuto && n < kSddmmVectorMinBatch) || n <= 0)
    return 0;
  const int64_t np = sddmm_padded_batch(n);
  // The rows kernel reads a given X^T and needs nothing else.
  const auto rows_kernel = [&](bool updates_state) {
    return variant == SddmmVariant::kRows ||
           (variant == SddmmVariant::kAuto && automatic_sddmm_variant(n, np, updates_state) == SddmmVariant::kRows);
  };
  if (x_transposed_given && rows_kernel(false) && rows_kernel(true)) return 0;
  // X transposed always; dY too where the vector kernel may run (kAuto takes it past the rows
  // kernel's batches, and at a padded batch of 4 with an epilogue that updates state).
  const bool dy_t = variant == SddmmVariant::kVector ||
                    (variant == SddmmVariant::kAuto &&
                     (automatic_sddmm_variant(n, np, false) == SddmmVariant::kVector ||
                      automatic_sddmm_variant(n, np, true) == SddmmVariant::kVector));
  return size_t(cols + (dy_t ? rows : 0)) * size_t(np) * value_bytes;
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, void* workspace,
             Stream stream, SddmmVariant variant, TransposedInput<T> x_t) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, dvalues),
      {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  return run_sddmm(w, dy, x, n, StoreGradient<T>{dvalues}, workspace, stream, variant,
                   static_cast<const StoreGradient<T>*>(nullptr), x_t);
}

template <typename T, typename Index>
Status sddmm_adamw(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, float* step,
                   const AdamWConfig& config, T* values, T* exp_avg, T* exp_avg_sq, void* workspace, Stream stream,
                   SddmmVariant variant, const AdamWParameter<T>* bias, TransposedInput<T> x_t) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, values),
      {{"dy", required_if(n * w.rows > 0, dy)},
       {"x", required_if(n * w.cols > 0, x)},
       {"exp_avg", required_if(w.nnz > 0, exp_avg)},
       {"exp_avg_sq", required_if(w.nnz > 0, exp_avg_sq)},
       {"step", required_if(w.nnz > 0, step)}}));
  if (bias && w.rows > 0 && !(bias->values && bias->exp_avg && bias->exp_avg_sq && bias->step))
    return InvalidArgument("sddmm_adamw: the bias's values, exp_avg, exp_avg_sq and step must not be null");
  const AdamWUpdate<T> bias_update{bias ? bias->values : nullptr, bias ? bias->exp_avg : nullptr,
                                   bias ? bias->exp_avg_sq : nullptr, bias ? bias->step : nullptr,
                                   bias ? bias->config : AdamWConfig{}, {}};
  return run_sddmm(w, dy, x, n, AdamWUpdate<T>{values, exp_avg, exp_avg_sq, step, config, {}}, workspace, stream,
                   variant, bias ? &bias_update : nullptr, x_t);
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, Stream stream) {
  const size_t bytes = sddmm_workspace_bytes(w.rows, w.cols, n, sizeof(T));
  void* ws = nullptr;
  if (bytes > 0) SNACK_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ws, bytes, stream));
  const Status status = sddmm(w, dy, x, n, dvalues, ws, stream);
  if (ws) (void)cudaFreeAsync(ws, stream);
  return status;
}

// The bias-gradient kernel with `out` as its epilogue; `op` names the caller in errors. `outputs`
// says whether the epilogue's arrays are all non-null (checked where m > 0).
template <typename T, typename Out>
Status run_bias_grad(const char* op, const T* dy, int64_t n, int64_t m, bool outputs, const char* outputs_error,
                     const Out& out, Stream stream) {
  if (n < 0 || m < 0) return InvalidArgument(std::string(op) + ": sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && !outputs) return InvalidArgument(outputs_error);
  SNACK_RETURN_IF_ERROR(advance_counts(detail::StepCounts{out.count(), nullptr}, stream));
  if (m == 0) return Status::Ok();
  return launch_bias_grad(dy, n, m, out, stream);
}

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream) {
  return run_bias_grad("bias_grad", dy, n, m, dbias != nullptr, "dbias must not be null", StoreGradient<T>{dbias},
                       stream);
}

template <typename T>
Status bias_grad_adamw(const T* dy, int64_t n, int64_t m, float* step, const AdamWConfig& config, T* bias,
                       T* exp_avg, T* exp_avg_sq, Stream stream) {
  return run_bias_grad("bias_grad_adamw", dy, n, m, bias && exp_avg && exp_avg_sq && step,
                       "bias, exp_avg, exp_avg_sq and step must not be null",
                       AdamWUpdate<T>{bias, exp_avg, exp_avg_sq, step, config, {}}, stream);
}

#define SNACK_INSTANTIATE_CUDA_OPS(T, Index)                                                                     \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);             \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, void*, Stream,        \
                                  SddmmVariant, TransposedInput<T>);                                                 \
  template Status sddmm_adamw<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, float*,                \
                                        const AdamWConfig&, T*, T*, T*, void*, Stream, SddmmVariant,                 \
                                        const AdamWParameter<T>*, TransposedInput<T>);

SNACK_INSTANTIATE_CUDA_OPS(float, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(float, int32_t)
SNACK_INSTANTIATE_CUDA_OPS(double, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(double, int32_t)
SNACK_INSTANTIATE_CUDA_OPS(bfloat16, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(bfloat16, int32_t)
SNACK_INSTANTIATE_CUDA_OPS(float16, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(float16, int32_t)
template Status bias_grad<float>(const float*, int64_t, int64_t, float*, Stream);
template Status bias_grad<double>(const double*, int64_t, int64_t, double*, Stream);
template Status bias_grad<bfloat16>(const bfloat16*, int64_t, int64_t, bfloat16*, Stream);
template Status bias_grad<float16>(const float16*, int64_t, int64_t, float16*, Stream);
template Status bias_grad_adamw<float>(const float*, int64_t, int64_t, float*, const AdamWConfig&, float*,
                                       float*, float*, Stream);
template Status bias_grad_adamw<double>(const double*, int64_t, int64_t, float*, const AdamWConfig&, double*,
                                        double*, double*, Stream);
template Status bias_grad_adamw<bfloat16>(const bfloat16*, int64_t, int64_t, float*, const AdamWConfig&,
                                          bfloat16*, bfloat16*, bfloat16*, Stream);
template Status bias_grad_adamw<float16>(const float16*, int64_t, int64_t, float*, const AdamWConfig&,
                                         float16*, float16*, float16*, Stream);

}  // namespace snack::cuda
