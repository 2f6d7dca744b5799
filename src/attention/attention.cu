// Fused sparse attention (include/snack/attention.h): a warp per query row (forward, dQ) or per key
// (dK, dV), its stored positions taken 32 at a time.
//
// For a window of 32 positions each lane loads, for every position t in turn, its D / 32 elements of
// the partner row (k_j for a query, q_i and dout_i for a key: coalesced rows) and keeps the partial
// dot product; a transposing butterfly (31 shuffles for 32 dot products) then leaves lane t with the
// whole dot product of position t. The softmax runs on those 32 lanes at once, online over the
// windows (running maximum and sum, the accumulator rescaled), and the weighted rows are summed
// into each lane's D / 32 elements of the output. Every sum has a fixed order: deterministic.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "snack/attention.h"

namespace snack::cuda {
namespace detail {
namespace {

constexpr int kAttentionWarps = 8;  // rows (or keys) per block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// part[t] holds this lane's share of the dot product of position t; afterwards part[0] holds the
// whole dot product of position `lane` (a butterfly that halves the positions each step).
__device__ __forceinline__ void transpose_sum(float (&part)[32]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int half = 16; half >= 1; half >>= 1) {
    const bool upper = lane & half;
#pragma unroll
    for (int t = 0; t < half; ++t) {
      const float send = upper ? part[t] : part[t + half];
      const float keep = upper ? part[t + half] : part[t];
      part[t] = keep + __shfl_xor_sync(0xffffffffu, send, half);
    }
  }
}

template <int E>
__device__ __forceinline__ float dot(const float (&a)[E], const float (&b)[E]) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) s = fmaf(a[e], b[e], s);
  return s;
}

template <typename T, int E>
__device__ __forceinline__ void load_row(const T* p, float (&out)[E]) {
  load_vec<T, E>(p, out);
}

template <typename T, int E>
__device__ __forceinline__ void store_row(T* p, const float (&v)[E], float scale) {
#pragma unroll
  for (int e = 0; e < E; ++e) p[e] = from_accum<T>(v[e] * scale);
}

// One window of a row's positions [p, p + 32) ∩ [p, end): the partner index of each lane's position
// (-1 past the end or masked out by causality) and the mask of valid lanes.
template <typename Index>
__device__ __forceinline__ unsigned window(const Index* idx, int32_t p, int32_t end, int64_t self, bool causal,
                                           bool partner_is_key, int32_t* partner) {
  const int lane = threadIdx.x & 31;
  const int32_t e = p + lane;
  int32_t j = e < end ? int32_t(idx[e]) : -1;
  if (j >= 0 && causal && (partner_is_key ? j > self : j < self)) j = -1;
  *partner = j;
  return __ballot_sync(0xffffffffu, j >= 0);
}

template <typename T, typename Index, int D>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_forward_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx, int64_t lq,
                             int64_t lk, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             float scale_log2, bool causal, T* __restrict__ out, float* __restrict__ lse) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (i >= lq) return;  // the whole warp
  const T* kb = k + bh * lk * D + lane * E;
  const T* vb = v + bh * lk * D + lane * E;
  float qr[E];
  load_row<T, E>(q + (bh * lq + i) * D + lane * E, qr);
