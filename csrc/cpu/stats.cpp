// Per-channel batch statistics on CPU: effilayers_cpu::batch_stats.
//
// The values of each channel are cut into chunks of kChunkElements. A chunk
// is converted to the accumulation type into a small buffer (it stays in L1)
// and reduced with a corrected two-pass: mean of the chunk, then the sums of
// (x - mean) and (x - mean)^2, which fix the mean's rounding and give M2
// without the cancellation of a one-pass sum of squares. Chunks are combined
// with Chan's formula in double, in a fixed order, so the result does not
// depend on the number of threads. Chunks are independent work items, so a
// layer with few channels still uses every thread.
//
// Layouts are read in place: channels_first walks each channel's N planes of
// S values; channels_last walks tiles of rows x channels with unit stride.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/batch_norm.h"
#include "common/checks.h"
#include "cpu/vec.h"

namespace effilayers {
namespace {

// 4096 fp32 values = 16 KiB: the two passes over a chunk hit L1.
constexpr int64_t kChunkElements = 4096;
// channels_last tiles: up to 1024 channels wide and 16384 values (64 KiB of
// fp32, in L2 for the second pass), at least 16 rows deep, so there are few
// partial results per channel to merge.
constexpr int64_t kTileChannels = 1024;
constexpr int64_t kTileElements = 16384;
constexpr int64_t kMinTileRows = 16;
// Mean and M2 of a contiguous buffer (n > 0), corrected two-pass.
template <typename acc_t>
void buffer_moments(const acc_t* x, int64_t n, acc_t& mean, acc_t& m2) {
  const acc_t center = lane_sum(x, n) / static_cast<acc_t>(n);
  acc_t sum_d, sum_d2;
  lane_centered_sums(x, n, center, sum_d, sum_d2);
  mean = center + sum_d / static_cast<acc_t>(n);
  m2 = std::max(sum_d2 - sum_d * sum_d / static_cast<acc_t>(n), acc_t(0));
}

template <typename acc_t>
void finalize(const Moments& m, int64_t correction, acc_t* mean_out, acc_t* var_out) {
  if (m.count == 0) {  // empty batch: the neutral element of a merge
    *mean_out = 0;
    *var_out = 0;
    return;
  }
  const double dof = m.count - static_cast<double>(correction);
  *mean_out = static_cast<acc_t>(m.mean);
  *var_out = dof > 0 ? static_cast<acc_t>(m.m2 / dof) : std::numeric_limits<acc_t>::quiet_NaN();
}

template <typename scalar_t, typename acc_t>
void stats_channels_first(const scalar_t* x, const BatchGeometry& g, int64_t correction, acc_t* mean_out,
                          acc_t* var_out) {
  const int64_t C = g.channels, S = g.spatial;
  const int64_t per_channel = g.batch * S;
  const int64_t chunks = (per_channel + kChunkElements - 1) / kChunkElements;
  std::vector<acc_t> part_mean(C * chunks), part_m2(C * chunks);

  // Below ~8 chunks the fork/join costs more than it saves.
  at::parallel_for(0, C * chunks, 8, [&](int64_t begin, int64_t end) {
    acc_t buffer[kChunkElements];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task / chunks, j = task % chunks;
      const int64_t first = j * kChunkElements;
      const int64_t last = std::min(first + kChunkElements, per_channel);
      // Value f of channel c is element (f / S, c, f % S); copy the chunk's
      // runs of consecutive spatial positions.
      int64_t filled = 0;
      for (int64_t f = first; f < last;) {
        const int64_t n = f / S, s = f % S;
        const int64_t run = std::min(S - s, last - f);
        const scalar_t* src = x + (n * C + c) * S + s;
        for (int64_t r = 0; r < run; ++r) buffer[filled + r] = static_cast<acc_t>(src[r]);
        filled += run;
        f += run;
      }
      buffer_moments(buffer, filled, part_mean[task], part_m2[task]);
    }
  });

  at::parallel_for(0, C, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      Moments m;
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t n = std::min(kChunkElements, per_channel - j * kChunkElements);
        m.merge(static_cast<double>(n), part_mean[c * chunks + j], part_m2[c * chunks + j]);
      }
      finalize(m, correction, mean_out + c, var_out + c);
    }
  });
}

template <typename scalar_t, typename acc_t>
inline typename Vec<acc_t>::type load_as(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return Vec<acc_t>::load(p);
  } else {
    typename Vec<acc_t>::type v;
    for (int l = 0; l < Vec<acc_t>::kWidth; ++l) v[l] = static_cast<acc_t>(p[l]);
    return v;
  }
}

