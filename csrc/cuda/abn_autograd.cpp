// Activated BatchNorm's C++ autograd (common/abn_autograd.h) for CUDA tensors.
// Not part of the emulated test library, whose ops are its kernels alone.
#if !defined(EFFILAYERS_SIMT_EMULATION)
#include "common/abn_autograd.h"

TORCH_LIBRARY_IMPL(effilayers, AutogradCUDA, m) { effilayers::abn_autograd::register_kernels(m); }
TORCH_LIBRARY_IMPL(effilayers, CUDA, m) { effilayers::abn_autograd::register_kernels(m); }
#endif
