// EFFILAYERS_LAUNCH(grid, block, stream, kernel)(arguments...): a kernel
// launch that nvcc sees as exactly `kernel<<<grid, block, 0, stream>>>(...)`
// and that the test library effilayers_emulated (EFFILAYERS_SIMT_EMULATION)
// runs on the CPU through the SIMT emulator (emulation/simt.h), which counts
// launches under the kernel's name. The kernel comes last so its template
// arguments may hold commas.
#pragma once

#if defined(EFFILAYERS_SIMT_EMULATION)
#include "emulation/simt.h"
#define EFFILAYERS_LAUNCH(grid, block, stream, ...) \
  ::simt::launcher<&__VA_ARGS__>(#__VA_ARGS__, (grid), (block), (stream))
#else
#define EFFILAYERS_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif
