// The sparse weight of a layer: `nnz` fixed slots, sorted row-major, and its derived views.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "snack/status.h"

// cudaStream_t is `CUstream_st*`; naming it this way keeps CUDA headers out of CPU-only code.
struct CUstream_st;

namespace snack {

using Stream = CUstream_st*;

/// Largest dimension that 16-bit slot indices can address (indices are unsigned, 0..65535).
inline constexpr int64_t kMaxDim16 = 65536;
/// Slot offsets (row_ptr, col_ptr, csc_perm) are 32-bit: nnz must stay below 2^31, less a margin
/// because the CUDA kernels' unrolled, strided loops form slot offsets up to a few hundred past the
/// last slot (then test them against the end), which must not wrap around in 32-bit arithmetic.
inline constexpr int64_t kMaxNnz = int64_t(std::numeric_limits<int32_t>::max()) - 4096;

/// The error every check returns for a slot count above kMaxNnz.
inline Status nnz_limit_error(int64_t nnz) {
  return Status(StatusCode::kUnsupported,
                "nnz=" + std::to_string(nnz) + " exceeds the limit of " + std::to_string(kMaxNnz) + " (2^31 - 4097)");
}

/// Bits of the slot indices a `rows x cols` pattern gets by default: 16 (unsigned) where both
/// dimensions fit, else 32. The one statement of that rule: the torch binding and the Python package
/// ask it through the op `snack::index_bits`.
inline int default_index_bits(int64_t rows, int64_t cols) { return rows <= kMaxDim16 && cols <= kMaxDim16 ? 16 : 32; }

/// Slots a `rows x cols` layer keeps at `density` (in [0, 1]): the nearest whole number, halves
/// rounded up. Every constructor (Python, libtorch, sparsify) counts through this function.
inline int64_t nnz_for_density(int64_t rows, int64_t cols, double density) {
  return int64_t(std::llround(density * double(rows) * double(cols)));
}

/// Index type of the slots: 16-bit unsigned where both dimensions fit, 32-bit otherwise.
template <typename Index>
inline constexpr bool kIsSlotIndex = std::is_same_v<Index, uint16_t> || std::is_same_v<Index, int32_t>;

/// Largest dimension an Index type can address.
template <typename Index>
constexpr int64_t max_dim_for_index() {
  static_assert(kIsSlotIndex<Index>, "slot indices are uint16_t or int32_t");
  return std::is_same_v<Index, uint16_t> ? kMaxDim16 : int64_t{std::numeric_limits<int32_t>::max()};
}

/// The tile view (for the 16-bit tensor-core kernels: SpmmVariant::kTileView for the forward and dX,
/// SddmmVariant::kTileView for dW): W cut into tiles of
/// kTileViewRows rows x kTileViewCols columns. Band b (rows [64 b, 64 b + 64)) holds slots
/// [row_ptr[64 b], row_ptr[64 b + 64]); its tiles list them again, tile by tile in column order and
/// row-major inside a tile: tile (b, c) is entries [tile_ptr[b * chunks + c], tile_ptr[b * chunks + c + 1])
/// with chunks = ceil(cols / kTileViewCols), and each entry is
///   (slot - row_ptr[64 b]) << kTileViewSlotShift | (row - 64 b) * kTileViewCols + (col - 64 c),
/// so a tile's slots are read contiguously and their values gathered from the slots' own values.
/// Built for cols <= kTileViewMaxCols (a band then holds at most 2^20 slots); otherwise absent.
inline constexpr int64_t kTileViewRows = 64;
inline constexpr int64_t kTileViewCols = 64;
inline constexpr int kTileViewSlotShift = 12;
inline constexpr int64_t kTileViewMaxCols = int64_t(1) << (32 - kTileViewSlotShift) >> 6;
static_assert(kTileViewRows * kTileViewCols == int64_t(1) << kTileViewSlotShift, "a position addresses a whole tile");

/// Packed tile values: the tile view's entries with the 16-bit values of their slots in place of the
/// slot offsets, entry e of tile_entries becoming
///   (bits of the value of e's slot) << kTilePackedValueShift | e's position in the tile,
/// so that a kernel reads a tile's values with its entries instead of gathering them from the slots
/// (pack_tile_values in snack/topology.h builds them; kTileView's forward reads them where given).
/// They hold a copy of the values: packed again whenever the values or the pattern change.
inline constexpr int kTilePackedValueShift = 16;
static_assert(kTileViewSlotShift <= kTilePackedValueShift, "a packed value leaves the position's bits alone");

/// The bits of a tile-view entry (plain or packed) that hold its position in the tile.
inline constexpr uint32_t kTileViewPositionMask = (uint32_t(1) << kTileViewSlotShift) - 1;

/// The packed word of tile-view entry `entry` whose slot holds the 16-bit value `value_bits`.
constexpr uint32_t packed_tile_entry(uint32_t entry, uint16_t value_bits) {
  return uint32_t(value_bits) << kTilePackedValueShift | (entry & kTileViewPositionMask);
}

/// The tile view's bands (of kTileViewRows rows) and chunks (tiles per band, of kTileViewCols columns).
inline int64_t tile_view_bands(int64_t rows) { return (rows + kTileViewRows - 1) / kTileViewRows; }
inline int64_t tile_view_chunks(int64_t cols) { return (cols + kTileViewCols - 1) / kTileViewCols; }

/// Lengths of the tile view's arrays for a `rows x cols` pattern of nnz slots: tile_ptr
/// (bands * chunks + 1) and tile_entries (nnz rounded up to a multiple of 4, so that a tile can be
/// read as 16-byte vectors); both 0 where the view is not built (cols > kTileViewMaxCols or an empty matrix).
inline int64_t tile_view_ptr_length(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0 || cols > kTileViewMaxCols) return 0;
  return tile_view_bands(rows) * tile_view_chunks(cols) + 1;
}
inline int64_t tile_view_entries_length(int64_t rows, int64_t cols, int64_t nnz) {
  return tile_view_ptr_length(rows, cols) == 0 ? 0 : (nnz + 3) / 4 * 4;
}

