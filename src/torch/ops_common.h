// What the CPU and CUDA implementations of each operator share: their inputs, checked once
// (ops_common.cpp), and the steps that ATen does the same way on every device.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "op_args.h"

namespace snack::binding {

// spmm / spmm_for_step: x [N, K] (made contiguous), values, pattern, bias [M], the activation;
// spmm_channels_first: x [B, K, pixels] (channels_first).
struct SpmmInputs {
  PatternArg p;
  at::Tensor x;
  std::optional<at::Tensor> bias;
  Activation act = Activation::kNone;
};
SpmmInputs spmm_inputs(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                       const std::optional<at::Tensor>& bias, c10::string_view activation, const char* op,
                       bool channels_first = false);

// spmm's values in tile order, `tiles`, made from these values and pattern, on their device,
// contiguous: packed tile values (pack_tile_values: [entries, 2] in the values' 16-bit dtype) or tile
// fragments (pack_tile_fragments: int32 [tile_fragment_layout(...).words]). What the kernels read
// and which of the two (words nullptr and kind kNone where none is given).
struct GivenTiles {
  const uint32_t* words = nullptr;
  TileValues kind = TileValues::kNone;
};
GivenTiles packed_tiles_arg(const std::optional<at::Tensor>& tiles, const at::Tensor& values, const PatternArg& p,
                            const char* op);

// pack_tile_values and pack_tile_fragments: 16-bit values of a pattern that holds a tile view;
// returns the empty output of the layout `kind` (kPacked: [tile_view_entries_length, 2] in the
// values' dtype; kFragments: int32 [tile_fragment_layout(...).words]).
at::Tensor empty_tiles(const at::Tensor& values, const PatternArg& p, TileValues kind, const char* op);

// spmm_t: dy [N, M] (contiguous), values, pattern.
struct SpmmTInputs {
  PatternArg p;
  at::Tensor dy;
};
SpmmTInputs spmm_t_inputs(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern, const char* op);

// sddmm: dy [N, M] and x [N, K] (contiguous) of one value dtype, the pattern's device.
struct SddmmInputs {
  PatternArg p;
  at::Tensor dy, x;
};
SddmmInputs sddmm_inputs(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& like,
                         const char* op);

// Whether a fused AdamW step updates float32 parameters from 16-bit operands (dy, x): mixed
// precision, as under torch.autocast. Otherwise operands and parameters share one dtype.
bool is_mixed_precision(const at::Tensor& operand, const at::Tensor& param);

// sddmm_adamw_: the SDDMM's inputs, the values' AdamW state and, given together, the bias's.
// dy and x have the values' dtype, or a 16-bit one with float32 values and bias (mixed precision).
struct SddmmAdamWInputs {
  SddmmInputs s;
  AdamWArg values;
  std::optional<AdamWArg> bias;
};
SddmmAdamWInputs sddmm_adamw_inputs(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern,
                                    const at::Tensor& values, at::TensorList state, at::ArrayRef<double> hyper,
                                    const std::optional<at::Tensor>& bias, at::TensorList bias_state,
                                    at::ArrayRef<double> bias_hyper, const char* op);

// bias_grad / bias_grad_adamw_: dy 2-D (contiguous).
at::Tensor bias_grad_input(const at::Tensor& dy, const char* op);

// slots_from_coo: rows and cols as contiguous int64 on one device, the index dtype.
struct CooInputs {
  at::Tensor rows, cols;
  at::ScalarType index_type;
};
CooInputs coo_inputs(const at::Tensor& rows, const at::Tensor& cols, int64_t out_features, int64_t in_features,
                     std::optional<at::ScalarType> index_dtype, const char* op);

// slots_from_dense: the weight as contiguous float (or double), its shape, the index dtype.
struct DenseInputs {
  at::Tensor dense;
  int64_t rows, cols;
  at::ScalarType index_type;
};
DenseInputs dense_inputs(const at::Tensor& dense, int64_t nnz, std::optional<at::ScalarType> index_dtype,
                         const char* op);

// Slot arrays of any integer type (the DST ops also take int64 ones): 1-D, one length, one device.
void check_slot_pair(const at::Tensor& row_idx, const at::Tensor& col_idx, const char* op);
// build_views: the slot arrays, checked.
void check_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features, int64_t in_features,
                 const char* op);

// Slot indices (row, col) of ascending linear positions row * in_features + col, in `index_type`.
std::tuple<at::Tensor, at::Tensor> split_positions(const at::Tensor& positions, int64_t in_features,
                                                   at::ScalarType index_type);

// The outputs of slots_from_coo, on the positions' device: row_idx and col_idx [nnz] in the index
// dtype, order [nnz] int64.
struct CooOutputs {
  at::Tensor row_idx, col_idx, order;
};
CooOutputs empty_coo_outputs(const at::Tensor& rows, const CooInputs& in);

// The outputs of build_views, on the slots' device, int32: row_ptr [out+1], col_ptr [in+1], csc_perm [nnz],
// and the tile view (tile_ptr, tile_entries: tile_view_ptr_length and tile_view_entries_length).
struct ViewOutputs {
  at::Tensor row_ptr, col_ptr, csc_perm, tile_ptr, tile_entries;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuple() const {
    return {row_ptr, col_ptr, csc_perm, tile_ptr, tile_entries};
  }
};
// tile_view false: the tile view's arrays are empty (not built).
ViewOutputs empty_views(const at::Tensor& row_idx, int64_t out_features, int64_t in_features, bool tile_view);

// bias_grad_adamw_: dy as contiguous [N, M] of the bias's dtype and device, and the bias's AdamW state.
struct BiasAdamWInputs {
  at::Tensor dy;
  AdamWArg bias;
};
BiasAdamWInputs bias_grad_adamw_inputs(const at::Tensor& dy, const at::Tensor& bias, at::TensorList state,
                                       at::ArrayRef<double> hyper, const char* op);

// The counts advance on the device (no host synchronisation): the CPU implementations and the
// empty products call this, the CUDA kernels advance them on their own.
void advance_steps(const SddmmAdamWInputs& in);

}  // namespace snack::binding
