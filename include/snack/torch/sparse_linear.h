// snack::SparseLinear for libtorch programs: the C++ twin of Python's snack.SparseLinear.
//
// The weight is `nnz` trainable values at fixed slots of an out_features x in_features matrix (the
// layer's Pattern); only those are stored and computed. Link against libsnack_torch
// (find_package(snack)).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>

#include "snack/torch/pattern.h"

namespace snack {

struct SparseLinearOptions {
  SparseLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// Fraction of the out_features x in_features positions that are stored, in (0, 1]; the count is
  /// nnz_for_density() of it, as in Python.
  TORCH_ARG(double, density) = 0.1;
  TORCH_ARG(bool, bias) = true;
  /// Seed of the random pattern (positions drawn uniformly without replacement).
  TORCH_ARG(uint64_t, seed) = 0;
};

class SparseLinearImpl : public torch::nn::Cloneable<SparseLinearImpl> {
 public:
  SparseLinearImpl(int64_t in_features, int64_t out_features)
      : SparseLinearImpl(SparseLinearOptions(in_features, out_features)) {}
  explicit SparseLinearImpl(const SparseLinearOptions& options);

  /// Draws the pattern and initialises values and bias uniformly in +-1/sqrt(density*in_features).
  void reset() override;
  /// x: [..., in_features] -> [..., out_features].
  torch::Tensor forward(const torch::Tensor& x);
  /// The weight as a dense out_features x in_features tensor (for inspection and tests).
  torch::Tensor to_dense() const;
  int64_t nnz() const { return values.size(0); }
  /// Loads a checkpoint (torch::load): values, bias and the pattern's slots are all checked (shapes,
  /// slots in range and unique; slots in any order, the values follow them) before any is copied, so
  /// an invalid checkpoint raises and leaves the layer as it was.
  void load(torch::serialize::InputArchive& archive) override;

  SparseLinearOptions options;
  Pattern pattern{nullptr};  ///< the stored positions and their views
  torch::Tensor values;      ///< [nnz] parameter, in the pattern's slot order
  torch::Tensor bias;        ///< [out_features] parameter, undefined without bias
};

TORCH_MODULE(SparseLinear);

/// Keeps every Pattern of `model` for inference (PatternImpl::for_inference), a pattern shared by
/// several layers once. `tile_view`: keep the tile view; unset, it is kept for the patterns of
/// SparseLinear layers whose values are 16-bit (their tensor-core forward reads it at 16-128 rows).
/// Run the model under torch::NoGradGuard: a forward that needs gradients raises.
void for_inference(torch::nn::Module& model, std::optional<bool> tile_view = std::nullopt);
/// Holds every array the training products read in every Pattern of `model` (PatternImpl::for_training):
/// rebuilds what for_inference dropped; `tile_view` false leaves the tile view out.
void for_training(torch::nn::Module& model, bool tile_view = true);

}  // namespace snack