// Moments of `width` channels (a multiple of two vector widths) over `rows`
// rows that are `stride` apart. The first pass walks the tile row by row, so
// memory is read sequentially and the tile lands in L2; the second pass
// walks one group of channels down the rows at a time with its accumulators
// in registers. `sums` is scratch for `width` values.
template <typename scalar_t, typename acc_t>
void tile_moments_vectorized(const scalar_t* x, int64_t stride, int64_t rows, int64_t width, acc_t* sums,
                             acc_t* out_mean, acc_t* out_m2) {
  using V = Vec<acc_t>;
  constexpr int W = V::kWidth;
  const acc_t n = static_cast<acc_t>(rows);
  std::fill(sums, sums + width, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* row = x + r * stride;
    for (int64_t c = 0; c < width; c += W) {
      const auto total = V::load(sums + c) + load_as<scalar_t, acc_t>(row + c);
      std::memcpy(sums + c, &total, sizeof(total));
    }
  }
  for (int64_t c = 0; c < width; c += 2 * W) {
    const typename V::type center0 = V::load(sums + c) / n, center1 = V::load(sums + c + W) / n;
    typename V::type d0 = {}, d1 = {}, q0 = {}, q1 = {};
    for (int64_t r = 0; r < rows; ++r) {
      const auto v0 = load_as<scalar_t, acc_t>(x + r * stride + c) - center0;
      const auto v1 = load_as<scalar_t, acc_t>(x + r * stride + c + W) - center1;
      d0 += v0;
      d1 += v1;
      q0 += v0 * v0;
      q1 += v1 * v1;
    }
    const auto mean0 = center0 + d0 / n, mean1 = center1 + d1 / n;
    const auto m2_0 = q0 - d0 * d0 / n, m2_1 = q1 - d1 * d1 / n;
    for (int l = 0; l < W; ++l) {
      out_mean[c + l] = mean0[l];
      out_mean[c + W + l] = mean1[l];
      out_m2[c + l] = std::max(m2_0[l], acc_t(0));
      out_m2[c + W + l] = std::max(m2_1[l], acc_t(0));
    }
  }
}

// The same for any width, one channel at a time across each row (used for
// the channels left over by the vectorised groups); scratch arrays hold
// `width` accumulators each.
template <typename scalar_t, typename acc_t>
void tile_moments_scalar(const scalar_t* x, int64_t stride, int64_t rows, int64_t width, acc_t* center,
                         acc_t* sum_d, acc_t* sum_d2, acc_t* out_mean, acc_t* out_m2) {
  if (width == 0) return;
  const acc_t n = static_cast<acc_t>(rows);
  std::fill(center, center + width, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) center[c] += static_cast<acc_t>(x[r * stride + c]);
  }
  for (int64_t c = 0; c < width; ++c) center[c] /= n;
  std::fill(sum_d, sum_d + width, acc_t(0));
  std::fill(sum_d2, sum_d2 + width, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const acc_t d = static_cast<acc_t>(x[r * stride + c]) - center[c];
      sum_d[c] += d;
      sum_d2[c] += d * d;
    }
  }
  for (int64_t c = 0; c < width; ++c) {
    out_mean[c] = center[c] + sum_d[c] / n;
    out_m2[c] = std::max(sum_d2[c] - sum_d[c] * sum_d[c] / n, acc_t(0));
  }
}

template <typename scalar_t, typename acc_t>
void stats_channels_last(const scalar_t* x, const BatchGeometry& g, int64_t correction, acc_t* mean_out,
                         acc_t* var_out) {
  const int64_t C = g.channels;
  const int64_t rows = g.batch * g.spatial;
  const int64_t tile_channels = std::min(C, kTileChannels);
  const int64_t channel_tiles = (C + tile_channels - 1) / tile_channels;
  const int64_t tile_rows = std::max(kMinTileRows, kTileElements / tile_channels);
  const int64_t row_tiles = (rows + tile_rows - 1) / tile_rows;
  // partials[row_tile][channel]: each row tile covers every channel once.
  std::vector<acc_t> part_mean(row_tiles * C), part_m2(row_tiles * C);

  const int64_t grain = std::max<int64_t>(1, (8 * kChunkElements) / (tile_rows * tile_channels));
  at::parallel_for(0, row_tiles * channel_tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> center(tile_channels), sum_d(tile_channels), sum_d2(tile_channels);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t rt = task / channel_tiles, ct = task % channel_tiles;
      const int64_t r0 = rt * tile_rows, r1 = std::min(r0 + tile_rows, rows);
      const int64_t c0 = ct * tile_channels, width = std::min(tile_channels, C - c0);
      const acc_t n = static_cast<acc_t>(r1 - r0);

      acc_t* out_mean = part_mean.data() + rt * C + c0;
      acc_t* out_m2 = part_m2.data() + rt * C + c0;
      const int64_t vector_width = width - width % (2 * Vec<acc_t>::kWidth);
      tile_moments_vectorized(x + r0 * C + c0, C, r1 - r0, vector_width, center.data(), out_mean, out_m2);
      tile_moments_scalar(x + r0 * C + c0 + vector_width, C, r1 - r0, width - vector_width, center.data(),
                          sum_d.data(), sum_d2.data(), out_mean + vector_width, out_m2 + vector_width);
    }
  });

  // Merge row tiles in order, a block of channels per task so the partials
  // are read with unit stride.
  constexpr int64_t kMergeChannels = 256;
  const int64_t channel_blocks = (C + kMergeChannels - 1) / kMergeChannels;
  at::parallel_for(0, channel_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Moments> moments(kMergeChannels);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c0 = block * kMergeChannels, width = std::min(kMergeChannels, C - c0);
      std::fill(moments.begin(), moments.end(), Moments{});
      for (int64_t rt = 0; rt < row_tiles; ++rt) {
        const double n = static_cast<double>(std::min(tile_rows, rows - rt * tile_rows));
        for (int64_t c = 0; c < width; ++c) {
          moments[c].merge(n, part_mean[rt * C + c0 + c], part_m2[rt * C + c0 + c]);
        }
      }
      for (int64_t c = 0; c < width; ++c) finalize(moments[c], correction, mean_out + c0 + c, var_out + c0 + c);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_stats_cpu(const at::Tensor& input_arg, int64_t correction) {
  check_batch_input(input_arg, "batch_stats");
  TORCH_CHECK_VALUE(correction >= 0, "batch_stats: correction must be non-negative, got ", correction);
  TORCH_CHECK(input_arg.device().is_cpu(), "batch_stats (cpu kernel): input must be a CPU tensor, got ",
              input_arg.device());
  const at::Tensor input = readable_batch(input_arg);
  const BatchGeometry g = batch_geometry(input);
  const auto acc_type = accumulation_type(input.scalar_type());
  at::Tensor mean = at::empty({g.channels}, input.options().dtype(acc_type));
  at::Tensor var = at::empty({g.channels}, input.options().dtype(acc_type));
  const int64_t count = g.batch * g.spatial;
  at::Tensor count_tensor = at::scalar_tensor(count, input.options().dtype(at::kLong));

  if (g.channels > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "batch_stats_cpu", [&] {
      using acc_t = accumulation_t<scalar_t>;
      const scalar_t* x = input.const_data_ptr<scalar_t>();
      acc_t* mean_ptr = mean.mutable_data_ptr<acc_t>();
      acc_t* var_ptr = var.mutable_data_ptr<acc_t>();
      if (count == 0) {
        std::fill(mean_ptr, mean_ptr + g.channels, acc_t(0));
        std::fill(var_ptr, var_ptr + g.channels, acc_t(0));
      } else if (g.channels_last) {
        stats_channels_last<scalar_t, acc_t>(x, g, correction, mean_ptr, var_ptr);
      } else {
        stats_channels_first<scalar_t, acc_t>(x, g, correction, mean_ptr, var_ptr);
      }
    });
  }
  return {mean, var, count_tensor};
}

