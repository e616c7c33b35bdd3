// Stand-in for the CUDA toolkit's cuda_runtime.h in the emulated build
// (effilayers_emulated): the kernel language and runtime API of
// emulation/simt.h.
#pragma once

#include "emulation/simt.h"

// The 16-byte vector type the kernels copy through (elementwise.cuh);
// may_alias because it reinterprets arrays of other element types.
struct __attribute__((may_alias, aligned(16))) uint4 {
  unsigned x, y, z, w;
};
