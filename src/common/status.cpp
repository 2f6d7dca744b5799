#include "snack/status.h"

namespace snack {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kOutOfRange: return "index out of range";
    case StatusCode::kDuplicateEntry: return "duplicate entry";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kCudaError: return "CUDA error";
  }
  return "unknown status";
}

}  // namespace snack
