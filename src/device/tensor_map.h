// Tensor maps of the copy engine (cp.async.bulk.tensor) for the kernels that load boxes of a
// row-major 16-bit matrix: made on the host for each launch, passed as a __grid_constant__ argument.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "snack/status.h"

namespace snack::cuda::detail {

/// The map of a row-major [rows][cols] matrix of 16-bit values at `base` whose boxes are `box_cols`
/// x `box_rows` values (box_cols * 2 at most 128 bytes), laid out in shared memory in the 128-byte
/// swizzle (16-byte unit u of box row r at unit u ^ (r % 8); snack::cuda::detail::wg_swizzled), the
/// parts outside the matrix read as zeros. Needs `base` 16-byte aligned and cols a multiple of 8
/// (rows of whole 16-byte units); refuses otherwise.
Status tensor_map_16bit(const void* base, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                        CUtensorMap* map);

}  // namespace snack::cuda::detail
