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
  T* __restrict__ dvalues;
  struct Fetched {};
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ Fetched fetch(int64_t) const { return {}; }
  __device__ __forceinline__ void apply(int64_t e, accum_t<T> g, Fetched) const { dvalues[e] = from_accum<T>(g); }
};

template <typename T>
struct AdamWUpdate {
  using A = accum_t<T>;
  T* __restrict__ values;
  T* __restrict__ exp_avg;
  T* __restrict__ exp_avg_sq;
  const float* __restrict__ step;  // device memory: a replayed CUDA graph reads the current count
  AdamWConfig config;
  AdamWStep<A> constants;
  struct Fetched {
    T value, m, v;
  };
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

// The same products over the rows of W, for np <= 4 GN NC: a warp takes rows_per_warp rows at a
// time and lanes_per_row lanes of each split the row's slots in groups of 4 (one vector load of the
// column indices per group). GN lanes along the batch each hold NC chunks of 4 values of the row's
// dy_t (kept in registers for the whole row: chunk c covers batch values 4 (GN c + lane_n) .. + 3);
// every slot's x_t vectors are gathered through L1, as in the forward's global_xt. A lane's kU slots
// are then summed over the GN batch lanes by a reduce-scatter: each round of shuffles halves the
// values a lane holds (kU - kU / GN shuffles instead of kU log2 GN); rounds past one value per lane
// are butterfly rounds. The rounds add at lane distance 1, 2, 4, the order of sddmm_vector_kernel's
// butterfly, so for NC = 1 (np <= 32) the results are bitwise equal to it.
// The column indices of the next kU slots are requested before this chunk's gathers.
template <typename T, typename Index, int GN, int NC, typename Out>
__global__ void __launch_bounds__(kThreads, 4)
    sddmm_rows_kernel(SlotPattern<Index> w, bool vector_ok, const T* __restrict__ dy_t, const T* __restrict__ x_t,
                      int64_t np, int lanes_per_row, Out out) {
  using A = accum_t<T>;
  constexpr int kGroup = 4;
  constexpr int kU = NC >= 4 ? 4 : 8;  // slots per lane per chunk (fewer where dy_t takes more registers)
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
  detail::wait_for_prior_grid();  // dy_t and x_t come from the transposes just before
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
      for (int j = 0; j < 4; ++j) a[c][j] = A(0);
      if (row_ok && lo < hi && k < np) detail::load_vec<T, 4>(dy_t + o * np + k, a[c]);
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
Status launch_sddmm_rows(const SlotPattern<Index>& w, const T* dy_t, const T* x_t, int64_t np, const Out& out,
                         Stream stream) {
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
  const int64_t warps = ceil_div(w.rows, kFree / lanes);
  const unsigned blocks = grid_for(warps * 32, kThreads, int64_t(limits.sms) * 8);
  const bool vector_ok = aligned_for_4(w.col_idx, sizeof(Index));
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(sddmm_rows_kernel<T, Index, GN, NC, Out>, dim3(blocks),
                                                         dim3(kThreads), 0, stream, w, vector_ok, dy_t, x_t, np,
                                                         lanes, out));
  return check_launch("sddmm_rows_kernel");
}

// Tensor-core tiles (fp32 values, batch <= kSddmmTileMaxBatch). Each warp owns 16 rows of W and
// one part of its columns, which it walks in chunks of kTileChunkCols: the MMA units compute the
// chunk's dense 16 x 64 tile of dY^T X (dy_t and x_t rows of np = 16 NK values), the warp stores
// it in its own shared memory, and its lanes take the slots of those rows and columns, each
// reading its product from there. No block-wide barrier: the warps of an SM drift apart, so one
// warp's MMAs overlap another's slot traffic. The gathers of the rows kernel (64-128 bytes of
// x_t through L1 per slot) become tensor-core work on the whole tile, which pays at a high enough
// density (the automatic choice's kSddmmTileMinDensity).
// fp32 accuracy from TF32 inputs: each operand is split into big = tf32(x) and small =
// tf32(x - big), and big*big + big*small + small*big (3xTF32) loses only small*small, ~2^-22
// relative per product; the three MMAs accumulate in fp32. Non-finite inputs give NaN (inf - inf
// in the split) where the other kernels give +-inf.
// The batch index k is permuted inside each MMA step so that a thread's operands are one 16-byte
// load: thread (g = lane / 4, t = lane % 4) holds logical k = t, t + 4 of step 2 kk from physical
// 16 kk + 4 t + {0, 1}, and of step 2 kk + 1 from 16 kk + 4 t + {2, 3}, the same for A and B, so
// the sum over k is unchanged.
constexpr int kTileWarps = 4;                      // warps per block, 16 rows each, one column part
constexpr int kTileThreads = kTileWarps * 32;
constexpr int kTileChunkCols = 64;                 // columns per chunk: 8 MMA column tiles of 8
constexpr int kTilePitch = kTileChunkCols + 8;     // floats per shared row: 64-bit stores hit all 32 banks
constexpr int kTileMaxChunksPerPart = 16;          // bounds the slot-bound table and its search
constexpr int kTileSlotsPerLane = 4;               // slots per lane whose loads are issued before the MMAs

struct TileGrid {
  int parts = 1;            // column parts (grid.y)
  int chunks_per_part = 1;  // chunks of kTileChunkCols columns in a part (the last may hold fewer)
};

// Column parts: enough warps to fill the SMs (20 per SM), at least 8 chunks a part where the
// columns allow (each warp searches its rows' slot bounds once), at most kTileMaxChunksPerPart.
TileGrid sddmm_tile_grid(int64_t rows, int64_t cols, int sms) {
  const int64_t chunks = ceil_div(cols, kTileChunkCols), row_tiles = ceil_div(rows, 16);
  int64_t parts = ceil_div(int64_t(sms) * 20, row_tiles);
  parts = std::min<int64_t>(parts, std::max<int64_t>(1, chunks / 8));
  parts = std::max<int64_t>(parts, ceil_div(chunks, kTileMaxChunksPerPart));
  const int64_t per_part = ceil_div(chunks, parts);
  return {int(ceil_div(chunks, per_part)), int(per_part)};
}

// Shared memory of one warp: its tile, its slot bounds, the chunk's prefix.
constexpr size_t kTileWarpTileFloats = 16 * kTilePitch;
constexpr size_t kTileWarpInts = 16 * (kTileMaxChunksPerPart + 1) + 16;
constexpr size_t kTileSmemBytes = kTileWarps * (sizeof(float) * kTileWarpTileFloats + sizeof(int32_t) * kTileWarpInts);

int64_t sddmm_tile_padded_batch(int64_t n) { return (n + 15) / 16 * 16; }

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  return bits;
}

