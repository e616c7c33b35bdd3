// The typed dispatcher handle of one of effilayers' ops, looked up by name:
// how the C++ autograd kernels (common/*_autograd.h) call the kernels below
// them, so that whatever the dispatcher has registered (the compiled kernel, or
// one a test forced with effilayers._core.registry.use_backend) is what runs.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace effilayers {

template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace effilayers
