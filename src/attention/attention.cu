// Fused sparse attention (include/snack/attention.h): a warp per query row (forward, dQ) or per key
// (dK, dV), its stored positions taken a window at a time.
//
// Each lane holds a slice of S consecutive elements of the warp's own rows (q_i, and dout_i for dQ;
// k_j and v_j for dK/dV) and takes one position of the window: the G = D / S lanes of a group share a
// position and split its partner rows (k_j and v_j for a query, q_i and dout_i for a key) by slices,
// so a window holds P = 32 / G positions and each partner row is read as a few coalesced 16-byte
// loads. A lane's dot products need only log2(G) shuffles to combine the group's slices; the softmax
// runs online over the windows (the running maximum, warp-uniform, rescales the sums only when it
// grows), and every lane accumulates its weighted partner rows into its own slice-wide sums, which
// one transposing reduction across the positions' lanes adds up at the end of the row. Every sum has
// a fixed order: deterministic.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "band_kernels.cuh"
#include "snack/attention.h"

namespace snack::cuda {
namespace detail {
namespace {

constexpr int kAttentionWarps = 4;  // rows (or keys) per block: a warp's slices take 100-200 registers
constexpr unsigned kFull = 0xffffffffu;

// The lane layout of a warp for head dimension D and slices of S elements.
template <int D, int S>
struct Lanes {
  static_assert(D % S == 0 && 32 % (D / S) == 0, "a row's slices must tile a warp");
  static constexpr int G = D / S;   // lanes per position: one slice each
  static constexpr int P = 32 / G;  // positions per window
  static constexpr int F = D / 32;  // elements of the reduced row each lane stores
};

// The sum of v over the G lanes of this lane's group (consecutive lanes), in every lane of the group,
// bitwise alike (each step adds one pair, in either order the same).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = 1; offset < G; offset <<= 1) v += __shfl_xor_sync(kFull, v, offset);
  return v;
}

// part[S] of every lane summed over the 32 / G lanes that hold the same slice (lanes g, g + G, ...):
// a butterfly that halves the elements at each step, after which part[0, F) of lane (slot, g) holds
// elements slot * F .. slot * F + F of slice g, summed over all positions.
template <int S, int G, int kOffset = 16>
__device__ __forceinline__ void reduce_across_positions(float (&part)[S]) {
  if constexpr (kOffset >= G) {  // one step per lane bit above the group's; compile-time indices throughout
    constexpr int kHalf = S * kOffset / 32;
    const bool upper = threadIdx.x & kOffset;
#pragma unroll
    for (int t = 0; t < kHalf; ++t) {
      const float send = upper ? part[t] : part[t + kHalf];
      const float keep = upper ? part[t + kHalf] : part[t];
      part[t] = keep + __shfl_xor_sync(kFull, send, kOffset);
    }
    reduce_across_positions<S, G, kOffset / 2>(part);
  }
}

template <int S>
__device__ __forceinline__ float dot(const float (&a)[S], const float (&b)[S]) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < S; ++e) s = fmaf(a[e], b[e], s);
  return s;
}

// Stores the reduced row of reduce_across_positions, times `scale`: lane (slot, g) writes elements
// g * S + slot * F .. + F of the row at `row`.
template <typename T, int D, int S>
__device__ __forceinline__ void store_reduced(T* row, const float (&part)[S], float scale) {
  using L = Lanes<D, S>;
  const int lane = threadIdx.x & 31;
  T* p = row + (lane % L::G) * S + (lane / L::G) * L::F;
#pragma unroll
  for (int t = 0; t < L::F; ++t) p[t] = from_accum<T>(part[t] * scale);
}

// A position's partner (a key for a query, a query for a key), or -1 where it is none (-1 given) or
// causality masks it out (a key after its query).
__device__ __forceinline__ int32_t masked(int32_t partner, int64_t self, bool causal, bool partner_is_key) {
  return partner >= 0 && causal && (partner_is_key ? partner > self : partner < self) ? -1 : partner;
}

// A query row's positions outside its band (all of them without bands), counted from 0: `count` of
// them, position e at slot slot(e) of the CSR view.
struct OutsideBand {
  int32_t begin, run_end, before, count;
  bool banded;  // the row has a band: its part is merged in at the end
  __device__ __forceinline__ OutsideBand(const BandRow* __restrict__ band_rows, int64_t i, int32_t begin,
                                         int32_t end) {
    BandRow band{begin, begin, 1, 0};
    if (band_rows != nullptr) band = band_rows[i];
    this->begin = begin, run_end = band.run_end, before = band.run_begin - begin;
    count = (end - begin) - (band.run_end - band.run_begin);
    banded = band.run_begin != band.run_end;
  }
  __device__ __forceinline__ int32_t slot(int32_t e) const { return e < before ? begin + e : run_end + (e - before); }
};

