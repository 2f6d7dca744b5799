// Attention over the stored positions of a sparse seq x seq pattern, fused: the scores at the
// stored positions, a numerically stable (online) softmax over each query's stored keys, and the
// weighted sum of the values, in one pass per query, so that the probabilities are never stored.
//
// Layout (PyTorch's, contiguous): q [BH, Lq, D], k and v [BH, Lk, D] with BH = batch x heads, one
// pattern (Lq x Lk, its CSR and CSC views) shared by every batch and head. Scores are
// s = scale * q_i . k_j, softmax over the stored j of row i (with causal, only j <= i, both counted
// from the first query and key, also when Lq != Lk); a row with no such j gives zeros and lse -inf.
// lse [BH, Lq] is log(sum_j exp(s_ij)) of each row, in float32, what the backward recomputes the
// probabilities from. The 16-bit types compute in float32 and round each output once. D: 32, 64 or
// 128. q, k, v, out and the gradients start at 16-byte boundaries (rows are read as 16-byte vectors):
// the functions return InvalidArgument otherwise.
#pragma once

#include <cstdint>

#include "snack/pattern.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack::cuda {

/// Queries per block of the bands (the blocks of sparse_attention_band_rows' key_ranges).
inline constexpr int kAttentionBandRows = 64;

/// Whether the fused kernels run this head dimension.
inline bool sparse_attention_supports(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

/// Which kernels the forward and backward run. kAuto: in 16 bits at head_dim 64 and 128, each row's
/// longest run of consecutive keys (the local window of the usual patterns) on tensor cores wherever
/// the runs of a block of 64 queries are long enough and fill enough of their common key range, the
/// other positions on the lane-per-position kernels, the two parts merged by their log-sum-exps
/// (forward) or added in float32 (backward); otherwise (and with kOff) every position on the
/// lane-per-position kernels.
enum class AttentionBands { kAuto, kOff };

/// Whether the forward and backward in T run the bands for this head dimension (whatever the pattern).
template <typename T>
bool sparse_attention_uses_bands(int64_t head_dim, AttentionBands bands);

/// Bytes of device scratch the forward needs (0 where it does not run the bands): per query row
/// 16 bytes, and per (batch x head, query row) head_dim + 1 floats for a slice of the heads at a time
/// (as many as fit 64 MiB, at least one).
template <typename T>
int64_t sparse_attention_forward_workspace_bytes(int64_t lq, int64_t bh, int64_t head_dim, AttentionBands bands);

/// The forward's split of a pattern into bands (where it runs them): for each query row, its run of
/// slots [run_begin, run_end) and the run's keys [key_first, key_last] (rows [Lq][4] int32; an empty
/// run has run_begin == run_end and key_first > key_last), and for each block of kAttentionBandRows
/// queries the keys the bands' tiles cover (key_ranges [ceil(Lq / kAttentionBandRows)][2] int32, first
/// > last where none). With causal the runs hold keys j <= i only.
template <typename Index>
Status sparse_attention_band_rows(const SlotPattern<Index>& w, bool causal, int32_t* rows, int32_t* key_ranges,
                                  Stream stream);

/// out [BH, Lq, D] and lse [BH, Lq] from q, k, v over the pattern's CSR view (w.rows = Lq, w.cols = Lk).
/// workspace: sparse_attention_forward_workspace_bytes(...) bytes at a 16-byte boundary (may be null
/// where that is 0).
template <typename T, typename Index>
Status sparse_attention_forward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, int64_t bh,
                                int64_t head_dim, float scale, bool causal, T* out, float* lse, void* workspace,
                                AttentionBands bands, Stream stream);

/// Bytes of device scratch the backward needs (0 where it does not run the bands): per query row 16
/// bytes, per stored position 4, per (batch x head, query or key row) head_dim floats (dq's, dk's and
/// dv's partial sums) for a slice of the heads at a time (as many as fit 64 MiB, at least one).
template <typename T>
int64_t sparse_attention_backward_workspace_bytes(int64_t lq, int64_t lk, int64_t nnz, int64_t bh, int64_t head_dim,
                                                  AttentionBands bands);

/// dq, dk, dv from the forward's lse and the gradient dout (the probabilities recomputed): dq over the
/// CSR view, dk and dv over the CSC view (a warp per key, its queries in row order); with the bands
/// (as in the forward) their positions by blocks on tensor cores, the parts added in float32 before
/// the one rounding. row_dot [BH, Lq] is float32 scratch (sum_j P_ij dP_ij of each row, dP = dout v^T);
/// workspace: sparse_attention_backward_workspace_bytes(...) bytes at a 16-byte boundary (may be null
/// where that is 0).
template <typename T, typename Index>
Status sparse_attention_backward(const SlotPattern<Index>& w, const T* q, const T* k, const T* v, const float* lse,
                                 const T* dout, int64_t bh, int64_t head_dim, float scale, bool causal,
                                 float* row_dot, T* dq, T* dk, T* dv, void* workspace, AttentionBands bands,
                                 Stream stream);

}  // namespace snack::cuda