#pragma unroll
  for (int e = 0; e < E; ++e) qr[e] *= scale_log2;  // scores in log2 units: exp2 below
  float m = -INFINITY, l = 0.f, acc[E] = {};
  const int32_t end = row_ptr[i + 1];
  for (int32_t p = row_ptr[i]; p < end; p += 32) {
    int32_t j;
    const unsigned valid = window(col_idx, p, end, i, causal, true, &j);
    if (valid == 0) continue;
    const int n = end - p < 32 ? int(end - p) : 32;
    float part[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      part[t] = 0.f;
      if (t < n && (valid >> t & 1u)) {
        float kr[E];
        load_row<T, E>(kb + int64_t(__shfl_sync(0xffffffffu, j, t)) * D, kr);
        part[t] = dot<E>(qr, kr);
      }
    }
    transpose_sum(part);
    const float s = j >= 0 ? part[0] : -INFINITY;
    float window_max = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) window_max = fmaxf(window_max, __shfl_xor_sync(0xffffffffu, window_max, off));
    const float m_new = fmaxf(m, window_max);
    const float rescale = exp2f(m - m_new);
    const float pr = j >= 0 ? exp2f(s - m_new) : 0.f;
    l = l * rescale + pr;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= rescale;
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      if (t < n && (valid >> t & 1u)) {
        const float pt = __shfl_sync(0xffffffffu, pr, t);
        float vr[E];
        load_row<T, E>(vb + int64_t(__shfl_sync(0xffffffffu, j, t)) * D, vr);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(pt, vr[e], acc[e]);
      }
    }
    m = m_new;
  }
  const float total = warp_sum(l);
  store_row<T, E>(out + (bh * lq + i) * D + lane * E, acc, total > 0.f ? 1.f / total : 0.f);
  if (lane == 0) lse[bh * lq + i] = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
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
                        float* __restrict__ row_dot, T* __restrict__ dq) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (i >= lq) return;
  const T* kb = k + bh * lk * D + lane * E;
  const T* vb = v + bh * lk * D + lane * E;
  const int64_t row = (bh * lq + i) * D + lane * E;
  float qr[E], dor[E];
  load_row<T, E>(q + row, qr);
  load_row<T, E>(dout + row, dor);
  const float scale_log2 = scale * kLog2e;
#pragma unroll
  for (int e = 0; e < E; ++e) qr[e] *= scale_log2;
  const float lse_log2 = lse[bh * lq + i] * kLog2e;
  const int32_t begin = row_ptr[i], end = row_ptr[i + 1];
  // The probability and dP of this lane's position in the window at p (0 and 0 where it is none).
  const auto probabilities = [&](int32_t p, int32_t& j, unsigned& valid, float& prob, float& dp) {
    valid = window(col_idx, p, end, i, causal, true, &j);
    prob = dp = 0.f;
    if (valid == 0) return;
    const int n = end - p < 32 ? int(end - p) : 32;
    float part_s[32], part_dp[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      part_s[t] = part_dp[t] = 0.f;
      if (t < n && (valid >> t & 1u)) {
        const int64_t jt = __shfl_sync(0xffffffffu, j, t);
        float kr[E], vr[E];
        load_row<T, E>(kb + jt * D, kr);
        load_row<T, E>(vb + jt * D, vr);
        part_s[t] = dot<E>(qr, kr);
        part_dp[t] = dot<E>(dor, vr);
      }
    }
    transpose_sum(part_s);
    transpose_sum(part_dp);
    if (j >= 0) {
      prob = exp2f(part_s[0] - lse_log2);
      dp = part_dp[0];
    }
  };
  float partial_dot = 0.f;
  for (int32_t p = begin; p < end; p += 32) {
    int32_t j;
    unsigned valid;
    float prob, dp;
    probabilities(p, j, valid, prob, dp);
    partial_dot = fmaf(prob, dp, partial_dot);
  }
  const float di = warp_sum(partial_dot);
  if (lane == 0) row_dot[bh * lq + i] = di;
  float acc[E] = {};
  for (int32_t p = begin; p < end; p += 32) {
    int32_t j;
    unsigned valid;
    float prob, dp;
    probabilities(p, j, valid, prob, dp);
    if (valid == 0) continue;
    const int n = end - p < 32 ? int(end - p) : 32;
    const float ds = prob * (dp - di);
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      if (t < n && (valid >> t & 1u)) {
        const float dst = __shfl_sync(0xffffffffu, ds, t);
        float kr[E];
        load_row<T, E>(kb + int64_t(__shfl_sync(0xffffffffu, j, t)) * D, kr);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(dst, kr[e], acc[e]);
      }
    }
  }
  store_row<T, E>(dq + row, acc, scale);
}

