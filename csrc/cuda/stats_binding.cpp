// Torch binding of the batch-statistics CUDA kernels in stats.cu:
// effilayers_cuda::batch_stats. Built where torch has CUDA, and on CPU
// tensors into the emulated test library (binding.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common/batch_norm.h"
#include "common/checks.h"
#include "cuda/binding.h"
#include "cuda/stats.cuh"

namespace effilayers {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_stats_cuda(const at::Tensor& input_arg, int64_t correction) {
  check_batch_input(input_arg, "batch_stats");
  TORCH_CHECK_VALUE(correction >= 0, "batch_stats: correction must be non-negative, got ", correction);
  TORCH_CHECK(on_kernel_device(input_arg), "batch_stats (cuda kernel): input must be a ", kKernelDevice,
              " tensor, got ", input_arg.device());
  const KernelDeviceGuard guard(input_arg.device());
  const at::Tensor input = readable_batch(input_arg);
  const BatchGeometry g = batch_geometry(input);
  const auto acc_options = input.options().dtype(accumulation_type(input.scalar_type()));
  at::Tensor mean = at::empty({g.channels}, acc_options);
  at::Tensor var = at::empty({g.channels}, acc_options);
  at::Tensor count = at::scalar_tensor(g.batch * g.spatial, input.options().dtype(at::kLong));

  const cuda::StatsPlan plan = cuda::plan_batch_stats(g.batch, g.channels, g.spatial, g.channels_last);
  at::Tensor workspace =
      at::empty({std::max<int64_t>(1, cuda::batch_stats_workspace_elements(plan))}, acc_options);
  EFFILAYERS_KERNEL_CHECK(cuda::batch_stats(input.const_data_ptr(), kernel_dtype(input.scalar_type(), "batch_stats"),
                                            plan, correction, mean.mutable_data_ptr(), var.mutable_data_ptr(),
                                            workspace.mutable_data_ptr(), kernel_stream()));
  return {mean, var, count};
}

}  // namespace
}  // namespace effilayers

TORCH_LIBRARY_IMPL(EFFILAYERS_KERNEL_LIBRARY, EFFILAYERS_KERNEL_DISPATCH_KEY, m) {
  effilayers::register_statistics_kernels<&effilayers::batch_stats_cuda, &effilayers::finish_statistics_aten>(m);
}
