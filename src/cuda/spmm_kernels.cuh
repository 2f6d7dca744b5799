// The SpMM kernels shared by the forward (Y = X W^T over the CSR view) and the transposed product
// (dX = dY W over the CSC view). A "view" says, for output row o, where its entries are and which
// input column and value each has; the kernels never care which of the two products they compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "cuda_utils.cuh"
#include "snack/activation_math.h"
#include "snack/pattern.h"

namespace snack::cuda::detail {

// Rows of W (forward): entries s in [row_ptr[o], row_ptr[o+1]), input column col_idx[s], value values[s].
template <typename T, typename Index>
struct CsrView {
  const int32_t* __restrict__ ptr;
  const Index* __restrict__ idx;
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[e]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[e]; }
  // This block's share of the slot arrays of nnz entries, requested into L2.
  __device__ __forceinline__ void prefetch_l2(int64_t nnz) const {
    prefetch_l2_share(values, nnz * int64_t(sizeof(T)));
    prefetch_l2_share(idx, nnz * int64_t(sizeof(Index)));
  }
};

// Columns of W (transposed product): entries j in [col_ptr[o], col_ptr[o+1]) are slots csc_perm[j],
// whose input is the row of the slot.
template <typename T, typename Index>
struct CscView {
  const int32_t* __restrict__ ptr;
  const int32_t* __restrict__ perm;
  const Index* __restrict__ idx;  // row_idx
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[perm[e]]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[perm[e]]; }
  __device__ __forceinline__ void prefetch_l2(int64_t nnz) const {
    prefetch_l2_share(perm, nnz * int64_t(sizeof(int32_t)));
    prefetch_l2_share(values, nnz * int64_t(sizeof(T)));
    prefetch_l2_share(idx, nnz * int64_t(sizeof(Index)));
  }
};

// The two 16-bit values of a 32-bit word (the lower address in the low half), widened.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t word, accum_t<T>& first, accum_t<T>& second) {
  first = to_accum(T{uint16_t(word & 0xffffu)});
  second = to_accum(T{uint16_t(word >> 16)});
}

// Reads V consecutive elements, widened: 16-byte vectors where V allows (8- and 4-byte ones for fewer
// 16-bit values); the caller guarantees alignment. kShared: p points to shared memory (plain loads),
// else to global memory (read-only loads).
template <typename T, int V, bool kShared = false>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, accum_t<T> (&out)[V]) {
  const auto ld = [](const auto* q) {
    if constexpr (kShared) {
      return *q;
    } else {
      return __ldg(q);
    }
  };
  if constexpr (std::is_same_v<T, float> && V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const float4 q = ld(reinterpret_cast<const float4*>(p + j));
      out[j] = q.x; out[j + 1] = q.y; out[j + 2] = q.z; out[j + 3] = q.w;
    }
  } else if constexpr (std::is_same_v<T, float> && V == 2) {
    const float2 q = ld(reinterpret_cast<const float2*>(p));
    out[0] = q.x; out[1] = q.y;
  } else if constexpr (std::is_same_v<T, double> && V % 2 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const double2 q = ld(reinterpret_cast<const double2*>(p + j));
      out[j] = q.x; out[j + 1] = q.y;
    }
  } else if constexpr (kIsHalfType<T> && V % 8 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 8) {
      const uint4 q = ld(reinterpret_cast<const uint4*>(p + j));
      unpack_pair<T>(q.x, out[j], out[j + 1]);
      unpack_pair<T>(q.y, out[j + 2], out[j + 3]);
      unpack_pair<T>(q.z, out[j + 4], out[j + 5]);
      unpack_pair<T>(q.w, out[j + 6], out[j + 7]);
    }
  } else if constexpr (kIsHalfType<T> && V % 4 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const uint2 q = ld(reinterpret_cast<const uint2*>(p + j));
      unpack_pair<T>(q.x, out[j], out[j + 1]);
      unpack_pair<T>(q.y, out[j + 2], out[j + 3]);
    }
  } else if constexpr (kIsHalfType<T> && V == 2) {
    unpack_pair<T>(ld(reinterpret_cast<const unsigned*>(p)), out[0], out[1]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if constexpr (kShared) {
        out[j] = to_accum(p[j]);
      } else {
        out[j] = to_accum(load_ro(p + j));
      }
    }
  }
}

// a[0] b[0] + a[1] b[1] + a[2] b[2] + a[3] b[3] as one fixed chain of fused multiply-adds, so that
// kernels sharing it round alike whatever the compiler would contract.
template <typename A>
__device__ __forceinline__ A dot4(const A (&a)[4], const A (&b)[4]) {
  if constexpr (std::is_same_v<A, double>) {
    return __fma_rn(a[3], b[3], __fma_rn(a[2], b[2], __fma_rn(a[1], b[1], __dmul_rn(a[0], b[0]))));
  } else {
    return __fmaf_rn(a[3], b[3], __fmaf_rn(a[2], b[2], __fmaf_rn(a[1], b[1], __fmul_rn(a[0], b[0]))));
  }
}

