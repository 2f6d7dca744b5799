// The radix select's launches that are not templates (state reset, digit pick), and the two
// public selections built on it: lowest_slots (prune_slots on the device) and TopkSelection (RigL's
// growth over blocks of scores).
#include "radix_select.cuh"

namespace snack::cuda {
namespace detail {
namespace {

__global__ void select_init_kernel(SelectState* state, long long k) {
  unsigned long long* hist = &state->hist[0][0];
  for (int i = threadIdx.x; i < TopkSelection::kPasses * kMaxBins; i += blockDim.x) hist[i] = 0;
  if (threadIdx.x == 0) {
    state->prefix = 0;
    state->remaining = k;
    state->carry = make_longlong2(0, 0);
  }
}

// The bucket of this pass that holds the `remaining`-th largest key: walk the bins from the top.
constexpr int kPickThreads = kMaxBins / 2;
__global__ void __launch_bounds__(kPickThreads) select_pick_kernel(int pass, SelectState* __restrict__ state) {
  using Scan = cub::BlockScan<unsigned long long, kPickThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int nbins = 1 << digit_bits(pass);
  const int b0 = nbins - 1 - 2 * int(threadIdx.x), b1 = b0 - 1;
  const unsigned long long h0 = b0 >= 0 ? state->hist[pass][b0] : 0, h1 = b1 >= 0 ? state->hist[pass][b1] : 0;
  unsigned long long above = 0;
  Scan(temp).ExclusiveSum(h0 + h1, above);
  const long long want = state->remaining;
  __syncthreads();  // every thread has read `remaining` before one of them rewrites it
  const auto need = static_cast<unsigned long long>(want);
  int picked = -1;
  unsigned long long before = 0;
  if (b0 >= 0 && above < need && need <= above + h0) {
    picked = b0;
    before = above;
  } else if (b1 >= 0 && above + h0 < need && need <= above + h0 + h1) {
    picked = b1;
    before = above + h0;
  }
  if (picked >= 0) {
    state->prefix |= uint32_t(picked) << digit_shift(pass);
    state->remaining = want - static_cast<long long>(before);
  }
}

}  // namespace

Status select_init(SelectState* state, int64_t k, Stream stream) {
  select_init_kernel<<<1, 1024, 0, stream>>>(state, k);
  return check_launch("select_init_kernel");
}

Status select_pick(int pass, SelectState* state, Stream stream) {
  select_pick_kernel<<<1, kPickThreads, 0, stream>>>(pass, state);
  return check_launch("select_pick_kernel");
}

}  // namespace detail

using namespace detail;

Status lowest_slots(const float* scores, int64_t count, int64_t k, int64_t* slots, DeviceAllocator& alloc,
                    Stream stream) {
  if (k < 0 || k > count) return InvalidArgument("lowest_slots: k must lie in [0, count]");
  if (k == 0) return Status::Ok();
  if (!scores || !slots) return InvalidArgument("lowest_slots: null array");
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  return select_all(LowestScoreKeys{scores}, count, k, nullptr, slots, alloc, limits, stream);
}

// ---- TopkSelection --------------------------------------------------------------------------------
TopkSelection::TopkSelection(int64_t k, const uint32_t* bitmap, DeviceAllocator& alloc, Stream stream)
    : k_(k), bitmap_(bitmap), alloc_(alloc), stream_(stream) {}

TopkSelection::~TopkSelection() {
  if (state_) alloc_.deallocate(state_, stream_);
}

Status TopkSelection::begin() {
  if (k_ < 1) return InvalidArgument("TopkSelection: k must be at least 1");
  if (!state_) state_ = alloc_.allocate(sizeof(SelectState), stream_);
  if (!state_) return Status(StatusCode::kCudaError, "out of device memory for the selection state");
  return select_init(static_cast<SelectState*>(state_), k_, stream_);
}

Status TopkSelection::histogram(int pass, const float* scores, int64_t count, int64_t first_position) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  if (pass < 0 || pass >= kPasses) return InvalidArgument("TopkSelection: pass out of range");
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  return select_histogram(AbsentMagnitudeKeys{scores, bitmap_, first_position}, count, aligned16(scores), pass,
                          static_cast<SelectState*>(state_), limits, stream_);
}

Status TopkSelection::pick(int pass) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  if (pass < 0 || pass >= kPasses) return InvalidArgument("TopkSelection: pass out of range");
  return select_pick(pass, static_cast<SelectState*>(state_), stream_);
}

Status TopkSelection::emit(const float* scores, int64_t count, int64_t first_position, int64_t* out) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  return select_emit(AbsentMagnitudeKeys{scores, bitmap_, first_position}, count, first_position, nullptr,
                     static_cast<SelectState*>(state_), out, alloc_, stream_);
}

}  // namespace snack::cuda
