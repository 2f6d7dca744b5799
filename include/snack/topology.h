// Building and checking slot patterns: from COO positions, from a dense matrix (top-k by magnitude),
// and the derived CSR/CSC views. CPU and CUDA versions with the same contracts.
//
// Positions are linear indices `row * cols + col` (int64). A pattern's slots are sorted row-major,
// which for positions means ascending.
#pragma once

#include <cstddef>
#include <cstdint>

#include "snack/pattern.h"
#include "snack/status.h"

namespace snack {

/// Scratch memory for the CUDA topology functions (sort and scan temporaries). The torch binding
/// supplies PyTorch's caching allocator; `default_device_allocator()` uses cudaMallocAsync.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  /// Returns `bytes` of device memory usable on `stream`, or nullptr when out of memory.
  virtual void* allocate(size_t bytes, Stream stream) = 0;
  /// Returns memory obtained from allocate(); work already enqueued on `stream` may still use it.
  virtual void deallocate(void* ptr, Stream stream) = 0;
};

namespace cpu {

/// Validates COO positions and sorts them into slots.
///   rows, cols: [nnz] int64 positions of a `m x k` matrix, any order.
///   row_idx, col_idx: [nnz] outputs, the positions sorted row-major.
///   order: [nnz] output, order[s] = index into rows/cols of the position now in slot s
///          (apply it to the values: values_sorted[s] = values[order[s]]).
/// Errors: kOutOfRange naming the first bad element, kDuplicateEntry naming the repeated (row, col),
/// kInvalidArgument for nnz > m*k or dimensions the Index type cannot address. Outputs are only
/// written when the call succeeds.
template <typename Index>
Status slots_from_coo(int64_t m, int64_t k, int64_t nnz, const int64_t* rows, const int64_t* cols,
                      Index* row_idx, Index* col_idx, int64_t* order);

/// Checks the slots of a `m x k` pattern: every (row, col) in range and the positions strictly
/// ascending in row-major order (sorted, no repeats). O(nnz).
/// Errors: kOutOfRange or kDuplicateEntry / kInvalidArgument (not sorted), naming the first bad slot.
template <typename Index>
Status check_slots(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx);

/// Checks a whole pattern: its slots (check_slots) and that row_ptr, col_ptr and csc_perm are the
/// views build_views derives from them. A forward-only pattern (SlotPattern::forward_only) has its
/// rows read from row_ptr and its col_ptr checked against the columns' counts. O(m + k + nnz), no
/// allocation but the tile view's copy (and a forward-only pattern's rows). The torch binding runs it on
/// every pattern list a CPU product is given (once per list, src/torch/ops_cpu.cpp), so a
/// hand-assembled or corrupted pattern is an error, never a read out of bounds.
template <typename Index>
Status check_pattern(const SlotPattern<Index>& w);

/// Derives the CSR row pointers and the CSC view of a row-major sorted pattern.
///   row_idx, col_idx: [nnz], checked first (check_slots): an invalid pattern is an error.
///   row_ptr: [m + 1], col_ptr: [k + 1], csc_perm: [nnz] outputs (see SlotPattern), written only
///   when the slots are valid.
template <typename Index>
Status build_views(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                   int32_t* row_ptr, int32_t* col_ptr, int32_t* csc_perm);

/// Derives the tile view (see kTileViewRows in snack/pattern.h) of a row-major sorted pattern:
///   row_idx, col_idx: [nnz], checked first (check_slots); row_ptr: [m + 1], from build_views.
///   tile_ptr: [tile_view_ptr_length(m, k)], tile_entries: [tile_view_entries_length(m, k, nnz)]
///   outputs (the entries past nnz are zeros). Nothing is written where the view is not built
///   (both lengths 0).
template <typename Index>
Status build_tile_view(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                       const int32_t* row_ptr, int32_t* tile_ptr, uint32_t* tile_entries);

/// Packs the 16-bit values of a pattern's slots into its tile view's entries (packed tile values,
/// snack/pattern.h): packed[e] = value_bits[slot of e] << kTilePackedValueShift | position of e, for
/// the entries e < nnz, and 0 for the padding after them.
///   row_ptr: [m + 1]; tile_entries and packed: [tile_view_entries_length(m, k, nnz)];
///   value_bits: [nnz], the bits of bfloat16 or float16 values, in slot order.
/// Reads the view as built (build_tile_view); kInvalidArgument where the pattern has no tile view.
Status pack_tile_values(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const uint32_t* tile_entries,
                        const uint16_t* value_bits, uint32_t* packed);

/// Lays the 16-bit values of a pattern's slots out as tile fragments (snack/pattern.h): the A
/// operands of mma.sync, tile by tile, only the registers that hold a slot.
///   row_ptr: [m + 1]; tile_ptr, tile_entries: the tile view (build_tile_view);
///   value_bits: [nnz], the bits of bfloat16 or float16 values, in slot order;
///   fragments: [tile_fragment_layout(m, k, nnz).words], written whole (zeros where nothing is stored);
///   transposed: W^T's fragments instead (snack/pattern.h, transposed tile fragments), for dX.
/// kInvalidArgument where the pattern has no tile view.
Status pack_tile_fragments(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                           const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* fragments,
                           bool transposed = false);

/// Lays the 16-bit values of a pattern's slots out as bitmap fragments (snack/pattern.h): the tile
/// fragments' places, each (group, lane) a mask of its stored values and the values one by one.
/// Arguments as pack_tile_fragments; bitmaps: [tile_bitmap_layout(m, k, nnz).words], written whole.
Status pack_tile_bitmaps(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                         const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* bitmaps,
                         bool transposed = false);

/// Positions of the `count` entries of largest magnitude in a dense row-major `m x k` matrix,
/// written ascending to positions[count]. Ties go to the smaller position, so the result is
/// deterministic. Non-finite entries are rejected (kInvalidArgument).
template <typename T>
Status dense_topk_positions(int64_t m, int64_t k, const T* dense, int64_t count, int64_t* positions);

}  // namespace cpu

