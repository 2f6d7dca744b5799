// Error reporting of the framework-free core: every public function returns a Status.
#pragma once

#include <string>
#include <utility>

namespace snack {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // a shape, length, dtype or value that the function does not accept
  kOutOfRange,       // an index outside the matrix
  kDuplicateEntry,   // two slots at the same (row, col) position
  kUnsupported,      // valid but not implemented (for example nnz >= 2^31)
  kCudaError,        // a CUDA runtime call or kernel launch failed
};

/// Outcome of a core call. A non-ok Status carries a message that names the offending argument.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

}  // namespace snack

// Returns early from the enclosing function when `expr` yields a non-ok Status.
#define SNACK_RETURN_IF_ERROR(expr)         \
  do {                                      \
    ::snack::Status snack_status_ = (expr); \
    if (!snack_status_.ok()) return snack_status_; \
  } while (0)