// Stores the reduced row of reduce_across_positions merged with the band's part of the row:
// out = part * own + band_row * band, element by element (band_row: the band's normalised output).
template <typename T, int D, int S>
__device__ __forceinline__ void store_merged(T* row, const float (&part)[S], float own, const float* band_row,
                                             float band) {
  using L = Lanes<D, S>;
  const int lane = threadIdx.x & 31;
  const int e0 = (lane % L::G) * S + (lane / L::G) * L::F;
#pragma unroll
  for (int t = 0; t < L::F; ++t) row[e0 + t] = from_accum<T>(fmaf(part[t], own, band_row[e0 + t] * band));
}

// The forward over a row's positions, or, given band_rows, over those outside the row's band (its
// run of slots [run_begin, run_end), attention_band_forward_kernel's), merged at the end with the
// band's part (band_out, band_lse) by their log-sum-exps.
template <typename T, typename Index, int D>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_forward_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx, int64_t lq,
                             int64_t lk, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             float scale_log2, bool causal, const BandRow* __restrict__ band_rows,
                             const float* __restrict__ band_out, const float* __restrict__ band_lse,
                             T* __restrict__ out, float* __restrict__ lse) {
  constexpr int S = 32;
  using L = Lanes<D, S>;
  const int lane = threadIdx.x & 31;
  const int g = lane % L::G, slot = lane / L::G;
  const int64_t i = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (i >= lq) return;  // the whole warp
  const T* kb = k + bh * lk * D + g * S;
  const T* vb = v + bh * lk * D + g * S;
  float qr[S];
  load_vec<T, S>(q + (bh * lq + i) * D + g * S, qr);
#pragma unroll
  for (int e = 0; e < S; ++e) qr[e] *= scale_log2;  // scores in log2 units: exp2 below
  float m = -INFINITY, l = 0.f, acc[S] = {};
  const OutsideBand rest(band_rows, i, row_ptr[i], row_ptr[i + 1]);
  // The key of this lane's position in the next window, requested a window ahead.
  const auto key_at = [&](int32_t e) { return e < rest.count ? int32_t(col_idx[rest.slot(e)]) : -1; };
  int32_t next = key_at(slot);
  for (int32_t p = 0; p < rest.count; p += L::P) {
    const int32_t j = masked(next, i, causal, true);
    next = key_at(p + L::P + slot);
    if (__ballot_sync(kFull, j >= 0) == 0) continue;  // warp-uniform
    float kr[S], vr[S], part = 0.f;
    if (j >= 0) {
      load_vec<T, S>(kb + int64_t(j) * D, kr);
      load_vec<T, S>(vb + int64_t(j) * D, vr);
      part = dot<S>(qr, kr);
    }
    const float group = group_sum<L::G>(part);  // every lane takes part in the shuffles
    const float s = j >= 0 ? group : -INFINITY;
    float window_max = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) window_max = fmaxf(window_max, __shfl_xor_sync(kFull, window_max, off));
    if (window_max > m) {  // warp-uniform: m and window_max are the same in every lane
      const float rescale = exp2f(m - window_max);
      l *= rescale;
#pragma unroll
      for (int t = 0; t < S; ++t) acc[t] *= rescale;
      m = window_max;
    }
    if (j >= 0) {
      const float pr = exp2f(s - m);
      if (g == 0) l += pr;  // one lane per position counts it
#pragma unroll
      for (int t = 0; t < S; ++t) acc[t] = fmaf(pr, vr[t], acc[t]);
    }
  }
  const float total = warp_sum(l);
  reduce_across_positions<S, L::G>(acc);
  if (!rest.banded) {
    store_reduced<T, D, S>(out + (bh * lq + i) * D, acc, total > 0.f ? 1.f / total : 0.f);
    if (lane == 0) lse[bh * lq + i] = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
    return;
  }
  // Both parts' sums relative to the larger of their maxima (log2 units), then one normalisation.
  const float band_log2 = band_lse[bh * lq + i] * kLog2e;
  const float top = fmaxf(m, band_log2);
  const float own = total > 0.f ? exp2f(m - top) : 0.f;
  const float theirs = band_log2 == -INFINITY ? 0.f : exp2f(band_log2 - top);
  const float sum = total * own + theirs;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  store_merged<T, D, S>(out + (bh * lq + i) * D, acc, own * inv, band_out + (bh * lq + i) * D, theirs * inv);
  if (lane == 0) lse[bh * lq + i] = sum > 0.f ? (top + log2f(sum)) * kLn2 : -INFINITY;
}