// dV_j = sum_i P_ij dout_i, dK_j = scale * sum_i dS_ij q_i over the queries i that store key j (the
// CSC view: entries [col_ptr[j], col_ptr[j + 1]), slots csc_perm[e], query row_idx[slot]).
template <typename T, typename Index, int D>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    attention_dkdv_kernel(const int32_t* __restrict__ col_ptr, const int32_t* __restrict__ csc_perm,
                          const Index* __restrict__ row_idx, int64_t lq, int64_t lk, const T* __restrict__ q,
                          const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                          const float* __restrict__ row_dot, const T* __restrict__ dout, float scale, bool causal,
                          T* __restrict__ dk, T* __restrict__ dv) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t j = int64_t(blockIdx.x) * kAttentionWarps + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  if (j >= lk) return;
  const T* qb = q + bh * lq * D + lane * E;
  const T* dob = dout + bh * lq * D + lane * E;
  const int64_t row = (bh * lk + j) * D + lane * E;
  float kr[E], vr[E];
  load_row<T, E>(k + row, kr);
  load_row<T, E>(v + row, vr);
  const float scale_log2 = scale * kLog2e;
#pragma unroll
  for (int e = 0; e < E; ++e) kr[e] *= scale_log2;
  float acc_k[E] = {}, acc_v[E] = {};
  const int32_t end = col_ptr[j + 1];
  for (int32_t p = col_ptr[j]; p < end; p += 32) {
    const int32_t e_lane = p + lane;
    int32_t i = e_lane < end ? int32_t(row_idx[csc_perm[e_lane]]) : -1;
    if (i >= 0 && causal && i < j) i = -1;
    const unsigned valid = __ballot_sync(0xffffffffu, i >= 0);
    if (valid == 0) continue;
    const int n = end - p < 32 ? int(end - p) : 32;
    float part_s[32], part_dp[32];
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      part_s[t] = part_dp[t] = 0.f;
      if (t < n && (valid >> t & 1u)) {
        const int64_t it = __shfl_sync(0xffffffffu, i, t);
        float qr[E], dor[E];
        load_row<T, E>(qb + it * D, qr);
        load_row<T, E>(dob + it * D, dor);
        part_s[t] = dot<E>(kr, qr);
        part_dp[t] = dot<E>(vr, dor);
      }
    }
    transpose_sum(part_s);
    transpose_sum(part_dp);
    float pr = 0.f, ds = 0.f;
    if (i >= 0) {
      pr = exp2f(part_s[0] - lse[bh * lq + i] * kLog2e);
      ds = pr * (part_dp[0] - row_dot[bh * lq + i]);
    }
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      if (t < n && (valid >> t & 1u)) {
        const int64_t it = __shfl_sync(0xffffffffu, i, t);
        const float pt = __shfl_sync(0xffffffffu, pr, t);
        const float dst = __shfl_sync(0xffffffffu, ds, t);
        float qr[E], dor[E];
        load_row<T, E>(qb + it * D, qr);
        load_row<T, E>(dob + it * D, dor);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          acc_v[e] = fmaf(pt, dor[e], acc_v[e]);
          acc_k[e] = fmaf(dst, qr[e], acc_k[e]);
        }
      }
    }
  }
  store_row<T, E>(dk + row, acc_k, scale);
  store_row<T, E>(dv + row, acc_v, 1.f);
}

Status check_attention(int64_t lq, int64_t lk, int64_t bh, int64_t head_dim, int64_t nnz) {
  if (!sparse_attention_supports(head_dim))
    return InvalidArgument("sparse_attention: the fused kernels run head_dim 32, 64 or 128, got " +
                           std::to_string(head_dim));
  if (bh > 65535) return InvalidArgument("sparse_attention: batch x heads above 65535");
  if (lq < 0 || lk < 0 || bh < 0 || nnz < 0) return InvalidArgument("sparse_attention: negative sizes");
  return Status::Ok();
}

}  // namespace
}  // namespace detail

