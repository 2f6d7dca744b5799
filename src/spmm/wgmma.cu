// The wgmma SpMM's launcher: the tensor map of the input for the copy engine, the cluster launch.
// Built for sm_90a only (CMakeLists.txt); without that target the kernel traps and wgmma_built()
// says false, so the planner never takes it.
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "../device/cuda_utils.cuh"
#include "../device/tensor_map.h"
#include "snack/device_limits.h"
#include "wgmma.h"
#include "wgmma_kernel.cuh"

namespace snack::cuda::detail {

bool wgmma_built() {
#if defined(SNACK_WGMMA_BUILT)
  return true;
#else
  return false;
#endif
}

Status check_wgmma_device() {
  if (!wgmma_built())
    return Status(StatusCode::kUnsupported, "wgmma: this build has no sm_90a code (build for CUDA architecture 90)");
  DeviceLimits limits;  // queried once per device
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  if (limits.compute_capability != 90)
    return Status(StatusCode::kUnsupported, wgmma_needs_hopper(limits.compute_capability));
  return Status::Ok();
}

size_t wgmma_workspace_bytes(int64_t out_dim, int64_t in_dim, int64_t nnz) {
  return wgmma_lists(out_dim, in_dim, nnz).bytes;
}

template <typename T, typename View>
Status launch_spmm_wgmma(const View& view, int64_t nnz, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                         const T* bias, T* out, Activation act, int splits, void* workspace, Stream stream) {
  if (n == 0 || out_dim == 0) return Status::Ok();
  SNACK_RETURN_IF_ERROR(check_wgmma_device());
  if (in_dim % 8 != 0 || reinterpret_cast<uintptr_t>(in) % 16 != 0)
    return InvalidArgument("wgmma: the input's rows must be 16-byte aligned (in_dim a multiple of 8)");
  if (in_dim > 65535) return InvalidArgument("wgmma: more than 65535 inputs (the chunk tables hold 16-bit offsets)");
  if (splits < 1 || splits > kWgMaxSplits)
    return InvalidArgument("wgmma: splits must be 1 to " + std::to_string(kWgMaxSplits));
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return InvalidArgument("wgmma: the workspace is missing or not 16-byte aligned");
  const int64_t bands = ceil_div(out_dim, kWgBandRows), tiles = ceil_div(n, kWgBatchTile);
  if (bands * splits > INT32_MAX || tiles > 65535) return InvalidArgument("wgmma: the grid is too large for this product");
  const int chunks = int(ceil_div(in_dim, kWgChunk));

  // The tile lists.
  const WgmmaLists layout = wgmma_lists(out_dim, in_dim, nnz);
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  uint32_t* lists = reinterpret_cast<uint32_t*>(ws);
  int32_t* tile_off = reinterpret_cast<int32_t*>(ws + layout.tile_off);
  uint16_t* starts = reinterpret_cast<uint16_t*>(ws + layout.starts);
  uint16_t* row_before = reinterpret_cast<uint16_t*>(ws + layout.row_before);
  constexpr int kRowThreads = 256;  // a warp per row
  const unsigned row_blocks = unsigned(ceil_div(out_dim * 32, kRowThreads));
  wg_chunk_starts_kernel<<<row_blocks, kRowThreads, 0, stream>>>(view, out_dim, chunks, starts);
  SNACK_RETURN_IF_ERROR(check_launch("wg_chunk_starts_kernel"));
  wg_tile_offsets_kernel<<<unsigned(bands), 1024, 0, stream>>>(view, out_dim, chunks, starts, row_before, tile_off);
  SNACK_RETURN_IF_ERROR(check_launch("wg_tile_offsets_kernel"));
  wg_pack_kernel<<<row_blocks, kRowThreads, 0, stream>>>(view, out_dim, chunks, starts, row_before, tile_off, lists);
  SNACK_RETURN_IF_ERROR(check_launch("wg_pack_kernel"));

  // The input in boxes of kWgChunk inputs x kWgBatchTile rows, swizzled in 128-byte rows, zeros outside.
  CUtensorMap map;
  SNACK_RETURN_IF_ERROR(tensor_map_16bit(in, n, in_dim, kWgChunk, kWgBatchTile, &map));
  auto kernel = spmm_wgmma_kernel<T>;
  const size_t smem = wgmma_smem_bytes();
  SNACK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  SNACK_CUDA_RETURN_IF_ERROR(launch_clusters_x(kernel, dim3(unsigned(bands * splits), unsigned(tiles)),
                                               dim3(kWgThreads), smem, stream, unsigned(splits), map,
                                               static_cast<const uint32_t*>(lists),
                                               static_cast<const int32_t*>(tile_off), out_dim, in_dim, n, bias, out,
                                               act, splits));
  return check_launch("spmm_wgmma_kernel");
}

#define SNACK_INSTANTIATE_WGMMA(T, Index)                                                                          \
  template Status launch_spmm_wgmma<T, CsrView<T, Index>>(const CsrView<T, Index>&, int64_t, int64_t, int64_t,  \
                                                          const T*, int64_t, const T*, T*, Activation, int,      \
                                                          void*, Stream);                                        \
  template Status launch_spmm_wgmma<T, CscView<T, Index>>(const CscView<T, Index>&, int64_t, int64_t, int64_t,  \
                                                          const T*, int64_t, const T*, T*, Activation, int,      \
                                                          void*, Stream);
SNACK_INSTANTIATE_WGMMA(bfloat16, uint16_t)
SNACK_INSTANTIATE_WGMMA(bfloat16, int32_t)
SNACK_INSTANTIATE_WGMMA(float16, uint16_t)
SNACK_INSTANTIATE_WGMMA(float16, int32_t)

}  // namespace snack::cuda::detail