// atomicAdd of an accumulated value to a stored one (the 16-bit types through CUDA's own).
template <typename T>
__device__ __forceinline__ void atomic_add_value(T* p, accum_t<T> v) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __float2bfloat16_rn(v));
  } else if constexpr (std::is_same_v<T, float16>) {
    atomicAdd(reinterpret_cast<__half*>(p), __float2half_rn(v));
  } else {
    atomicAdd(p, v);
  }
}

constexpr int kSpmmWarps = 8;       // warps per block of the global-memory row kernels
constexpr int kSpmmSmemWarps = 32;  // the shared-memory variant runs one large block per SM
constexpr int kUnroll = 8;          // entries per lane per chunk (the next chunk is requested before this one is used)
constexpr int kLongPerWarp = 8;     // long rows a warp can hand to its block (see spmm_rows_kernel)
// Static shared memory of the row kernels (long-row lists and partial sums), at most this much.
constexpr size_t kRowsKernelStaticSmem = 12 * 1024;

// Lane layout of a batch tile: V consecutive batch rows per lane (4 where possible, so one entry's
// inputs come in 16-byte vectors), GN lanes along the batch, GS = 32 / GN lanes along the entries.
template <int NPAD>
struct TileLayout {
  static constexpr int V = NPAD < 4 ? NPAD : 4;
  static constexpr int GN = NPAD / V;
  static constexpr int GS = 32 / GN;
  static_assert(GN >= 1 && GN <= 32 && GN * GS == 32, "batch tile must be a power of two in [1, 128]");
};

// Row stride of the batch tile of X in shared memory: odd (the lanes' rows fall in different banks)
// and past in_dim, so that column in_dim is the zero slot (see spmm_rows_kernel).
__host__ __device__ inline int64_t shared_x_stride(int64_t in_dim) { return (in_dim + 1) | 1; }

// Where a row kernel reads its input X from (the template argument kX of spmm_rows_kernel).
enum class XLayout {
  kShared,      // the batch tile of X (row-major) copied to shared memory first
  kTransposed,  // a transposed copy of the tile, [in_dim, NPAD], read as vectors through L1
  kRowMajor,    // X itself, row-major, one scalar per batch row through L1: no copy, no extra launch
};

