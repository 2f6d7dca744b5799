// The one definition of snack's operator schemas. Implementations: ops_cpu.cpp and ops_cuda.cpp
// (the products and constructors, per device), dst_ops.cpp and dst_ops_cuda.cpp (dynamic sparse
// training), autograd.cpp (the layer's autograd), plans.cpp (the planner's answers: explain,
// kernel_variants), python/snack/_ops.py (fake kernels for torch.compile).
//
// A sparse weight is `values` [nnz] plus its pattern, a list of tensors in the order of
// snack::pattern_fields() (src/torch/op_args.h):
//   row_idx [nnz], col_idx [nnz]   uint16 or int32, the slots sorted row-major
//   row_ptr [M+1], col_ptr [K+1], csc_perm [nnz]   int32, the derived CSR and CSC views
//   tile_ptr, tile_entries   int32, the tile view (snack/pattern.h), or both empty
// M and K are read from row_ptr and col_ptr, nnz from col_idx. A pattern kept for inference
// (Pattern.for_inference) has row_idx and csc_perm empty: the forward products take it (spmm,
// spmm_channels_first, sparse_attention_fwd, sparse_linear where nothing needs a gradient, explain
// of the forward), every other op refuses it.
// AdamW's state of a parameter is a list [exp_avg, exp_avg_sq, step] (moments shaped like it, the
// float32 count of updates on its device) and its settings a list [lr, beta1, beta2, eps,
// weight_decay, maximize as 0 or 1].
#include <torch/library.h>

