// The activated-BatchNorm kernels of csrc/cuda/abn.cu, compiled as C++ for
// the SIMT emulator (effilayers_emulated): the same file, not a copy.
#include "cuda/abn.cu"
