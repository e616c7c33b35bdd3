// The C++ autograd kernels of the CPU library (common/*_autograd.h), in one
// translation unit, so that torch's autograd headers are compiled once.
#include "common/abn_autograd.h"
#include "common/softmax_autograd.h"

TORCH_LIBRARY_IMPL(effilayers, AutogradCPU, m) {
  effilayers::abn_autograd::register_kernels(m);
  effilayers::softmax_autograd::register_kernels(m);
}
TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  effilayers::abn_autograd::register_kernels(m);
  effilayers::softmax_autograd::register_kernels(m);
}
