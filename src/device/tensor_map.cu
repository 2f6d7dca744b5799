#include "tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>

namespace snack::cuda::detail {
namespace {

// cuTensorMapEncodeTiled from the driver, looked up once (the runtime links no driver symbols).
Status tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000* encode) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t looked_up = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    looked_up = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
    if (looked_up == cudaSuccess && found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (fn == nullptr)
    return Status(StatusCode::kCudaError, "the driver has no cuTensorMapEncodeTiled (" +
                                              std::string(cudaGetErrorString(looked_up)) + ")");
  *encode = fn;
  return Status::Ok();
}

}  // namespace

Status tensor_map_16bit(const void* base, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                        CUtensorMap* map) {
  if (!tensor_map_16bit_fits(base, cols) || rows < 1 || box_cols * 2 > 128)
    return InvalidArgument("a tensor map needs 16-byte aligned rows of 16-bit values (" + std::to_string(rows) +
                           " x " + std::to_string(cols) + ", boxes of " + std::to_string(box_cols) + ")");
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  SNACK_RETURN_IF_ERROR(tensor_map_encoder(&encode));
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return Status(StatusCode::kCudaError, "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ")");
  return Status::Ok();
}

}  // namespace snack::cuda::detail