template <typename T, typename Index>
Status sparse_attention_forward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, int64_t bh,
                                int64_t head_dim, float scale, bool causal, T* out, float* lse, Stream stream) {
  using namespace detail;
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w));
  SNACK_RETURN_IF_ERROR(check_attention(w.rows, w.cols, bh, head_dim, w.nnz));
  if (w.rows == 0 || bh == 0) return Status::Ok();
  const dim3 grid(unsigned(ceil_div(w.rows, kAttentionWarps)), unsigned(bh));
  const float s = scale * kLog2e;
  switch (head_dim) {
    case 32:
      attention_forward_kernel<T, Index, 32><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.row_ptr, w.col_idx, w.rows, w.cols, q, k, v, s, causal, out, lse);
      break;
    case 64:
      attention_forward_kernel<T, Index, 64><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.row_ptr, w.col_idx, w.rows, w.cols, q, k, v, s, causal, out, lse);
      break;
    default:
      attention_forward_kernel<T, Index, 128><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.row_ptr, w.col_idx, w.rows, w.cols, q, k, v, s, causal, out, lse);
      break;
  }
  return check_launch("attention_forward_kernel");
}

template <typename T, typename Index>
Status sparse_attention_backward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, const float* lse,
                                 const T* dout, int64_t bh, int64_t head_dim, float scale, bool causal,
                                 float* row_dot, T* dq, T* dk, T* dv, Stream stream) {
  using namespace detail;
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w));
  SNACK_RETURN_IF_ERROR(check_attention(w.rows, w.cols, bh, head_dim, w.nnz));
  if (bh == 0) return Status::Ok();
  const auto launch = [&](auto dim) -> Status {
    constexpr int D = decltype(dim)::value;
    if (w.rows > 0) {
      const dim3 grid(unsigned(ceil_div(w.rows, kAttentionWarps)), unsigned(bh));
      attention_dq_kernel<T, Index, D><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.row_ptr, w.col_idx, w.rows, w.cols, q, k, v, lse, dout, scale, causal, row_dot, dq);
      SNACK_RETURN_IF_ERROR(check_launch("attention_dq_kernel"));
    }
    if (w.cols > 0) {
      const dim3 grid(unsigned(ceil_div(w.cols, kAttentionWarps)), unsigned(bh));
      attention_dkdv_kernel<T, Index, D><<<grid, kAttentionWarps * 32, 0, stream>>>(
          w.col_ptr, w.csc_perm, w.row_idx, w.rows, w.cols, q, k, v, lse, row_dot, dout, scale, causal, dk, dv);
      SNACK_RETURN_IF_ERROR(check_launch("attention_dkdv_kernel"));
    }
    return Status::Ok();
  };
  switch (head_dim) {
    case 32: return launch(std::integral_constant<int, 32>{});
    case 64: return launch(std::integral_constant<int, 64>{});
    default: return launch(std::integral_constant<int, 128>{});
  }
}

#define SNACK_INSTANTIATE_ATTENTION(T, Index)                                                                      \
  template Status sparse_attention_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, const T*,      \
                                                     int64_t, int64_t, float, bool, T*, float*, Stream);           \
  template Status sparse_attention_backward<T, Index>(const SlotPattern<Index>&, const T*, const T*, const T*,     \
                                                      const float*, const T*, int64_t, int64_t, float, bool,       \
                                                      float*, T*, T*, T*, Stream);

SNACK_INSTANTIATE_ATTENTION(float, uint16_t)
SNACK_INSTANTIATE_ATTENTION(float, int32_t)
SNACK_INSTANTIATE_ATTENTION(bfloat16, uint16_t)
SNACK_INSTANTIATE_ATTENTION(bfloat16, int32_t)
SNACK_INSTANTIATE_ATTENTION(float16, uint16_t)
SNACK_INSTANTIATE_ATTENTION(float16, int32_t)

}  // namespace snack::cuda