// dQ_i = scale * sum_j dS_ij k_j with dS_ij = P_ij (dP_ij - row_dot_i), dP_ij = dout_i . v_j and
// row_dot_i = sum_j P_ij dP_ij, summed in float32 in a first pass over the row (dout_i . out_i from a
// rounded 16-bit out loses the difference dP - row_dot to cancellation); row_dot is written for the
// dK / dV kernel.
template <typename T, typename Index, int D>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_dq_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx, int64_t lq, int64_t lk,
                        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const float* __restrict__ lse, const T* __restrict__ dout, float scale, bool causal,
                        const BandRow* __restrict__ band_rows, float* __restrict__ row_dot,
                        float* __restrict__ dq_partial, T* __restrict__ dq) {
  constexpr int S = 32;
  using L = Lanes<D, S>;
  const int lane = threadIdx.x & 31;
  const int g = lane % L::G, slot = lane / L::G;
  const int64_t i = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (i >= lq) return;
  const T* kb = k + bh * lk * D + g * S;
  const T* vb = v + bh * lk * D + g * S;
  const int64_t row = (bh * lq + i) * D;
  float qr[S], dor[S];
  load_vec<T, S>(q + row + g * S, qr);
  load_vec<T, S>(dout + row + g * S, dor);
  const float scale_log2 = scale * kLog2e;
#pragma unroll
  for (int e = 0; e < S; ++e) qr[e] *= scale_log2;
  const float lse_log2 = lse[bh * lq + i] * kLog2e;
  const OutsideBand rest(band_rows, i, row_ptr[i], row_ptr[i + 1]);
  // This lane's key j of the window at p (-1: none), its probability, its dP and k_j's slice; false
  // where the window holds no key (warp-uniform).
  const auto position = [&](int32_t p, int32_t& j, float& prob, float& dp, float (&kr)[S]) {
    const int32_t e = p + slot;
    j = masked(e < rest.count ? int32_t(col_idx[rest.slot(e)]) : -1, i, causal, true);
    if (__ballot_sync(kFull, j >= 0) == 0) return false;
    float part_s = 0.f, part_dp = 0.f;
    if (j >= 0) {
      float vr[S];
      load_vec<T, S>(kb + int64_t(j) * D, kr);
      load_vec<T, S>(vb + int64_t(j) * D, vr);
      part_s = dot<S>(qr, kr);
      part_dp = dot<S>(dor, vr);
    }
    const float s = group_sum<L::G>(part_s);
    dp = group_sum<L::G>(part_dp);
    prob = j >= 0 ? exp2f(s - lse_log2) : 0.f;
    return true;
  };
  float partial_dot = 0.f;
  for (int32_t p = 0; p < rest.count; p += L::P) {
    int32_t j;
    float prob, dp, kr[S];
    if (position(p, j, prob, dp, kr) && g == 0) partial_dot = fmaf(prob, dp, partial_dot);
  }
  // A banded row's band part of the sum is the band kernel's, already in row_dot.
  const float di = warp_sum(partial_dot) + (rest.banded ? row_dot[bh * lq + i] : 0.f);
  __syncwarp();  // every lane has read row_dot before lane 0 writes it
  if (lane == 0) row_dot[bh * lq + i] = di;
  float acc[S] = {};
  for (int32_t p = 0; p < rest.count; p += L::P) {
    int32_t j;
    float prob, dp, kr[S];
    if (!position(p, j, prob, dp, kr) || j < 0) continue;
    const float ds = prob * (dp - di);
#pragma unroll
    for (int t = 0; t < S; ++t) acc[t] = fmaf(ds, kr[t], acc[t]);
  }
  reduce_across_positions<S, L::G>(acc);
  if (!rest.banded) {
    store_reduced<T, D, S>(dq + row, acc, scale);
    return;
  }
  // The band kernel adds its part to this one and stores the sum.
  float* const part = dq_partial + row + (lane % L::G) * S + (lane / L::G) * L::F;
#pragma unroll
  for (int t = 0; t < L::F; ++t) part[t] = acc[t] * scale;
}

