// Tensor maps of the copy engine (cp.async.bulk.tensor) for the kernels that load boxes of a
// row-major 16-bit matrix: made on the host for each launch, passed as a __grid_constant__ argument.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda_utils.cuh"
#include "snack/status.h"

namespace snack::cuda::detail {

/// Whether a row-major matrix of 16-bit values at `base` with `cols` columns can have a tensor map:
/// rows of whole 16-byte units from a 16-byte aligned start (rows_of_16byte_vectors), and a row at all.
inline bool tensor_map_16bit_fits(const void* base, int64_t cols) {
  return cols > 0 && rows_of_16byte_vectors(base, cols);
}

/// The map of a row-major [rows][cols] matrix of 16-bit values at `base` whose boxes are `box_cols`
/// x `box_rows` values (box_cols * 2 at most 128 bytes), laid out in shared memory in the 128-byte
/// swizzle (16-byte unit u of box row r at unit u ^ (r % 8); snack::cuda::detail::wg_swizzled), the
/// parts outside the matrix read as zeros. Refuses a matrix that does not fit (tensor_map_16bit_fits).
Status tensor_map_16bit(const void* base, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                        CUtensorMap* map);

}  // namespace snack::cuda::detail
