// The one definition of snack's operator schemas. Implementations: kernels.cpp (CPU, CUDA),
// autograd.cpp (sparse_linear's autograd), python/snack/_ops.py (fake kernels for torch.compile).
//
// A sparse weight is always passed as `values` plus its five pattern tensors, in this order:
//   row_idx [nnz], col_idx [nnz]   uint16 or int32, the slots sorted row-major
//   row_ptr [M+1], col_ptr [K+1], csc_perm [nnz]   int32, the derived CSR and CSC views
// M and K are read from row_ptr and col_ptr.
#include <torch/library.h>

TORCH_LIBRARY(snack, m) {
  // Y = act(X W^T (+ bias)): x [N, K] -> [N, M]. activation: none, relu, gelu (exact). variant: "auto"
  // (the process default, see set_default_spmm_variant) or a CUDA kernel variant: warp_row, smem_x,
  // global_xt, global_x, wide_rows, coo_atomic.
  m.def("spmm(Tensor x, Tensor values, Tensor row_idx, Tensor col_idx, Tensor row_ptr, Tensor col_ptr, "
        "Tensor csc_perm, Tensor? bias, str activation=\"none\", str variant=\"auto\") -> Tensor");
  // dX = dY W: dy [N, M] -> [N, K]. Same kernels as spmm, over the CSC view (wide_rows and coo_atomic excluded).
  m.def("spmm_t(Tensor dy, Tensor values, Tensor row_idx, Tensor col_idx, Tensor row_ptr, Tensor col_ptr, "
        "Tensor csc_perm, str variant=\"auto\") -> Tensor");
  // dv[s] = sum_n dy[n, row(s)] * x[n, col(s)]: -> [nnz], the weight gradient at the stored slots.
  // variant: "auto" or a CUDA kernel: slot, vector, rows (the CPU ignores it).
  m.def("sddmm(Tensor dy, Tensor x, Tensor row_idx, Tensor col_idx, Tensor row_ptr, Tensor col_ptr, "
        "Tensor csc_perm, str variant=\"auto\") -> Tensor");
  // db = dy.sum(0): dy [N, M] -> [M].
  m.def("bias_grad(Tensor dy) -> Tensor");
  // One AdamW step (torch.optim.AdamW's arithmetic) of values from their gradient sddmm(dy, x),
  // fused: the gradient is never stored. values, exp_avg, exp_avg_sq [nnz] are updated in place;
  // step (float32, one element, on values' device) is advanced by one first and the update uses the
  // new count. variant as for sddmm. bias, bias_exp_avg, bias_exp_avg_sq [M], bias_step and
  // bias_hyper ([lr, beta1, beta2, eps, weight_decay, maximize as 0 or 1], the bias's own group),
  // given together: the bias is updated too, from bias_grad(dy), as bias_grad_adamw_ would (on the
  // GPU in the rows kernel's pass over dY, with no launch of its own).
  m.def("sddmm_adamw_(Tensor dy, Tensor x, Tensor row_idx, Tensor col_idx, Tensor row_ptr, Tensor col_ptr, "
        "Tensor csc_perm, Tensor(a!) values, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool maximize=False, str variant=\"auto\", "
        "Tensor(e!)? bias=None, Tensor(f!)? bias_exp_avg=None, Tensor(g!)? bias_exp_avg_sq=None, "
        "Tensor(h!)? bias_step=None, float[]? bias_hyper=None) -> ()");
  // The same for a bias from its gradient bias_grad(dy): bias, exp_avg, exp_avg_sq [M] in place.
  m.def("bias_grad_adamw_(Tensor dy, Tensor(a!) bias, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!) step, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, bool maximize=False) -> ()");
  // The layer: act(x W^T + b), x [..., K] -> [..., M], differentiable in x, values and bias.
  m.def("sparse_linear(Tensor x, Tensor values, Tensor? bias, Tensor row_idx, Tensor col_idx, Tensor row_ptr, "
        "Tensor col_ptr, Tensor csc_perm, str activation=\"none\") -> Tensor");
  // The layer whose backward applies AdamW to values at once (sddmm_adamw_) instead of returning
  // their gradient: differentiable in x and bias; values, exp_avg, exp_avg_sq and step are updated
  // in place by the backward, after dX has used the old values (snack.optim.AdamW calls it).
  // update_guard: None, or a one-element int64 CPU tensor; the backward raises if it is non-zero,
  // then sets it (snack.optim.AdamW clears it in step(): no second update before a step).
  // bias_exp_avg, bias_exp_avg_sq, bias_step and bias_hyper ([lr, beta1, beta2, eps, weight_decay,
  // maximize as 0 or 1], the bias's own group): given together, the backward updates the bias the
  // same way (in sddmm_adamw_'s pass) and returns no gradient for it either.
  m.def("sparse_linear_adamw(Tensor x, Tensor values, Tensor? bias, Tensor row_idx, Tensor col_idx, "
        "Tensor row_ptr, Tensor col_ptr, Tensor csc_perm, Tensor exp_avg, Tensor exp_avg_sq, Tensor step, "
        "Tensor? update_guard, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool maximize=False, str activation=\"none\", Tensor? bias_exp_avg=None, Tensor? bias_exp_avg_sq=None, "
        "Tensor? bias_step=None, float[]? bias_hyper=None) -> Tensor");

  // Which kernel spmm (or spmm_t when transposed) runs for a batch of n rows on this weight, and why.
  m.def("explain_spmm(Tensor values, Tensor row_ptr, Tensor col_ptr, int n, bool transposed=False, "
        "str variant=\"auto\") -> str");
  // Sets the variant that "auto" means for this process (for A/B runs); "auto" restores the planner.
  m.def("set_default_spmm_variant(str variant) -> ()");

  // ---- Topology: building patterns (validating, so they synchronise once with the device) ----
  // Sorts COO positions into slots; values_sorted = values[order]. index_dtype: uint16 / int32 / None (auto).
  m.def("slots_from_coo(Tensor rows, Tensor cols, int out_features, int in_features, ScalarType? index_dtype=None)"
        " -> (Tensor row_idx, Tensor col_idx, Tensor order)");
  // The nnz largest-magnitude entries of a dense [M, K] weight (ties to the smaller position);
  // positions are the ascending linear indices, values = dense.flatten()[positions].
  m.def("slots_from_dense(Tensor dense, int nnz, ScalarType? index_dtype=None)"
        " -> (Tensor row_idx, Tensor col_idx, Tensor positions)");
  // The non-zero entries of a [M, K] mask (any dtype; True / non-zero = kept).
  m.def("slots_from_mask(Tensor mask, ScalarType? index_dtype=None)"
        " -> (Tensor row_idx, Tensor col_idx, Tensor positions)");
  // nnz distinct positions drawn uniformly at random without replacement, on `device`.
  m.def("random_slots(int out_features, int in_features, int nnz, *, Generator? generator=None, "
        "Device? device=None, ScalarType? index_dtype=None) -> (Tensor row_idx, Tensor col_idx)");
  // CSR row pointers and CSC view of sorted slots (no synchronisation).
  m.def("build_views(Tensor row_idx, Tensor col_idx, int out_features, int in_features)"
        " -> (Tensor row_ptr, Tensor col_ptr, Tensor csc_perm)");

  // ---- Dynamic sparse training (topology_update.cpp): nnz never changes ----
  // The k slots of lowest score (ties: lower slot; NaN scores count as +inf), ascending.
  m.def("prune_slots(Tensor score, int k) -> Tensor");
  // k distinct absent positions, uniformly at random, ascending.
  m.def("sample_absent(Tensor row_idx, Tensor col_idx, int out_features, int in_features, int k, *, "
        "Generator? generator=None) -> Tensor");
  // The k absent positions of largest |dy^T x| (ties: smaller position; NaN counts as 0), ascending,
  // block_rows rows at a time (0: about 2^23 scores per block). On the GPU with N <= 256 the scores
  // are recomputed in registers instead, and block_rows does not matter.
  m.def("topk_absent_gradient(Tensor dy, Tensor x, Tensor row_idx, Tensor col_idx, int k, int block_rows)"
        " -> Tensor");
  // Slots `drop` freed and refilled with positions `grow`: the new sorted slot arrays and, per new
  // slot, the old slot it came from (-1 = grown). validate=True checks drop/grow first (host syncs);
  // False trusts them (they come from prune_slots / sample_absent / topk_absent_gradient): no sync.
  m.def("replace_slots(Tensor row_idx, Tensor col_idx, Tensor drop, Tensor grow, int out_features, "
        "int in_features, bool validate=True) -> (Tensor row_idx, Tensor col_idx, Tensor source)");
  // target[s] <- target[source[s]] where source[s] >= 0, else fill (a scalar or one value per slot):
  // a per-slot tensor following replace_slots' permutation, in place. source comes from
  // replace_slots; an entry >= nnz raises on the CPU and takes the fill on the GPU (no host sync).
  m.def("remap_slots_(Tensor(a!) target, Tensor source, Tensor fill) -> ()");
}