// d += a b for one m16n8k8 TF32 MMA (fragments as the PTX ISA lays them out).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // the launcher refuses devices below compute capability 8.0
#endif
}

// Four values as TF32 big parts and small remainders.
__device__ __forceinline__ void split_tf32(const float (&x)[4], uint32_t (&big)[4], uint32_t (&small)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    big[i] = to_tf32(x[i]);
    small[i] = to_tf32(x[i] - __uint_as_float(big[i]));
  }
}

__device__ __forceinline__ void load_float4_or_zero(const float* __restrict__ p, bool ok, float (&v)[4]) {
  const float4 q = ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

template <typename Index, int NK, typename Out>
__global__ void __launch_bounds__(kTileThreads, 5)
    sddmm_tile_kernel(SlotPattern<Index> w, const float* __restrict__ dy_t, const float* __restrict__ x_t,
                      int chunks_per_part, Out out) {
  constexpr int np = 16 * NK;
  constexpr int kQueries = (16 * (kTileMaxChunksPerPart + 1) + 31) / 32;  // slot-bound searches per lane
  extern __shared__ __align__(16) unsigned char tile_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* tile = reinterpret_cast<float*>(tile_smem) + warp * kTileWarpTileFloats;
  int32_t* bound = reinterpret_cast<int32_t*>(reinterpret_cast<float*>(tile_smem) + kTileWarps * kTileWarpTileFloats) +
                   warp * kTileWarpInts;          // [16][part_chunks + 1]
  int32_t* prefix = bound + kTileWarpInts - 16;  // [16]
  const int64_t r0 = (int64_t(blockIdx.x) * kTileWarps + warp) * 16;
  if (r0 >= w.rows) return;  // a whole warp; the kernel has no block-wide barrier
  const int64_t first_chunk = int64_t(blockIdx.y) * chunks_per_part;
  const int part_chunks =
      int(std::min<int64_t>(chunks_per_part, ceil_div(w.cols, kTileChunkCols) - first_chunk));
  const int stride = part_chunks + 1;

  // bound[r][j]: the first slot of row r0 + r whose column is >= (first_chunk + j) kTileChunkCols
  // (j = part_chunks: the part's end). The 16 (part_chunks + 1) lower bounds are searched at once,
  // kQueries per lane, one probe each per round. The pattern is not written by the transposes:
  // read before waiting for them.
  {
    int32_t row_lo = 0, row_hi = 0;
    if (lane < 16 && r0 + lane < w.rows) {
      row_lo = w.row_ptr[r0 + lane];
      row_hi = w.row_ptr[r0 + lane + 1];
    }
    int32_t longest = row_hi - row_lo;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, offset));
    const int rounds = longest > 0 ? 32 - __clz(longest) : 0;
    const int queries = 16 * stride;
    int32_t base[kQueries], len[kQueries], target[kQueries];
#pragma unroll
    for (int i = 0; i < kQueries; ++i) {
      const int q = lane + 32 * i;
      const int r = q < queries ? q / stride : 0;
      const int32_t lo = __shfl_sync(0xffffffffu, row_lo, r), hi = __shfl_sync(0xffffffffu, row_hi, r);
      base[i] = lo;
      len[i] = q < queries ? hi - lo : 0;
      target[i] = int32_t((first_chunk + (q < queries ? q % stride : 0)) * kTileChunkCols);
    }
    for (int round = 0; round < rounds; ++round) {
#pragma unroll
      for (int i = 0; i < kQueries; ++i) {
        if (len[i] > 0) {
          const int32_t half = len[i] / 2;
          if (int32_t(w.col_idx[base[i] + half]) < target[i]) {
            base[i] += half + 1;
            len[i] -= half + 1;
          } else {
            len[i] = half;
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kQueries; ++i) {
      const int q = lane + 32 * i;
      if (q < queries) bound[q] = base[i];
    }
    __syncwarp();
  }
  detail::wait_for_prior_grid();  // dy_t and x_t come from the transposes just before
  out.begin();

  // The warp's 16 rows of dY^T as A fragments, split, for the whole batch: held for every chunk.
  const int g = lane >> 2, t = lane & 3;
  uint32_t a_big[NK][2][4], a_small[NK][2][4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    float lo[4], hi[4];
    load_float4_or_zero(dy_t + (r0 + g) * np + 16 * kk + 4 * t, r0 + g < w.rows, lo);
    load_float4_or_zero(dy_t + (r0 + g + 8) * np + 16 * kk + 4 * t, r0 + g + 8 < w.rows, hi);
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const float f[4] = {lo[2 * step], hi[2 * step], lo[2 * step + 1], hi[2 * step + 1]};
      split_tf32(f, a_big[kk][step], a_small[kk][step]);
    }
  }

  for (int j = 0; j < part_chunks; ++j) {
    // The chunk's slots, row by row: prefix[r] of them in rows before r (lanes 0-15 own a row).
    const int32_t count = lane < 16 ? bound[lane * stride + j + 1] - bound[lane * stride + j] : 0;
    int32_t inclusive = count;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int32_t v = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += v;
    }
    const int32_t total = __shfl_sync(0xffffffffu, inclusive, 31);
    if (total == 0) continue;  // the same for the whole warp: no products
    __syncwarp();              // the last chunk's readers of prefix and tile are done
    if (lane < 16) prefix[lane] = inclusive - count;
    __syncwarp();
    const int64_t c0 = (first_chunk + j) * kTileChunkCols;
    auto slot_of = [&](int32_t i, int& r) {
      r = 0;
#pragma unroll
      for (int step = 8; step >= 1; step >>= 1) r += prefix[r + step] <= i ? step : 0;
      return bound[r * stride + j] + (i - prefix[r]);
    };
    // The first slots' loads, issued before the products.
    int32_t slot[kTileSlotsPerLane], pos[kTileSlotsPerLane];
    typename Out::Fetched fetched[kTileSlotsPerLane];
#pragma unroll
    for (int u = 0; u < kTileSlotsPerLane; ++u) {
      const int32_t i = lane + 32 * u;
      slot[u] = -1;
      if (i < total) {
        int r;
        slot[u] = slot_of(i, r);
        pos[u] = r * kTilePitch + int32_t(int64_t(w.col_idx[slot[u]]) - c0);
        fetched[u] = out.fetch(slot[u]);
      }
    }
    // The 16 x 64 tile: 8 column tiles of 8, 3 MMAs per step of 8 batch values.
    float acc[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
    }
    // Four column tiles at a time, so that each MMA's neighbours are independent of it.
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
      for (int quad = 0; quad < 2; ++quad) {
        uint32_t b_big[4][4], b_small[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int64_t col = c0 + 8 * (4 * quad + q) + g;
          float b[4];
          load_float4_or_zero(x_t + col * np + 16 * kk + 4 * t, col < w.cols, b);
          split_tf32(b, b_big[q], b_small[q]);
        }
#pragma unroll
        for (int step = 0; step < 2; ++step) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint32_t bs[2] = {b_small[q][2 * step], b_small[q][2 * step + 1]};
            mma_tf32(acc[4 * quad + q], a_small[kk][step], {b_big[q][2 * step], b_big[q][2 * step + 1]});
            mma_tf32(acc[4 * quad + q], a_big[kk][step], bs);
          }
#pragma unroll
          for (int q = 0; q < 4; ++q)
            mma_tf32(acc[4 * quad + q], a_big[kk][step], {b_big[q][2 * step], b_big[q][2 * step + 1]});
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      float* p = tile + g * kTilePitch + 8 * n + 2 * t;
      *reinterpret_cast<float2*>(p) = make_float2(acc[n][0], acc[n][1]);
      *reinterpret_cast<float2*>(p + 8 * kTilePitch) = make_float2(acc[n][2], acc[n][3]);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kTileSlotsPerLane; ++u) {
      if (slot[u] >= 0) out.apply(slot[u], tile[pos[u]], fetched[u]);
    }
    // Chunks with more slots than the first loads cover: the rest one at a time.
    for (int32_t i = lane + 32 * kTileSlotsPerLane; i < total; i += 32) {
      int r;
      const int32_t s = slot_of(i, r);
      const auto f = out.fetch(s);
      out.apply(s, tile[r * kTilePitch + int32_t(int64_t(w.col_idx[s]) - c0)], f);
    }
  }
}