/// Tile fragments: the 16-bit values of the tile view's tiles laid out as the A operands of
/// mma.sync m16n8k16, so that a kernel loads each register of a fragment whole instead of expanding
/// the tile in shared memory (pack_tile_fragments in snack/topology.h builds them; kTileView's
/// forward reads them where given). A 64 x 64 tile is four groups, one per 16 columns (the k-step a
/// warp multiplies); in group g = col / 16, lane (row % 8) * 4 + (col % 8) / 2 holds 16 registers of
/// two values, register (row / 16) * 4 + (row % 16) / 8 + 2 * ((col % 16) / 8), the even column in
/// its low half. Only the registers that hold a slot are stored. The words (int32) of the layout:
///   [0, 2 * tiles)                   per tile: its first value word (counted from the values part) and
///                                    its value words (a multiple of 4; 0 for a tile without slots)
///   [headers, headers + 128 * tiles) per tile, per (group, lane): the 16-bit mask of the registers
///                                    stored | their first word's offset from the tile's first << 16
///   [values, ...)                    each tile's stored registers, (group, lane, register) ascending,
///                                    zero-padded up to the next tile's first word, which follows from
///                                    the tile view alone (tile_fragment_start: no tile waits for the
///                                    ones before it to be packed), as does the length.
/// They hold a copy of the values: packed again whenever the values or the pattern change.
/// Transposed tile fragments are W^T's, for dX = dY W as a forward of the K x M weight W^T: tile
/// (c, b) of W^T is tile (b, c) of W with its rows and columns swapped, laid out as above, with the
/// pairs and headers in W^T's tile order (tile c * bands + b) and the value words where W's tile
/// (b, c) would have them, so the length is W's (tile_fragment_layout(rows, cols, nnz)).
inline constexpr int kFragmentGroups = 4;        // k-steps of 16 columns per tile
inline constexpr int kFragmentLanes = 32;
inline constexpr int kFragmentRegisters = 16;    // registers of two values per lane and group
inline constexpr int64_t kFragmentHeaderWords = kFragmentGroups * kFragmentLanes;
static_assert(kFragmentGroups * 16 == kTileViewCols && kFragmentRegisters / 4 * 16 == kTileViewRows,
              "four k-steps of four row blocks of 16 make a tile");

/// Where position (row, col) of a tile lies in its fragments: group, lane, register, and which half.
struct FragmentPlace {
  int group, lane, reg, half;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr FragmentPlace fragment_place(int row, int col) {
  return FragmentPlace{col / 16, (row % 8) * 4 + (col % 8) / 2, (row / 16) * 4 + (row % 16) / 8 + 2 * ((col % 16) / 8),
                       col % 2};
}
/// Where a tile view entry's position lies in its tile's fragments, W's or (transposed) W^T's.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr FragmentPlace entry_fragment_place(uint32_t entry, bool transposed) {
  const uint32_t pos = entry & kTileViewPositionMask;
  const int row = int(pos / kTileViewCols), col = int(pos % kTileViewCols);
  return transposed ? fragment_place(col, row) : fragment_place(row, col);
}
/// The (group, lane) that owns a place: the index of its header word within the tile.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int fragment_owner(FragmentPlace f) { return f.group * kFragmentLanes + f.lane; }

