// A snack (or aten) operator looked up in the dispatcher by name, for the kernels that call other
// operators through it (autocast's casts, the separable convolution's unfused path).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace snack::binding {

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace snack::binding