// dV_j = sum_i P_ij dout_i, dK_j = scale * sum_i dS_ij q_i over the queries i that store key j (the
// CSC view: entries [col_ptr[j], col_ptr[j + 1]), slots csc_perm[e], query row_idx[slot]). Slices of
// 16: a lane holds four of them (k_j, v_j and their sums) besides the partner rows' slices.
template <typename T, typename Index, int D>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_dkdv_kernel(const int32_t* __restrict__ col_ptr, const int32_t* __restrict__ csc_perm,
                          const Index* __restrict__ row_idx, int64_t lq, int64_t lk, const T* __restrict__ q,
                          const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                          const float* __restrict__ row_dot, const T* __restrict__ dout, float scale, bool causal,
                          const int32_t* __restrict__ residual_queries, const int32_t* __restrict__ query_first,
                          const int32_t* __restrict__ query_last, const float* __restrict__ dk_partial,
                          const float* __restrict__ dv_partial, T* __restrict__ dk, T* __restrict__ dv) {
  constexpr int S = 16;
  using L = Lanes<D, S>;
  const int lane = threadIdx.x & 31;
  const int g = lane % L::G, slot = lane / L::G;
  const int64_t j = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (j >= lk) return;
  const T* qb = q + bh * lq * D + g * S;
  const T* dob = dout + bh * lq * D + g * S;
  const int64_t row = (bh * lk + j) * D;
  float kr[S], vr[S];
  load_vec<T, S>(k + row + g * S, kr);
  load_vec<T, S>(v + row + g * S, vr);
  const float scale_log2 = scale * kLog2e;
#pragma unroll
  for (int e = 0; e < S; ++e) kr[e] *= scale_log2;
  float acc_k[S] = {}, acc_v[S] = {};
  const int32_t begin = col_ptr[j], end = col_ptr[j + 1];
  // The query of this lane's position in the next window (two dependent loads, or one given the
  // bands' residual_queries), requested a window ahead; -1 where the position is the bands'.
  const auto query_at = [&](int32_t e) {
    if (e >= end) return int32_t(-1);
    return residual_queries != nullptr ? residual_queries[e] : int32_t(row_idx[csc_perm[e]]);
  };
  int32_t next = query_at(begin + slot);
  for (int32_t p = begin; p < end; p += L::P) {
    const int32_t i = masked(next, j, causal, false);
    next = query_at(p + L::P + slot);
    if (__ballot_sync(kFull, i >= 0) == 0) continue;
    float qr[S], dor[S], part_s = 0.f, part_dp = 0.f;
    if (i >= 0) {
      load_vec<T, S>(qb + int64_t(i) * D, qr);
      load_vec<T, S>(dob + int64_t(i) * D, dor);
      part_s = dot<S>(kr, qr);
      part_dp = dot<S>(vr, dor);
    }
    const float s = group_sum<L::G>(part_s);
    const float dp = group_sum<L::G>(part_dp);
    if (i >= 0) {
      const int64_t qi = bh * lq + i;
      const float pr = exp2f(s - lse[qi] * kLog2e);
      const float ds = pr * (dp - row_dot[qi]);
#pragma unroll
      for (int t = 0; t < S; ++t) {
        acc_v[t] = fmaf(pr, dor[t], acc_v[t]);
        acc_k[t] = fmaf(ds, qr[t], acc_k[t]);
      }
    }
  }
  reduce_across_positions<S, L::G>(acc_k);
  reduce_across_positions<S, L::G>(acc_v);
  const int64_t block = j / kBandKeys;
  if (query_first != nullptr && query_first[block] <= query_last[block]) {  // the band's part of the key's block
    store_merged<T, D, S>(dk + row, acc_k, scale, dk_partial + row, 1.f);
    store_merged<T, D, S>(dv + row, acc_v, 1.f, dv_partial + row, 1.f);
    return;
  }
  store_reduced<T, D, S>(dk + row, acc_k, scale);
  store_reduced<T, D, S>(dv + row, acc_v, 1.f);
}

Status check_attention(int64_t lq, int64_t lk, int64_t bh, int64_t head_dim, int64_t nnz) {
  if (!sparse_attention_supports(head_dim))
    return InvalidArgument("sparse_attention: the fused kernels run head_dim 32, 64 or 128, got " +
                           std::to_string(head_dim));
  if (lq < 0 || lk < 0 || bh < 0 || nnz < 0) return InvalidArgument("sparse_attention: negative sizes");
  return Status::Ok();
}

// The arrays a launch touches: present, and those read or written as rows of 16-byte vectors (all
// but the per-row float32 ones) 16-byte aligned.
Status check_arrays(std::initializer_list<std::pair<const char*, const void*>> rows,
                    std::initializer_list<std::pair<const char*, const void*>> per_row) {
  for (const auto& [name, ptr] : per_row)
    if (ptr == nullptr) return InvalidArgument(std::string("sparse_attention: ") + name + " is null");
  for (const auto& [name, ptr] : rows) {
    if (ptr == nullptr) return InvalidArgument(std::string("sparse_attention: ") + name + " is null");
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return InvalidArgument(std::string("sparse_attention: ") + name + " must start at a 16-byte boundary");
  }
  return Status::Ok();
}

// fn(std::integral_constant<int, D>) for the head dimension D (32, 64 or 128, checked before).
template <typename Fn>
Status with_head_dim(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 32: return fn(std::integral_constant<int, 32>{});
    case 64: return fn(std::integral_constant<int, 64>{});
    default: return fn(std::integral_constant<int, 128>{});
  }
}