template <typename Index, int NK, typename Out>
Status launch_sddmm_tile(const SlotPattern<Index>& w, const float* dy_t, const float* x_t, const Out& out,
                         Stream stream) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  const TileGrid grid = sddmm_tile_grid(w.rows, w.cols, limits.sms);
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(
      sddmm_tile_kernel<Index, NK, Out>, dim3(unsigned(ceil_div(w.rows, 16 * kTileWarps)), unsigned(grid.parts)),
      dim3(kTileThreads), kTileSmemBytes, stream, w, dy_t, x_t, grid.chunks_per_part, out));
  return check_launch("sddmm_tile_kernel");
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

// Whether the tile kernel can run a product with w.cols = cols on this device, and why not.
Status sddmm_tile_runs(int64_t cols, int64_t n, bool float_values) {
  if (!float_values) return InvalidArgument("sddmm: tile runs float32 values only");
  if (n > kSddmmTileMaxBatch)
    return InvalidArgument("sddmm: tile runs batches of at most " + std::to_string(kSddmmTileMaxBatch));
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  if (limits.compute_major < 8) return InvalidArgument("sddmm: tile needs tensor cores of compute capability 8.0+");
  if (sddmm_tile_grid(1, cols, limits.sms).parts > 65535)
    return InvalidArgument("sddmm: tile runs up to " + std::to_string(65535 * kTileMaxChunksPerPart * kTileChunkCols) +
                           " columns");
  return Status::Ok();
}