// out[n, o] = sum_e value(e) * in[n, input(e)] (+ bias[o]) for n in [n0, n0 + NPAD) ∩ [0, n).
//
// Lanes: see TileLayout; the GS lanes along the entries split one output row (or `rows_per_warp`
// rows) and walk it in chunks of kU entries each, the next chunk requested before the current one
// is used (so up to 2 kU entries per lane are in flight).
// kShared: the batch tile of `in` (row-major, all in_dim columns and a zero column in_dim) is first
//        copied to shared memory with an odd row stride; one large block per SM strides over the rows.
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
__global__ void __launch_bounds__((kX == XLayout::kShared ? kSpmmSmemWarps : kSpmmWarps) * 32,
                                  kX == XLayout::kShared ? 1 : 4)
    spmm_rows_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in, int64_t n,
                     const T* __restrict__ bias, T* __restrict__ out, int lanes_per_row, int32_t long_threshold,
                     Activation act, int64_t prefetch_nnz) {
  using A = accum_t<T>;
  constexpr bool kSmem = kX == XLayout::kShared;
  constexpr int kWarps = kSmem ? kSpmmSmemWarps : kSpmmWarps;
  constexpr int V = TileLayout<NPAD>::V;
  constexpr int GN = TileLayout<NPAD>::GN;
  constexpr int GS = TileLayout<NPAD>::GS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);
  const int64_t stride = shared_x_stride(in_dim);
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

  if constexpr (kSmem) {
    const int64_t rows_here = (n - n0) < NPAD ? (n - n0) : NPAD;
    for (int64_t r = 0; r < NPAD; ++r) {
      const T* src = in + (n0 + r) * in_dim;
      for (int64_t c = threadIdx.x; c <= in_dim; c += blockDim.x)  // column in_dim: the zero slot
        xs[r * stride + c] = r < rows_here && c < in_dim ? src[c] : T{};
    }
    __syncthreads();
  }

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
  // NaN): the staged and transposed copies of X have a zero slot, input column in_dim, that they
  // read instead; X read in place has none, so there those entries (column -1) are skipped, and
  // only in a lane's last chunk of a range, the one that can hold them (a predicate per entry in
  // every chunk cost 5% at N = 1 and, on the transposed layout, up to 26% at N = 128: H200,
  // session 6).
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
        if constexpr (kSmem) {
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] += val[u] * to_accum(xs[(lane_n * V + j) * stride + col[u]]);
        } else if constexpr (kX == XLayout::kRowMajor) {
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

// Up to two optimizer step counts (float, device memory; null: none) that a kernel advances by one,
// so that the kernels after it read the number of this update without a launch of its own.
struct StepCounts {
  float* first = nullptr;
  float* second = nullptr;
  __host__ __device__ bool any() const { return first != nullptr || second != nullptr; }
  __device__ void advance() const {
    if (first) *first += 1.0f;
    if (second) *second += 1.0f;
  }
};

// in_t[t, c, j] = in[t * npad + j, c] for c < in_dim, zero past the batch and for the rows
// in_dim <= c < out_rows (the row kernels' zero slot): every batch tile t = blockIdx.z, transposed
// into [tiles, out_rows, npad]. One thread also advances `counts`.
template <typename T>
__global__ void transpose_tile_kernel(const T* __restrict__ in, int64_t n, int64_t in_dim, int64_t out_rows, int npad,
                                      T* __restrict__ in_t, StepCounts counts) {
  __shared__ T tile[32][33];
  allow_dependent_launch();  // the rows kernel after it prefetches W meanwhile, then waits for this grid
  if (counts.any() && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    counts.advance();
  const int64_t c0 = int64_t(blockIdx.x) * 32;
  const int64_t j0 = int64_t(blockIdx.y) * 32;
  const int64_t n0 = int64_t(blockIdx.z) * npad;
  in_t += int64_t(blockIdx.z) * out_rows * npad;
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t j = j0 + dy, c = c0 + threadIdx.x;
    tile[dy][threadIdx.x] = (j < npad && n0 + j < n && c < in_dim) ? in[(n0 + j) * in_dim + c] : T{};
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t c = c0 + dy, j = j0 + threadIdx.x;
    if (c < out_rows && j < npad) in_t[c * npad + j] = tile[threadIdx.x][dy];
  }
}

// Reference layout: one warp per output row, lanes split its entries, NT batch rows at a time read
// straight from the row-major input. Simple and general; the benchmarks keep it as a baseline.
template <typename T, typename View, int NT>
__global__ void __launch_bounds__(kSpmmWarps * 32)
    spmm_warp_row_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in, int64_t n,
                         const T* __restrict__ bias, T* __restrict__ out, Activation act) {
  using A = accum_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kSpmmWarps;
  for (int64_t o = int64_t(blockIdx.x) * kSpmmWarps + (threadIdx.x >> 5); o < out_dim; o += warps) {
    const int32_t begin = view.ptr[o], end = view.ptr[o + 1];
    const A b = bias ? to_accum(bias[o]) : A(0);
    for (int64_t n0 = 0; n0 < n; n0 += NT) {
      A acc[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[j] = A(0);
      for (int32_t e = begin + lane; e < end; e += 32) {
        const A v = to_accum(view.value(e));
        const int64_t c = view.input(e);
#pragma unroll
        for (int j = 0; j < NT; ++j)
          if (n0 + j < n) acc[j] += v * to_accum(in[(n0 + j) * in_dim + c]);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j] = warp_sum(acc[j]);
        if (lane == j && n0 + j < n) out[(n0 + j) * out_dim + o] = from_accum<T>(apply_activation(acc[j] + b, act));
      }
    }
  }
}

// out = act(out), elementwise: the epilogue of the atomic COO kernel, which cannot fuse it.
template <typename T>
__global__ void activation_kernel(T* __restrict__ out, int64_t count, Activation act) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step)
    out[i] = from_accum<T>(apply_activation(to_accum(out[i]), act));
}

// out[n, o] = bias[o] (or 0): the starting value of the atomic COO kernel.
template <typename T>
__global__ void fill_rows_kernel(T* __restrict__ out, const T* __restrict__ bias, int64_t n, int64_t out_dim) {
  const int64_t total = n * out_dim, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step)
    out[i] = bias ? bias[i % out_dim] : T{};
}

// SNACK-style COO SpMM: blockIdx.y is the batch row, so the batch rows spread over the SMs; the
// slots are split evenly (no load imbalance from long rows). Each thread sums kCooItems
// consecutive slots and flushes one atomicAdd per row it touched, so contention does not grow
// with N. Float atomics make the result order-dependent: opt-in only.
constexpr int kCooItems = 8;
template <typename T, typename Index>
__global__ void __launch_bounds__(256)
    spmm_coo_atomic_kernel(SlotPattern<Index> w, const T* __restrict__ values, const T* __restrict__ x,
                           int64_t batch_offset, T* __restrict__ y) {
  using A = accum_t<T>;
  const int64_t nb = batch_offset + blockIdx.y;
  const T* xrow = x + nb * w.cols;
  T* yrow = y + nb * w.rows;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kCooItems;
  if (first >= w.nnz) return;
  const int64_t last = first + kCooItems < w.nnz ? first + kCooItems : w.nnz;
  int64_t row = w.row_idx[first];
  A acc = 0;
  for (int64_t s = first; s < last; ++s) {
    const int64_t r = w.row_idx[s];
    if (r != row) {
      atomic_add_value(yrow + row, acc);
      acc = 0;
      row = r;
    }
    acc += to_accum(values[s]) * to_accum(xrow[w.col_idx[s]]);
  }
  atomic_add_value(yrow + row, acc);
}

}  // namespace snack::cuda::detail