// The bands' float32 partial sums serve a slice of the batch x heads at a time, as many as fit this
// many bytes (at least one), so that their scratch stays bounded whatever the batch.
constexpr int64_t kBandScratchBytes = int64_t(64) << 20;

// Heads per slice of the launches, where each head's partial sums take per_head bytes.
int64_t band_slice(int64_t bh, int64_t per_head) {
  return std::max<int64_t>(1, std::min({bh, kMaxGridY, kBandScratchBytes / std::max<int64_t>(per_head, 1)}));
}

// The bands' scratch, each part at a 256-byte boundary: the split (each query row's BandRow, each block
// of queries' key range), then for a slice of `heads` the forward's float32 output and log-sum-exp, or
// the backward's key blocks' query ranges, each CSC entry's residual query and float32 partial sums of
// dq, dk and dv.
struct BandScratch {
  int64_t heads, rows, key_ranges, out, lse, query_first, query_last, residual_queries, dq, dk, dv, bytes;
};

BandScratch band_scratch(int64_t lq, int64_t lk, int64_t nnz, int64_t bh, int64_t head_dim, bool backward) {
  BandScratch s{};
  const auto take = [&](int64_t bytes) {
    const int64_t at = s.bytes;
    s.bytes += (bytes + 255) / 256 * 256;
    return at;
  };
  constexpr int64_t kFloat = sizeof(float);
  s.rows = take(lq * int64_t(sizeof(BandRow)));
  s.key_ranges = take(ceil_div(lq, kBandRows) * int64_t(sizeof(int2)));
  if (!backward) {
    s.heads = band_slice(bh, lq * (head_dim + 1) * kFloat);
    s.out = take(s.heads * lq * head_dim * kFloat);
    s.lse = take(s.heads * lq * kFloat);
  } else {
    s.heads = band_slice(bh, (lq + 2 * lk) * head_dim * kFloat);
    s.query_first = take(ceil_div(lk, kBandKeys) * int64_t(sizeof(int32_t)));
    s.query_last = take(ceil_div(lk, kBandKeys) * int64_t(sizeof(int32_t)));
    s.residual_queries = take(nnz * int64_t(sizeof(int32_t)));
    s.dq = take(s.heads * lq * head_dim * kFloat);
    s.dk = take(s.heads * lk * head_dim * kFloat);
    s.dv = take(s.heads * lk * head_dim * kFloat);
  }
  return s;
}

// The split of the pattern's rows between the bands and the warps (attention_band_rows_kernel).
template <typename Index>
Status launch_band_rows(const SlotPattern<Index>& w, bool causal, BandRow* rows, int2* key_ranges, Stream stream) {
  attention_band_rows_kernel<Index><<<unsigned(ceil_div(w.rows, kBandRows)), kBandRows, 0, stream>>>(
      w.row_ptr, w.col_idx, w.rows, causal, rows, key_ranges);
  return check_launch("attention_band_rows_kernel");
}

// Opts a kernel into more than 48 KiB of dynamic shared memory where it needs it.
template <typename Kernel>
Status allow_shared_memory(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return Status::Ok();
}

template <typename T, int D>
Status launch_band_forward(const BandRow* rows, const int2* key_ranges, int64_t lq, int64_t lk, unsigned heads,
                           const T* q, const T* k, const T* v, float scale_log2, float* band_out, float* band_lse,
                           Stream stream) {
  constexpr int kSmem = (kBandRows + 4 * kBandKeys) * D * 2;  // q, and two stages of k and v
  const auto kernel = attention_band_forward_kernel<T, D>;
  SNACK_RETURN_IF_ERROR(allow_shared_memory(kernel, kSmem));
  const dim3 grid(unsigned(ceil_div(lq, kBandRows)), heads);
  kernel<<<grid, kBandWarps * 32, kSmem, stream>>>(rows, key_ranges, lq, lk, q, k, v, scale_log2, band_out, band_lse);
  return check_launch("attention_band_forward_kernel");
}

}  // namespace
}  // namespace detail

template <typename T>
bool sparse_attention_uses_bands(int64_t head_dim, AttentionBands bands) {
  return kIsHalfType<T> && bands == AttentionBands::kAuto && (head_dim == 64 || head_dim == 128);
}

template <typename T>
int64_t sparse_attention_forward_workspace_bytes(int64_t lq, int64_t bh, int64_t head_dim, AttentionBands bands) {
  if (!sparse_attention_uses_bands<T>(head_dim, bands) || lq <= 0 || bh <= 0) return 0;
  return detail::band_scratch(lq, 0, 0, bh, head_dim, false).bytes;
}