// The kernel sddmm() picks for a pattern and batch.
template <typename T, typename Index>
SddmmVariant choose_sddmm_variant(const SlotPattern<Index>& w, int64_t n) {
  if (n < kSddmmVectorMinBatch) return SddmmVariant::kSlot;
  // Measured on the H200 (session 10, bench/results/backward_nvidia_h200.csv): at a batch of
  // 8-32 and a density of kSddmmTileMinDensity or more, the tile kernel is faster than the rows
  // kernel (16384x4096, N = 16, 90%: see docs/kernels.md).
  const double density = double(w.nnz) / (double(w.rows) * double(w.cols));
  if (n >= kSddmmTileMinBatch && density >= kSddmmTileMinDensity &&
      sddmm_tile_runs(w.cols, n, std::is_same_v<T, float>).ok())
    return SddmmVariant::kTile;
  // Measured on the H200 (session 6, bench/results/backward_nvidia_h200.csv): the rows kernel
  // is faster than the vector kernel at every shape of the benchmark grid it runs (N = 16:
  // 2.2x at 16384x4096 and 90%, 1.7x at 4096x4096), and than the shared-memory kernel that it
  // replaced (N = 16: 1.4x at 16384x4096); below a batch of 4 the slot kernel, which needs no
  // transposes, is faster.
  return sddmm_padded_batch(n) <= kSddmmRowsMaxBatch ? SddmmVariant::kRows : SddmmVariant::kVector;
}

