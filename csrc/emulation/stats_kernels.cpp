// The batch-statistics kernels of csrc/cuda/stats.cu, compiled as C++ for the
// SIMT emulator (effilayers_emulated): the same file, not a copy.
#include "cuda/stats.cu"