/// Words of the tile fragments' parts for a `rows x cols` pattern of nnz slots (see above): the
/// per-tile pairs (rounded up to 4 words), the headers, the values; all 0 where the tile view is absent.
struct FragmentLayout {
  int64_t tiles = 0, headers = 0, values = 0, words = 0;
};
inline FragmentLayout tile_fragment_layout(int64_t rows, int64_t cols, int64_t nnz) {
  FragmentLayout l;
  if (tile_view_ptr_length(rows, cols) == 0) return l;
  l.tiles = tile_view_bands(rows) * tile_view_chunks(cols);
  l.headers = (2 * l.tiles + 3) / 4 * 4;
  l.values = l.headers + kFragmentHeaderWords * l.tiles;
  l.words = l.values + (nnz + 3) / 4 * 4 + 8 * l.tiles + 8 * tile_view_bands(rows);  // tile_fragment_start
  return l;
}
/// The first value word (from FragmentLayout::values) of tile `chunk` of band `band`, whose first
/// slot is `first_slot` and whose tile starts at entry `first_entry` of the tile view (tile_ptr):
/// the band's start, 16-byte aligned, the tile's entries before it rounded down to a multiple of 4,
/// and 8 words a tile. A tile stores at most a register per entry, padded by at most 3, so it ends
/// before the next one starts (chunk + 1, whose entries are its own further on; the next band's
/// first, at least 8 words a tile past this band's start and its slots); chunk = chunks gives the
/// band's end.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int64_t tile_fragment_start(int64_t band, int64_t chunk, int64_t chunks, int64_t first_slot,
                                      int64_t first_entry) {
  return (first_slot + 3) / 4 * 4 + 8 * (chunks + 1) * band + (first_entry - first_slot) / 4 * 4 + 8 * chunk;
}

/// Bitmap fragments: the tile fragments' places with the values stored one by one instead of a
/// register per pair, for denser weights, where half-filled registers cost the most: at 50% density
/// ~1.1 bytes a weight position against ~1.6 for the tile fragments and 2 for dense. The unit is the
/// 8 x 8 block of an A operand: register `reg` of group `group` over its 32 lanes (two values each),
/// block group * 16 + reg; its 64-bit mask holds the block's stored positions, bit 2 * lane + half
/// (bitmap_place), and its values follow one another in that order, so that the 32 lanes loading a
/// register read one run of at most 128 bytes of shared memory (no bank conflict). The words (int32):
///   [0, 2 * tiles)                   per tile: its first value word (counted from the values part) and
///                                    its value words (a multiple of 4; 0 for a tile without slots)
///   [headers, headers + 144 * tiles) per tile: the 64 blocks' masks, low word first (128 words), then
///                                    per 16 x 16 operand (group * 4 + row block: four blocks each) the
///                                    index of its first value among the tile's values (16 words)
///   [values, ...)                    each tile's stored values as 16-bit halves, blocks ascending and
///                                    each block's in bit order (the first in a word's low half),
///                                    zero-padded up to the next tile's first word (tile_bitmap_start:
///                                    from the tile view alone).
/// Transposed bitmap fragments are W^T's, as transposed tile fragments are.
inline constexpr int kBitmapBlocks = kFragmentGroups * kFragmentRegisters;  // 8 x 8 blocks a tile
inline constexpr int kBitmapOperands = kFragmentGroups * kFragmentRegisters / 4;  // 16 x 16 operands a tile
inline constexpr int64_t kBitmapHeaderWords = 2 * kBitmapBlocks + kBitmapOperands;

/// Where a place lies in bitmap fragments: its 8 x 8 block and its bit in the block's mask.
struct BitmapPlace {
  int block, bit;
};
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr BitmapPlace bitmap_place(FragmentPlace f) {
  return BitmapPlace{f.group * kFragmentRegisters + f.reg, 2 * f.lane + f.half};
}

inline FragmentLayout tile_bitmap_layout(int64_t rows, int64_t cols, int64_t nnz) {
  FragmentLayout l;
  if (tile_view_ptr_length(rows, cols) == 0) return l;
  l.tiles = tile_view_bands(rows) * tile_view_chunks(cols);
  l.headers = (2 * l.tiles + 3) / 4 * 4;
  l.values = l.headers + kBitmapHeaderWords * l.tiles;
  l.words = l.values + (nnz + 7) / 8 * 4 + 8 * l.tiles + 8 * tile_view_bands(rows);  // tile_bitmap_start
  return l;
}
/// The first value word (from FragmentLayout::values) of tile `chunk` of band `band` in bitmap
/// fragments, as tile_fragment_start gives it for the tile fragments: a tile of e entries stores e
/// halves, at most e / 2 + 3.5 words with its padding, and the next tile starts at least e / 2 + 4.5
/// words further on.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int64_t tile_bitmap_start(int64_t band, int64_t chunk, int64_t chunks, int64_t first_slot,
                                    int64_t first_entry) {
  return (first_slot + 7) / 8 * 4 + 8 * (chunks + 1) * band + (first_entry - first_slot) / 8 * 4 + 8 * chunk;
}