// normalizing_statistics' finishing step as one loop over the channels: the
// ATen composition (finish_statistics_aten) is eight small ops, which on a
// small layer cost more than the statistics. Each running value is computed
// in double and rounded once.
at::Tensor finish_statistics_cpu(const at::Tensor& mean, const at::Tensor& var, int64_t count,
                                 const std::optional<at::Tensor>& running_mean,
                                 const std::optional<at::Tensor>& running_var,
                                 const std::optional<at::Tensor>& num_batches_tracked, double momentum,
                                 bool cumulative, double eps) {
  const int64_t C = var.numel();
  for (const auto* running : {&running_mean, &running_var}) {
    if (!running->has_value()) continue;
    const at::Tensor& t = running->value();
    TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() == C && t.device().is_cpu(),
                      "normalizing_statistics: running statistics must be CPU tensors of shape (", C, ",), got ",
                      t.sizes(), " on ", t.device());
  }
  if (num_batches_tracked) num_batches_tracked->add_(1);
  at::Tensor invstd = at::empty_like(var);
  const bool update = count > 0 && (running_mean || running_var);
  const double factor = update ? running_factor(num_batches_tracked, momentum, cumulative) : 0.0;
  const double unbias = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
  AT_DISPATCH_FLOATING_TYPES(var.scalar_type(), "finish_statistics_cpu", [&] {
    using acc_t = scalar_t;
    const acc_t* mean_ptr = mean.const_data_ptr<acc_t>();
    const acc_t* var_ptr = var.const_data_ptr<acc_t>();
    acc_t* invstd_ptr = invstd.mutable_data_ptr<acc_t>();
    for (int64_t c = 0; c < C; ++c) invstd_ptr[c] = acc_t(1) / std::sqrt(var_ptr[c] + static_cast<acc_t>(eps));
    if (!update) return;
    const auto blend = [&](const at::Tensor& running, const acc_t* batch, double scale) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, running.scalar_type(), "running_update", [&] {
        scalar_t* out = running.mutable_data_ptr<scalar_t>();
        const int64_t stride = running.stride(0);
        for (int64_t c = 0; c < C; ++c) {
          const double old = static_cast<double>(out[c * stride]);
          out[c * stride] = static_cast<scalar_t>((1 - factor) * old + factor * scale * batch[c]);
        }
      });
      // What an in-place ATen op does: tensors saved from the buffer see the write.
      running.unsafeGetTensorImpl()->bump_version();
    };
    if (running_mean) blend(*running_mean, mean_ptr, 1.0);
    if (running_var) blend(*running_var, var_ptr, unbias);
  });
  return invstd;
}

}  // namespace
}  // namespace effilayers

TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  effilayers::register_statistics_kernels<&effilayers::batch_stats_cpu, &effilayers::finish_statistics_cpu>(m);
}