template <typename T, typename Index>
Status sparse_attention_forward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, int64_t bh,
                                int64_t head_dim, float scale, bool causal, T* out, float* lse, void* workspace,
                                AttentionBands bands, Stream stream) {
  using namespace detail;
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w, PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_attention(w.rows, w.cols, bh, head_dim, w.nnz));
  if (w.rows == 0 || bh == 0) return Status::Ok();
  SNACK_RETURN_IF_ERROR(check_arrays({{"q", q}, {"out", out}}, {{"lse", lse}}));
  if (w.nnz > 0) SNACK_RETURN_IF_ERROR(check_arrays({{"k", k}, {"v", v}}, {}));
  const bool banded = w.nnz > 0 && sparse_attention_uses_bands<T>(head_dim, bands);
  if (banded) SNACK_RETURN_IF_ERROR(check_arrays({{"workspace", workspace}}, {}));
  const BandScratch scratch = band_scratch(w.rows, w.cols, w.nnz, bh, head_dim, false);
  char* const base = static_cast<char*>(workspace);
  const auto at = [&](int64_t offset) { return banded ? base + offset : nullptr; };
  BandRow* const band_rows = reinterpret_cast<BandRow*>(at(scratch.rows));
  int2* const key_ranges = reinterpret_cast<int2*>(at(scratch.key_ranges));
  float* const band_out = reinterpret_cast<float*>(at(scratch.out));
  float* const band_lse = reinterpret_cast<float*>(at(scratch.lse));
  if (banded) SNACK_RETURN_IF_ERROR(launch_band_rows(w, causal, band_rows, key_ranges, stream));
  const float s = scale * kLog2e;
  const auto launch = [&](auto dim) -> Status {
    constexpr int D = decltype(dim)::value;
    const int64_t slice = banded ? scratch.heads : kMaxGridY;  // the bands' scratch serves each slice in turn
    for (int64_t b0 = 0; b0 < bh; b0 += slice) {  // offsets of this slice of batch x heads
      const int64_t qo = b0 * w.rows, ko = b0 * w.cols;
      const unsigned heads = unsigned(std::min(slice, bh - b0));
      if constexpr (D != 32 && kIsHalfType<T>) {
        if (banded) {
          const Status band = launch_band_forward<T, D>(band_rows, key_ranges, w.rows, w.cols, heads, q + qo * D,
                                                        k + ko * D, v + ko * D, s, band_out, band_lse, stream);
          SNACK_RETURN_IF_ERROR(band);
        }
      }
      const dim3 grid(unsigned(ceil_div(w.rows, kAttentionWarps)), heads);
      attention_forward_kernel<T, Index, D><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.row_ptr, w.col_idx, w.rows, w.cols, q + qo * D, k + ko * D, v + ko * D, s, causal, band_rows, band_out,
          band_lse, out + qo * D, lse + qo);
      SNACK_RETURN_IF_ERROR(check_launch("attention_forward_kernel"));
    }
    return Status::Ok();
  };
  return with_head_dim(head_dim, launch);
}

template <typename Index>
Status sparse_attention_band_rows(const SlotPattern<Index>& w, bool causal, int32_t* rows, int32_t* key_ranges,
                                  Stream stream) {
  using namespace detail;
  static_assert(sizeof(BandRow) == 4 * sizeof(int32_t) && alignof(BandRow) == alignof(int32_t), "4 int32 a row");
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w, PatternNeeds::kForward));
  if (w.rows == 0) return Status::Ok();
  if (rows == nullptr || key_ranges == nullptr) return InvalidArgument("sparse_attention_band_rows: null output");
  if (reinterpret_cast<uintptr_t>(key_ranges) % alignof(int2) != 0)
    return InvalidArgument("sparse_attention_band_rows: key_ranges must start at an 8-byte boundary");
  return launch_band_rows(w, causal, reinterpret_cast<BandRow*>(rows), reinterpret_cast<int2*>(key_ranges), stream);
}

template <typename T>
int64_t sparse_attention_backward_workspace_bytes(int64_t lq, int64_t lk, int64_t nnz, int64_t bh, int64_t head_dim,
                                                  AttentionBands bands) {
  if (!sparse_attention_uses_bands<T>(head_dim, bands) || lq <= 0 || lk <= 0 || nnz <= 0 || bh <= 0) return 0;
  return detail::band_scratch(lq, lk, nnz, bh, head_dim, true).bytes;
}