/// Where W's tile `chunk` of band `band` (of `bands`) keeps its pair and header in W^T's tile
/// fragments: its index in W^T's tile order (W^T's band `chunk`, chunk `band`).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int64_t transposed_fragment_tile(int64_t band, int64_t chunk, int64_t bands) {
  return chunk * bands + band;
}

/// Read-only view of a slot pattern: which positions of a `rows x cols` matrix are stored.
///
/// The slots are kept sorted row-major (by row, then column), so slot s of row r lies in
/// [row_ptr[r], row_ptr[r+1]) and the values of a row are contiguous. The CSC view is a permutation
/// into the same slots: the j-th stored entry in column-major order is slot csc_perm[j], and column c
/// owns j in [col_ptr[c], col_ptr[c+1]); within a column the slots ascend (rows ascend).
/// All pointers address memory of one device (host memory for the CPU functions).
///
/// A pattern kept for inference only (forward_only) has neither row_idx nor csc_perm (both null,
/// nnz > 0): the forward products read col_idx, row_ptr and the tile view, and nothing else; the
/// transposed product, the SDDMM and the fused attention's backward need both arrays.
template <typename Index>
struct SlotPattern {
  static_assert(kIsSlotIndex<Index>, "slot indices are uint16_t or int32_t");
  int64_t rows = 0;                  ///< M, the output features
  int64_t cols = 0;                  ///< K, the input features
  int64_t nnz = 0;                   ///< number of slots
  const Index* row_idx = nullptr;    ///< [nnz] row of each slot
  const Index* col_idx = nullptr;    ///< [nnz] column of each slot
  const int32_t* row_ptr = nullptr;  ///< [rows + 1] CSR offsets into the slots
  const int32_t* col_ptr = nullptr;  ///< [cols + 1] CSC offsets into csc_perm
  const int32_t* csc_perm = nullptr; ///< [nnz] slot of each entry in column-major order
  /// The tile view (see kTileViewRows), or null where absent: [tile_view_ptr_length] and
  /// [tile_view_entries_length] (the entries are unsigned 32-bit words).
  const int32_t* tile_ptr = nullptr;
  const uint32_t* tile_entries = nullptr;

  /// True when the slots' rows and the CSC permutation were left out (see above).
  bool forward_only() const { return nnz > 0 && row_idx == nullptr && csc_perm == nullptr; }
};

/// What an operation reads of a pattern: only the forward's arrays (col_idx, row_ptr, col_ptr, the
/// tile view), or every array (row_idx and csc_perm too).
enum class PatternNeeds { kForward, kAll };

/// Checks the sizes and pointers of a pattern (not its contents): non-negative sizes, dimensions
/// the Index type can address, nnz <= rows*cols and < 2^31, non-null arrays where nnz > 0 (row_idx
/// and csc_perm may both be null, a forward-only pattern, where `needs` is PatternNeeds::kForward).
template <typename Index>
Status check_pattern_shape(const SlotPattern<Index>& w, PatternNeeds needs = PatternNeeds::kAll) {
  if (w.rows < 0 || w.cols < 0 || w.nnz < 0)
    return InvalidArgument("pattern sizes must be non-negative (rows=" + std::to_string(w.rows) +
                           ", cols=" + std::to_string(w.cols) + ", nnz=" + std::to_string(w.nnz) + ")");
  if (w.rows > max_dim_for_index<Index>() || w.cols > max_dim_for_index<Index>())
    return InvalidArgument("pattern dimensions " + std::to_string(w.rows) + "x" + std::to_string(w.cols) +
                           " do not fit the slot index type");
  if (w.nnz > kMaxNnz) return nnz_limit_error(w.nnz);
  if (w.rows > 0 && w.cols > 0 && w.nnz > w.rows * w.cols)
    return InvalidArgument("nnz=" + std::to_string(w.nnz) + " exceeds rows*cols=" +
                           std::to_string(w.rows * w.cols));
  if (w.rows == 0 || w.cols == 0) {
    if (w.nnz != 0) return InvalidArgument("an empty matrix must have nnz=0");
  }
  if (w.forward_only() && w.col_idx != nullptr) {
    if (needs == PatternNeeds::kAll)
      return InvalidArgument(
          "the pattern holds only the forward's arrays (it was kept for inference, without row_idx and csc_perm); "
          "this product needs them too");
  } else if (w.nnz > 0 && (w.row_idx == nullptr || w.col_idx == nullptr || w.csc_perm == nullptr)) {
    return InvalidArgument("pattern arrays row_idx/col_idx/csc_perm must not be null when nnz > 0");
  }
  if (w.row_ptr == nullptr || w.col_ptr == nullptr)
    return InvalidArgument("pattern arrays row_ptr/col_ptr must not be null");
  return Status::Ok();
}

}  // namespace snack