namespace cuda {

/// CUDA versions: same contracts, device pointers, work on `stream`. The validating functions
/// (slots_from_coo, dense_topk_positions) synchronise `stream` once to report errors. build_views
/// never synchronises and so does not check its slots (it stays within its buffers whatever they
/// hold): give it slots that check_slots accepted, as snack.Pattern does.
template <typename Index>
Status slots_from_coo(int64_t m, int64_t k, int64_t nnz, const int64_t* rows, const int64_t* cols,
                      Index* row_idx, Index* col_idx, int64_t* order, DeviceAllocator& alloc,
                      Stream stream);

template <typename Index>
Status build_views(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                   int32_t* row_ptr, int32_t* col_ptr, int32_t* csc_perm, DeviceAllocator& alloc,
                   Stream stream);

/// As cpu::build_tile_view, without checking the slots (as build_views); never synchronises.
template <typename Index>
Status build_tile_view(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                       const int32_t* row_ptr, int32_t* tile_ptr, uint32_t* tile_entries, Stream stream);

/// As cpu::pack_tile_values, on `stream`; never synchronises.
Status pack_tile_values(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const uint32_t* tile_entries,
                        const uint16_t* value_bits, uint32_t* packed, Stream stream);

/// As cpu::pack_tile_fragments, on `stream` (a block per tile); never synchronises.
Status pack_tile_fragments(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                           const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* fragments,
                           Stream stream, bool transposed = false);

/// As cpu::pack_tile_bitmaps, on `stream` (a block per tile); never synchronises.
Status pack_tile_bitmaps(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                         const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* bitmaps, Stream stream,
                         bool transposed = false);

template <typename T>
Status dense_topk_positions(int64_t m, int64_t k, const T* dense, int64_t count, int64_t* positions,
                            DeviceAllocator& alloc, Stream stream);

/// An allocator over cudaMallocAsync/cudaFreeAsync, for users without a framework.
DeviceAllocator& default_device_allocator();

}  // namespace cuda
}  // namespace snack