// The SDDMM kernels with `out` as their epilogue: the variant, the transposes, the launch.
template <typename T, typename Index, typename Out>
Status run_sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, const Out& out, void* workspace,
                 Stream stream, SddmmVariant variant) {
  // A forced kernel that cannot run this product says so, with or without slots.
  if (variant == SddmmVariant::kRows && sddmm_padded_batch(n) > kSddmmRowsMaxBatch)
    return InvalidArgument("sddmm: rows runs batches of at most " + std::to_string(kSddmmRowsMaxBatch));
  if (variant == SddmmVariant::kTile) SNACK_RETURN_IF_ERROR(sddmm_tile_runs(w.cols, n, std::is_same_v<T, float>));
  if (w.nnz == 0) return Status::Ok();
  if (variant == SddmmVariant::kAuto) variant = choose_sddmm_variant<T>(w, n);
  if (variant == SddmmVariant::kSlot || n == 0) {
    sddmm_thread_slot_kernel<T, Index, Out><<<grid_for(w.nnz, kThreads), kThreads, 0, stream>>>(w, dy, x, n, out);
    return check_launch("sddmm_thread_slot_kernel");
  }
  if (workspace == nullptr) return InvalidArgument("sddmm: a workspace of sddmm_workspace_bytes() is required");
  const int64_t np = variant == SddmmVariant::kTile ? sddmm_tile_padded_batch(n) : sddmm_padded_batch(n);
  // Transpose dY and X once into [rows, np] and [cols, np] (zero-padded), then one product kernel.
  T* dy_t = static_cast<T*>(workspace);
  T* x_t = dy_t + w.rows * np;
  const dim3 block(32, 8);
  detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.rows, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                     stream>>>(dy, n, w.rows, w.rows, int(np), dy_t);
  SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(dy)"));
  detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.cols, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                     stream>>>(x, n, w.cols, w.cols, int(np), x_t);
  SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(x)"));
  if (variant == SddmmVariant::kTile) {
    if constexpr (std::is_same_v<T, float>) {
      if (np == 16) return launch_sddmm_tile<Index, 1>(w, dy_t, x_t, out, stream);
      return launch_sddmm_tile<Index, 2>(w, dy_t, x_t, out, stream);
    }
  }
  // Batch lanes: one per 4 values of np (3 lanes run as 4, 5..7 as 8).
  const int64_t lanes = std::min<int64_t>(32, np / 4);
  if (variant == SddmmVariant::kRows) {
    if (np > 64) return launch_sddmm_rows<T, Index, 8, 4>(w, dy_t, x_t, np, out, stream);
    if (np > 32) return launch_sddmm_rows<T, Index, 8, 2>(w, dy_t, x_t, np, out, stream);
    switch (lanes) {
      case 1: return launch_sddmm_rows<T, Index, 1, 1>(w, dy_t, x_t, np, out, stream);
      case 2: return launch_sddmm_rows<T, Index, 2, 1>(w, dy_t, x_t, np, out, stream);
      case 3:
      case 4: return launch_sddmm_rows<T, Index, 4, 1>(w, dy_t, x_t, np, out, stream);
      default: return launch_sddmm_rows<T, Index, 8, 1>(w, dy_t, x_t, np, out, stream);
    }
  }
  switch (lanes) {
    case 1: return launch_sddmm_vector<T, Index, 1>(w, dy_t, x_t, np, out, stream);
    case 2: return launch_sddmm_vector<T, Index, 2>(w, dy_t, x_t, np, out, stream);
    case 3:
    case 4: return launch_sddmm_vector<T, Index, 4>(w, dy_t, x_t, np, out, stream);
    case 5: case 6: case 7:
    case 8: return launch_sddmm_vector<T, Index, 8>(w, dy_t, x_t, np, out, stream);
    default:
      if (lanes <= 16) return launch_sddmm_vector<T, Index, 16>(w, dy_t, x_t, np, out, stream);
      return launch_sddmm_vector<T, Index, 32>(w, dy_t, x_t, np, out, stream);
  }
}

}  // namespace