template <typename T, typename Index>
Status sparse_attention_backward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, const float* lse,
                                 const T* dout, int64_t bh, int64_t head_dim, float scale, bool causal,
                                 float* row_dot, T* dq, T* dk, T* dv, void* workspace, AttentionBands bands,
                                 Stream stream) {
  using namespace detail;
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w));
  SNACK_RETURN_IF_ERROR(check_attention(w.rows, w.cols, bh, head_dim, w.nnz));
  if (bh == 0) return Status::Ok();
  if (w.rows > 0)
    SNACK_RETURN_IF_ERROR(check_arrays({{"q", q}, {"dout", dout}, {"dq", dq}}, {{"lse", lse}, {"row_dot", row_dot}}));
  if (w.cols > 0) SNACK_RETURN_IF_ERROR(check_arrays({{"k", k}, {"v", v}, {"dk", dk}, {"dv", dv}}, {}));
  const bool banded = w.nnz > 0 && w.rows > 0 && w.cols > 0 && sparse_attention_uses_bands<T>(head_dim, bands);
  if (banded) SNACK_RETURN_IF_ERROR(check_arrays({{"workspace", workspace}}, {}));
  const BandScratch scratch = band_scratch(w.rows, w.cols, w.nnz, bh, head_dim, true);
  char* const base = static_cast<char*>(workspace);
  const auto at = [&](int64_t offset) { return banded ? base + offset : nullptr; };
  BandRow* const band_rows = reinterpret_cast<BandRow*>(at(scratch.rows));
  int2* const key_ranges = reinterpret_cast<int2*>(at(scratch.key_ranges));
  int32_t* const query_first = reinterpret_cast<int32_t*>(at(scratch.query_first));
  int32_t* const query_last = reinterpret_cast<int32_t*>(at(scratch.query_last));
  int32_t* const residual_queries = reinterpret_cast<int32_t*>(at(scratch.residual_queries));
  float* const dq_partial = reinterpret_cast<float*>(at(scratch.dq));
  float* const dk_partial = reinterpret_cast<float*>(at(scratch.dk));
  float* const dv_partial = reinterpret_cast<float*>(at(scratch.dv));
  if (banded) {
    const int64_t key_blocks = ceil_div(w.cols, kBandKeys);
    SNACK_RETURN_IF_ERROR(launch_band_rows(w, causal, band_rows, key_ranges, stream));
    // 0x7f7f7f7f and -1: above and below every query, until the atomics find one.
    SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(query_first, 0x7f, key_blocks * sizeof(int32_t), stream));
    SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(query_last, 0xff, key_blocks * sizeof(int32_t), stream));
    attention_band_keys_kernel<<<unsigned(ceil_div(w.rows, 256)), 256, 0, stream>>>(band_rows, w.rows, query_first,
                                                                                   query_last);
    SNACK_RETURN_IF_ERROR(check_launch("attention_band_keys_kernel"));
    attention_band_csc_kernel<Index><<<unsigned(ceil_div(w.nnz, 256)), 256, 0, stream>>>(
        w.csc_perm, w.row_idx, w.nnz, band_rows, residual_queries);
    SNACK_RETURN_IF_ERROR(check_launch("attention_band_csc_kernel"));
  }
  const auto launch = [&](auto dim) -> Status {
    constexpr int D = decltype(dim)::value;
    const int64_t slice = banded ? scratch.heads : kMaxGridY;  // the bands' scratch serves each slice in turn
    for (int64_t b0 = 0; b0 < bh; b0 += slice) {  // offsets of this slice of batch x heads
      const int64_t qo = b0 * w.rows, ko = b0 * w.cols;
      const unsigned heads = unsigned(std::min(slice, bh - b0));
      const dim3 band_grid(unsigned(ceil_div(w.rows, kBandRows)), heads);
      [[maybe_unused]] const auto band_dq = [&](auto pass) -> Status {
        if constexpr (D != 32 && kIsHalfType<T>) {
          constexpr int kSmem = (2 * kBandRows + 4 * kBandKeys) * D * 2;
          const auto kernel = attention_band_dq_kernel<T, D, decltype(pass)::value>;
          SNACK_RETURN_IF_ERROR(allow_shared_memory(kernel, kSmem));
          kernel<<<band_grid, kBandWarps * 32, kSmem, stream>>>(band_rows, key_ranges, w.rows, w.cols, q + qo * D,
                                                                 k + ko * D, v + ko * D, lse + qo, dout + qo * D, scale,
                                                                 row_dot + qo, dq_partial, dq + qo * D);
          return check_launch("attention_band_dq_kernel");
        }
        return Status::Ok();
      };
      if (banded) SNACK_RETURN_IF_ERROR(band_dq(std::integral_constant<int, 0>{}));
      if (w.rows > 0) {
        const dim3 grid(unsigned(ceil_div(w.rows, kAttentionWarps)), heads);
        attention_dq_kernel<T, Index, D><<<grid, kAttentionWarps * 32, 0, stream>>>(
            w.row_ptr, w.col_idx, w.rows, w.cols, q + qo * D, k + ko * D, v + ko * D, lse + qo, dout + qo * D, scale,
            causal, band_rows, row_dot + qo, dq_partial, dq + qo * D);
        SNACK_RETURN_IF_ERROR(check_launch("attention_dq_kernel"));
      }
      if (banded) SNACK_RETURN_IF_ERROR(band_dq(std::integral_constant<int, 1>{}));
      if constexpr (D != 32 && kIsHalfType<T>) {
        if (banded) {
          constexpr int kQueries = D == 128 ? 32 : 64;
          constexpr int kSmem = (2 * kBandKeys + 4 * kQueries) * D * 2 + 8 * kQueries * 4;
          const auto kernel = attention_band_dkdv_kernel<T, D>;
          SNACK_RETURN_IF_ERROR(allow_shared_memory(kernel, kSmem));
          const dim3 grid(unsigned(ceil_div(w.cols, kBandKeys)), heads);
          kernel<<<grid, kBandWarps * 32, kSmem, stream>>>(band_rows, query_first, query_last, w.rows, w.cols,
                                                           q + qo * D, k + ko * D, v + ko * D, lse + qo, row_dot + qo,
                                                           dout + qo * D, scale, dk_partial, dv_partial);
          SNACK_RETURN_IF_ERROR(check_launch("attention_band_dkdv_kernel"));
        }
      }
      if (w.cols > 0) {
        const dim3 grid(unsigned(ceil_div(w.cols, kAttentionWarps)), heads);
        attention_dkdv_kernel<T, Index, D><<<grid, kAttentionWarps * 32, 0, stream>>>(
            w.col_ptr, w.csc_perm, w.row_idx, w.rows, w.cols, q + qo * D, k + ko * D, v + ko * D, lse + qo,
            row_dot + qo, dout + qo * D, scale, causal, residual_queries, query_first, query_last,
            dk_partial, dv_partial, dk + ko * D, dv + ko * D);
        SNACK_RETURN_IF_ERROR(check_launch("attention_dkdv_kernel"));
      }
    }
    return Status::Ok();
  };
  return with_head_dim(head_dim, launch);
}

