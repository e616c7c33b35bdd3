// Activated BatchNorm's C++ autograd (common/abn_autograd.h) for CPU tensors.
#include "common/abn_autograd.h"

TORCH_LIBRARY_IMPL(effilayers, AutogradCPU, m) { effilayers::abn_autograd::register_kernels(m); }
TORCH_LIBRARY_IMPL(effilayers, CPU, m) { effilayers::abn_autograd::register_kernels(m); }