size_t sddmm_workspace_bytes(int64_t rows, int64_t cols, int64_t n, size_t value_bytes, SddmmVariant variant) {
  if (variant == SddmmVariant::kSlot || (variant == SddmmVariant::kAuto && n < kSddmmVectorMinBatch) || n <= 0)
    return 0;
  // Room for the tile kernel's wider padding wherever the automatic choice may pick it (fp32 values).
  const bool tile = variant == SddmmVariant::kTile ||
                    (variant == SddmmVariant::kAuto && value_bytes == sizeof(float) && n >= kSddmmTileMinBatch &&
                     n <= kSddmmTileMaxBatch);
  const int64_t np = tile ? sddmm_tile_padded_batch(n) : sddmm_padded_batch(n);
  return size_t(rows + cols) * size_t(np) * value_bytes;
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, void* workspace,
             Stream stream, SddmmVariant variant) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, dvalues),
      {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  return run_sddmm(w, dy, x, n, StoreGradient<T>{dvalues}, workspace, stream, variant);
}

template <typename T, typename Index>
Status sddmm_adamw(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, const float* step,
                   const AdamWConfig& config, T* values, T* exp_avg, T* exp_avg_sq, void* workspace, Stream stream,
                   SddmmVariant variant) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, values),
      {{"dy", required_if(n * w.rows > 0, dy)},
       {"x", required_if(n * w.cols > 0, x)},
       {"exp_avg", required_if(w.nnz > 0, exp_avg)},
       {"exp_avg_sq", required_if(w.nnz > 0, exp_avg_sq)},
       {"step", required_if(w.nnz > 0, step)}}));
  return run_sddmm(w, dy, x, n, AdamWUpdate<T>{values, exp_avg, exp_avg_sq, step, config, {}}, workspace, stream,
                   variant);
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

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream) {
  if (n < 0 || m < 0) return InvalidArgument("bias_grad: sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && dbias == nullptr) return InvalidArgument("dbias must not be null");
  if (m == 0) return Status::Ok();
  bias_grad_kernel<T><<<grid_for(m, kThreads), kThreads, 0, stream>>>(dy, n, m, StoreGradient<T>{dbias});
  return check_launch("bias_grad_kernel");
}

template <typename T>
Status bias_grad_adamw(const T* dy, int64_t n, int64_t m, const float* step, const AdamWConfig& config, T* bias,
                       T* exp_avg, T* exp_avg_sq, Stream stream) {
  if (n < 0 || m < 0) return InvalidArgument("bias_grad_adamw: sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && (!bias || !exp_avg || !exp_avg_sq || !step))
    return InvalidArgument("bias, exp_avg, exp_avg_sq and step must not be null");
  if (m == 0) return Status::Ok();
  bias_grad_kernel<T><<<grid_for(m, kThreads), kThreads, 0, stream>>>(
      dy, n, m, AdamWUpdate<T>{bias, exp_avg, exp_avg_sq, step, config, {}});
  return check_launch("bias_grad_kernel(adamw)");
}

#define SNACK_INSTANTIATE_CUDA_OPS(T, Index)                                                                     \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);             \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, void*, Stream,        \
                                  SddmmVariant);                                                                     \
  template Status sddmm_adamw<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const float*,          \
                                        const AdamWConfig&, T*, T*, T*, void*, Stream, SddmmVariant);

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
template Status bias_grad_adamw<float>(const float*, int64_t, int64_t, const float*, const AdamWConfig&, float*,
                                       float*, float*, Stream);
template Status bias_grad_adamw<double>(const double*, int64_t, int64_t, const float*, const AdamWConfig&, double*,
                                        double*, double*, Stream);
template Status bias_grad_adamw<bfloat16>(const bfloat16*, int64_t, int64_t, const float*, const AdamWConfig&,
                                          bfloat16*, bfloat16*, bfloat16*, Stream);
template Status bias_grad_adamw<float16>(const float16*, int64_t, int64_t, const float*, const AdamWConfig&,
                                         float16*, float16*, float16*, Stream);

}  // namespace snack::cuda
