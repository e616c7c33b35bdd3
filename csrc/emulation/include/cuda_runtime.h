// Stand-in for the CUDA toolkit's cuda_runtime.h in the emulated build
// (effilayers_emulated): the kernel language and runtime API of
// emulation/simt.h.
#pragma once

#include "emulation/simt.h"
