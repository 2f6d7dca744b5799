// snack::Pattern for libtorch programs: which positions of an out_features x in_features weight a
// sparse layer stores, and the views its operators read. The C++ twin of Python's snack.Pattern.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace snack {

class PatternImpl : public torch::nn::Cloneable<PatternImpl> {
 public:
  /// The pattern of `nnz` positions drawn uniformly without replacement from `generator`, on `device`.
  static std::shared_ptr<PatternImpl> random(int64_t out_features, int64_t in_features, int64_t nnz,
                                             const at::Generator& generator, torch::Device device = torch::kCPU);
  /// The positions (rows[i], cols[i]), any order, validated (in range, no repeats); `order` receives
  /// for each slot the index i it came from (to sort values alike).
  static std::shared_ptr<PatternImpl> from_coo(const torch::Tensor& rows, const torch::Tensor& cols,
                                               int64_t out_features, int64_t in_features, torch::Tensor* order);

  /// Slots sorted row-major, checked (in range, sorted, no repeats: ValueError / IndexError
  /// otherwise) unless `validate` is false, for slots made by snack's own operators.
  PatternImpl(int64_t out_features, int64_t in_features, torch::Tensor row_idx, torch::Tensor col_idx,
              bool validate = true);

  /// Builds the derived views from the slots (and drops again what a pattern kept for inference does
  /// not hold).
  void reset() override;
  /// The pattern's tensors in the order snack's operators take them.
  std::vector<torch::Tensor> tensors() const;
  /// Moves the connections: new slots of the same count (sorted row-major; checked unless
  /// `validate` is false), copied in place, and the views rebuilt in place, so that a captured CUDA
  /// graph keeps reading valid memory.
  void set_slots(const torch::Tensor& row_idx, const torch::Tensor& col_idx, bool validate = true);
  /// Loads the slots of a checkpoint (torch::load), checked first; the views are derived again, never
  /// read from the archive. On an error nothing changes.
  void load(torch::serialize::InputArchive& archive) override;
  /// Writes the buffers; a pattern kept for inference writes the rows it derives from row_ptr as
  /// row_idx, so its checkpoint is the whole pattern's.
  void save(torch::serialize::OutputArchive& archive) const override;

  /// Keeps only what the forward products read, in place (Python's Pattern.for_inference): row_idx
  /// and csc_perm become empty, and the tile view too unless `tile_view`. The forward runs as before
  /// where no gradient is needed (under torch::NoGradGuard); what needs the dropped arrays (dX, dW,
  /// sparse attention's backward) raises until for_training(). Topology updates keep the form.
  void for_inference(bool tile_view = false);
  /// Holds every array the training products read: rebuilds what for_inference dropped (the slots
  /// stay). `tile_view` false leaves the tile view out, for a layer that never computes in 16 bits
  /// (4 bytes less per slot, one build less in every topology update).
  void for_training(bool tile_view = true);
  /// True while the pattern is kept for inference.
  bool forward_only() const { return forward_only_; }
  /// The row of every slot: row_idx, or derived from row_ptr while the pattern is kept for inference.
  torch::Tensor slot_rows() const;
  int64_t nnz() const { return col_idx.size(0); }
  /// Bytes of the slots and every view.
  int64_t nbytes() const;
  /// The stored positions as a dense boolean out_features x in_features mask (for inspection).
  torch::Tensor to_mask() const;

  int64_t out_features, in_features;
  torch::Tensor row_idx;   ///< [nnz] uint16 or int32: the slots' rows, sorted row-major
  torch::Tensor col_idx;   ///< [nnz] the slots' columns
  torch::Tensor row_ptr;   ///< [out_features + 1] int32: CSR offsets
  torch::Tensor col_ptr;   ///< [in_features + 1] int32: CSC offsets
  torch::Tensor csc_perm;  ///< [nnz] int32: the slot of each entry in column-major order
  torch::Tensor tile_ptr;      ///< int32: the tile view's tile offsets (snack/pattern.h; empty where absent)
  torch::Tensor tile_entries;  ///< int32: the tile view's packed entries (empty where absent)

 private:
  // Holds the arrays of that form, each buffer emptied or refilled in place (it stays registered).
  void hold(bool forward_only, bool tile_view);
  // The arrays held: all but row_idx and csc_perm where forward_only_, the tile view where tile_view_.
  bool forward_only_ = false, tile_view_ = true;
};

TORCH_MODULE(Pattern);

}  // namespace snack