#define SNACK_INSTANTIATE_ATTENTION(T, Index)                                                                      \
  template Status sparse_attention_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, const T*,      \
                                                     int64_t, int64_t, float, bool, T*, float*, void*,             \
                                                     AttentionBands, Stream);                                      \
  template Status sparse_attention_backward<T, Index>(const SlotPattern<Index>&, const T*, const T*, const T*,     \
                                                      const float*, const T*, int64_t, int64_t, float, bool,       \
                                                      float*, T*, T*, T*, void*, AttentionBands, Stream);

template bool sparse_attention_uses_bands<float>(int64_t, AttentionBands);
template bool sparse_attention_uses_bands<bfloat16>(int64_t, AttentionBands);
template bool sparse_attention_uses_bands<float16>(int64_t, AttentionBands);
template int64_t sparse_attention_forward_workspace_bytes<float>(int64_t, int64_t, int64_t, AttentionBands);
template int64_t sparse_attention_forward_workspace_bytes<bfloat16>(int64_t, int64_t, int64_t, AttentionBands);
template int64_t sparse_attention_forward_workspace_bytes<float16>(int64_t, int64_t, int64_t, AttentionBands);
template int64_t sparse_attention_backward_workspace_bytes<float>(int64_t, int64_t, int64_t, int64_t,
                                                                   int64_t, AttentionBands);
template int64_t sparse_attention_backward_workspace_bytes<bfloat16>(int64_t, int64_t, int64_t, int64_t,
                                                                   int64_t, AttentionBands);
template int64_t sparse_attention_backward_workspace_bytes<float16>(int64_t, int64_t, int64_t, int64_t,
                                                                   int64_t, AttentionBands);

template Status sparse_attention_band_rows<uint16_t>(const SlotPattern<uint16_t>&, bool, int32_t*, int32_t*, Stream);
template Status sparse_attention_band_rows<int32_t>(const SlotPattern<int32_t>&, bool, int32_t*, int32_t*, Stream);

SNACK_INSTANTIATE_ATTENTION(float, uint16_t)
SNACK_INSTANTIATE_ATTENTION(float, int32_t)
SNACK_INSTANTIATE_ATTENTION(bfloat16, uint16_t)
SNACK_INSTANTIATE_ATTENTION(bfloat16, int32_t)
SNACK_INSTANTIATE_ATTENTION(float16, uint16_t)
SNACK_INSTANTIATE_ATTENTION(float16, int32_t)

}  // namespace snack::cuda
