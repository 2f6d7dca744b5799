// How the CUDA forward SpMM (and the transposed SpMM, which reuses it) is run: which kernel
// variant, with which batch tile and lane layout. Chosen by plan_spmm() from the shape; every
// variant can also be forced, for benchmarks and tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace snack {

enum class SpmmVariant : int {
  kAuto = 0,   ///< let plan_spmm() choose
  kWarpRow,    ///< reference: a warp per row, X read row-major from global memory
  kSmemX,      ///< X (a batch tile, all K columns) staged in shared memory; lanes split nnz and batch.
               ///< Never chosen by kAuto (slower than kGlobalX / kGlobalXT where measured)
  kGlobalXT,   ///< X transposed once into a [K, Npad] workspace, read through L1; lanes along the batch
  kCooAtomic,  ///< SNACK-style COO: grid.y maps batch rows, slots split evenly, atomicAdd per row segment.
               ///< Not deterministic (float atomics): never chosen by kAuto, only when forced.
  kGlobalX,    ///< X read in place (row-major), one scalar per batch row through L1: no transpose launch.
               ///< Batch tiles up to 32; chosen for one row and for small products.
  kWideRows,   ///< a warp per group of consecutive rows reads their slots with 16-byte loads, a batch tile
               ///< of X (1, 2, 4 or 8 rows) in shared memory. Forward only; a larger batch reads W once
               ///< per tile: chosen for a batch of 1-4 rows (fp32) or 1-8 (16-bit values) of a large layer.
};

/// Name used by the Python API and the benchmarks ("auto", "warp_row", "smem_x", "global_xt", "global_x",
/// "wide_rows", "coo_atomic").
const char* spmm_variant_name(SpmmVariant v);
/// Parses a name; returns false for an unknown name.
bool parse_spmm_variant(const std::string& name, SpmmVariant* out);
/// Whether a variant computes only the forward product (kCooAtomic, kWideRows), not dX = dY W.
inline bool spmm_variant_is_forward_only(SpmmVariant v) {
  return v == SpmmVariant::kCooAtomic || v == SpmmVariant::kWideRows;
}

/// Which CUDA kernel computes the SDDMM (the weight gradient at the slots); every one can be forced,
/// for benchmarks and tests.
enum class SddmmVariant : int {
  kAuto = 0,  ///< let sddmm() choose
  kSlot,      ///< one thread per slot, dY and X read in place (chosen below a batch of 4)
  kVector,    ///< dY and X transposed once; G lanes per slot read 16-byte vectors of both through L1
  kRows,      ///< a warp per row of W keeps dY's row in registers, gathers X^T through L1, and sums a
              ///< chunk of slots over the batch lanes with a reduce-scatter (batch <= 128)
};

/// Names used by the Python API ("auto", "slot", "vector", "rows").
const char* sddmm_variant_name(SddmmVariant v);
/// Parses a name; returns false for an unknown name.
bool parse_sddmm_variant(const std::string& name, SddmmVariant* out);

struct SpmmPlan {
  SpmmVariant variant = SpmmVariant::kWarpRow;
  int batch_tile = 1;          ///< Npad: batch rows per pass (power of two, 1..128; kWideRows: 1..8)
  int lanes_per_row = 32;      ///< lanes of a warp that split one row's slots
  int rows_per_warp = 1;       ///< kWideRows: consecutive rows a warp sums at once (1..16)
  int32_t long_row_threshold = 1 << 30;  ///< rows with more entries are split over a whole block
  size_t smem_bytes = 0;       ///< dynamic shared memory per block
  size_t workspace_bytes = 0;  ///< device workspace the caller must provide (kGlobalXT with a tile > 1)
  bool prefetch_l2 = false;    ///< small product: each block first asks L2 for its share of W's slot arrays
                               ///< (and of X, for kGlobalX)
  std::string reason;          ///< why this plan, for snack.explain()
};

}  // namespace snack