TORCH_LIBRARY(snack, m) {
  // ---- Products ----
  // Y = act(X W^T (+ bias)): x [N, K] -> [N, M]. activation: none, relu, gelu (exact). variant: "auto"
  // (the process default, see set_default_spmm_variant) or a CUDA kernel (kernel_variants()).
  // tiles: the weight's values in tile order, made from these values and pattern: packed tile values
  // (pack_tile_values) or tile fragments (pack_tile_fragments), which the tile_view kernels then read
  // in place of the values; the CPU checks that they are the values' packing.
  m.def("spmm(Tensor x, Tensor values, Tensor[] pattern, Tensor? bias=None, str activation=\"none\", "
        "str variant=\"auto\", Tensor? tiles=None) -> Tensor");
  // The packed tile values of 16-bit values over a pattern that holds the tile view (snack/pattern.h):
  // [tile_view_entries_length, 2] in the values' dtype, each entry's position in its tile and its
  // value as one 32-bit word. A copy of the values: pack again after they or the pattern change.
  m.def("pack_tile_values(Tensor values, Tensor[] pattern) -> Tensor");
  // The tile fragments of 16-bit values over a pattern that holds the tile view (snack/pattern.h):
  // int32 [tile_fragment_layout(...).words], the A operands of mma.sync tile by tile, only the
  // registers that hold a slot. A copy of the values: pack again after they or the pattern change.
  // transposed: W^T's fragments (dX = dY W as the forward of W^T), the same length.
  m.def("pack_tile_fragments(Tensor values, Tensor[] pattern, bool transposed=False) -> Tensor");
  // The forward as a fused training step runs it: y as spmm computes it, and x_t, X transposed where
  // the CUDA plan made that copy of the whole batch (else an empty tensor), for sddmm_adamw_.
  m.def("spmm_for_step(Tensor x, Tensor values, Tensor[] pattern, Tensor? bias=None, str activation=\"none\")"
        " -> (Tensor y, Tensor x_t)");
  // dX = dY W: dy [N, M] -> [N, K]. Same kernels as spmm, over the CSC view (forward-only ones excluded).
  m.def("spmm_t(Tensor dy, Tensor values, Tensor[] pattern, str variant=\"auto\") -> Tensor");
  // dv[s] = sum_n dy[n, row(s)] * x[n, col(s)]: -> [nnz], the weight gradient at the stored slots.
  // variant: "auto" or a CUDA kernel: slot, vector, rows (the CPU ignores it).
  m.def("sddmm(Tensor dy, Tensor x, Tensor[] pattern, str variant=\"auto\") -> Tensor");
  // The forward on channels-first activations, a 1x1 convolution on NCHW images:
  // x [B, K, P] -> y [B, M, P], y[b, r, p] = act(sum_{s in row r} values[s] x[b, col(s), p] (+ bias[r])).
  // No autograd (inference; snack.SparseConv2d trains through spmm on pixels as rows). variant: "auto"
  // (the planner), "in_place", "pixel_rows" or "dense_blocks" (snack/spmm.h, ChannelsFirstPath); the
  // CPU reads the images in place whatever it names.
  m.def("spmm_channels_first(Tensor x, Tensor values, Tensor[] pattern, Tensor? bias=None, "
        "str activation=\"none\", str variant=\"auto\") -> Tensor");
  // A depthwise-separable convolution (snack/conv.h), inference: x [B, C, H, W] -> [B, M, H', W'],
  // a 3x3 depthwise convolution (dw_weight [C, 1, 3, 3], padding 1, stride 1 or 2) with dw_bias and
  // dw_activation, then the sparse 1x1 convolution of values over pattern ([M, C]) with bias and
  // activation. variant "auto": on CUDA one fused kernel (x channels_last or NCHW) where its tile fits,
  // else the two apart; "fused" / "unfused" force either (the CPU runs them apart). The output has
  // x's memory format. No autograd.
  m.def("separable_conv(Tensor x, Tensor dw_weight, Tensor? dw_bias, int stride, str dw_activation, Tensor values, "
        "Tensor[] pattern, Tensor? bias=None, str activation=\"none\", str variant=\"auto\") -> Tensor");
  // db = dy.sum(0): dy [N, M] -> [M].
  m.def("bias_grad(Tensor dy) -> Tensor");
  // One AdamW step (torch.optim.AdamW's arithmetic) of values from their gradient sddmm(dy, x), fused:
  // the gradient is never stored. values and its state are updated in place; the step count is
  // advanced by one first and the update uses the new count. bias (with bias_state and bias_hyper,
  // its own group's; bias_state empty without one): updated too, from bias_grad(dy) (on the GPU in the SDDMM's pass over dY).
  // x_t: the forward's copy of X transposed (spmm_for_step), read instead of transposing X again.
  // dy and x have the values' dtype, or are 16-bit with float32 values, state and bias (mixed
  // precision: the gradient is computed from them and rounded to their dtype before the update).
  m.def("sddmm_adamw_(Tensor dy, Tensor x, Tensor[] pattern, Tensor(a!) values, Tensor(b!)[] state, "
        "float[] hyper, Tensor(c!)[] bias_state, Tensor(d!)? bias=None, float[] bias_hyper=[], Tensor? x_t=None, "
        "str variant=\"auto\") -> ()");
  // The same for a bias from its gradient bias_grad(dy), in place.
  m.def("bias_grad_adamw_(Tensor dy, Tensor(a!) bias, Tensor(b!)[] state, float[] hyper) -> ()");

  // Fused sparse attention (CUDA; include/snack/attention.h): q [BH, Lq, D], k and v [BH, Lk, D],
  // contiguous, one Lq x Lk pattern for every batch and head, D 32, 64 or 128. softmax(scale q k^T at the
  // stored positions (with causal, j <= i only)) v -> (out [BH, Lq, D], lse [BH, Lq] float32, the log
  // of each row's softmax denominator); the backward recomputes the probabilities from lse.
  // bands=False keeps every position on the lane-per-position kernels (for comparisons; the default
  // runs each row's run of consecutive keys on tensor cores in 16 bits where it pays, forward and
  // backward alike).
  m.def("sparse_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor[] pattern, float scale, bool causal, "
        "bool bands=True) -> (Tensor, Tensor)");
  m.def("sparse_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor lse, Tensor dout, Tensor[] pattern, "
        "float scale, bool causal, bool bands=True) -> (Tensor, Tensor, Tensor)");
  // The forward's bands of a pattern (CUDA): rows [Lq, 4] int32 (each query's run of slots [begin,
  // end) and its keys [first, last]; begin == end where the row has none) and key_ranges [ceil(Lq /
  // 64), 2] int32 (the keys of each block of 64 queries' tiles; first > last where it has none).
  m.def("sparse_attention_bands(Tensor[] pattern, bool causal) -> (Tensor, Tensor)");

  // ---- The layer ----
  // act(x W^T + b), x [..., K] -> [..., M], differentiable in x, values and bias.
  m.def("sparse_linear(Tensor x, Tensor values, Tensor? bias, Tensor[] pattern, str activation=\"none\") -> Tensor");
  // The layer whose backward applies AdamW to values at once (sddmm_adamw_) instead of returning
  // their gradient: differentiable in x (and in the bias unless bias_state is given); values and
  // state are updated in place by the backward, after dX has used the old values.
  // update_guard: None, or a one-element int64 CPU tensor; the backward raises if it is non-zero,
  // then sets it (snack.optim.AdamW clears it in step(): no second update before a step).
  // bias_state and bias_hyper (the bias's own group; bias_state empty: none): the backward updates the bias the same way,
  // in sddmm_adamw_'s pass, and returns no gradient for it either.
  // x may be 16-bit with float32 values and bias (mixed precision, as torch.autocast passes them):
  // the products then read 16-bit copies, and the update writes the float32 masters.
  m.def("sparse_linear_adamw(Tensor x, Tensor values, Tensor? bias, Tensor[] pattern, Tensor[] state, "
        "float[] hyper, Tensor[] bias_state, Tensor? update_guard=None, float[] bias_hyper=[], "
        "str activation=\"none\") -> Tensor");

  // ---- Plans and names ----
  // The plan of the CUDA product `op` (forward, input_grad, weight_grad) for a batch of n rows on
  // this weight: (variant, reason, batch_tile, lanes_per_row, rows_per_warp, grid, threads,
  // smem_bytes, workspace_bytes, prefetch_l2, description). A CPU weight: variant "cpu".
  // op channels_first: the path of spmm_channels_first on n pixels in all, `pixels` per image (a
  // divisor of n). packed / fragments: the forward as spmm plans it when given packed tile values /
  // tile fragments.
  m.def("explain(Tensor values, Tensor[] pattern, int n, str op=\"forward\", str variant=\"auto\", "
        "str activation=\"none\", int pixels=1, bool packed=False, bool fragments=False) -> "
        "(str, str, int, int, int, int, int, int, int, bool, str)");
  // Sets the variant that "auto" means for this process (for A/B runs); "auto" restores the planner.
  m.def("set_default_spmm_variant(str variant) -> ()");
  // How the transposed products of this process read the CSC view: "auto" (the planner),
  // "in_place" (through csc_perm) or "copied" (gathered first into a CSR copy of W^T).
  m.def("set_default_csc_read(str csc) -> ()");
  // Blocks per band of the tile_view products (SpMM and SDDMM) of this process, for A/B runs of the
  // grid: 0 (the planner's choice) or a count the planner checks against each product.
  m.def("set_default_tile_view_splits(int splits) -> ()");
  // Consumer warpgroups per block of the wgmma forwards over tile fragments of this process: 0 (the
  // planner's choice), 1 or 2.
  m.def("set_default_fragment_warpgroups(int groups) -> ()");
  // The kernel variants: (forward, input_grad, weight_grad, nondeterministic), by name.
  m.def("kernel_variants() -> (str[], str[], str[], str[])");
  // The names of the pattern's tensors, in the order the ops take them.
  m.def("pattern_fields() -> str[]");
  // Bits of the slot indices a rows x cols pattern gets by default (16 or 32), and the slots a layer
  // keeps at a density: the rules every constructor shares.
  m.def("index_bits(int out_features, int in_features) -> int");
  m.def("dense_block_min_rows() -> int");
  // The tile view's geometry (snack/pattern.h): rows and columns of a tile, the widest layer that has it.
  m.def("tile_view_geometry() -> int[]");
  // Words of the tile fragments (pack_tile_fragments) of a rows x cols pattern of nnz slots; 0 where
  // it has no tile view.
  m.def("tile_fragment_words(int rows, int cols, int nnz) -> int");
  // The paths spmm_channels_first may take on CUDA (snack/spmm.h, ChannelsFirstPath), but "auto".
  m.def("channels_first_paths() -> str[]");
  m.def("nnz_for_density(int out_features, int in_features, float density) -> int");

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
  // Checks slots as every pattern constructor does: in range, sorted row-major, no repeats (IndexError
  // or ValueError naming the first bad slot). O(nnz); device tensors are checked on the host (one copy).
  m.def("validate_slots(Tensor row_idx, Tensor col_idx, int out_features, int in_features) -> ()");
  // Checks a whole pattern list: its slots, and that its views are the ones build_views derives.
  // The CUDA products trust their pattern (checking it would cost a synchronisation per call);
  // snack.Pattern validates what it is built from, and this op checks a list assembled by hand.
  m.def("validate_pattern(Tensor[] pattern) -> ()");
  // The CSR row pointers, the CSC view and the tile view (snack/pattern.h; both empty for layers of
  // more than 16384 inputs, or with tile_view false: not built) of sorted slots. On the CPU the slots
  // are checked first (an error for invalid slots); on the GPU nothing synchronises and the slots are trusted (the
  // kernels stay within their buffers, the views of invalid slots are meaningless).
  m.def("build_views(Tensor row_idx, Tensor col_idx, int out_features, int in_features, bool tile_view=True)"
        " -> (Tensor row_ptr, Tensor col_ptr, Tensor csc_perm, Tensor tile_ptr, Tensor tile_entries)");

  // ---- Dynamic sparse training (dst_ops.cpp): nnz never changes ----
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
