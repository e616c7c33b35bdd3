// Row-wise cross-entropy on CPU: effilayers_cpu::cross_entropy_rows.
//
// The logits arrive as an (N, C, I) strided view (the Python side merges
// (N, C, d1, ...) with _core/layout.three_groups, copying only when the
// strides do not merge); row r = n * I + i reads C values `class_stride`
// apart. Each row is walked in chunks of kChunkClasses values converted to
// the accumulation type (float, double for double logits) in a stack buffer
// that stays in L1, so no float copy of the logits is ever made:
//
//   pass 1: online maximum and rescaled sum of exp (plus sum_c w_c x_c and
//           sum_c w_c when label smoothing needs them) -> log-sum-exp;
//   pass 2: only when a gradient is wanted: reads the chunk again and writes
//           the reduction-scaled gradient, element by element, into `grad`
//           (which may be the logits themselves: each element is read before
//           it is written, and rows do not share elements).
//
// Rows are independent, so at::parallel_for splits them in blocks fixed by
// the shape; each row is summed sequentially, so results do not depend on
// the thread count. Targets out of [0, C) that are not ignore_index raise.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/checks.h"
#include "common/schemas.h"
#include "cpu/vec.h"
#include "cpu/vec_math.h"

namespace effilayers {
namespace {

// 2048 classes x 4 bytes = 8 KiB of float (16 KiB of double) per chunk.
constexpr int64_t kChunkClasses = 2048;
// Rows per parallel task: at least ~32K logits of work, so fork/join costs
// stay small for short rows.
constexpr int64_t kMinTaskElements = 1 << 15;

struct RowGeometry {
  int64_t rows, classes, inner;
  int64_t outer_stride, class_stride, inner_stride;
};

RowGeometry geometry_of(const at::Tensor& t) {
  return {t.size(0) * t.size(2), t.size(1), t.size(2), t.stride(0), t.stride(1), t.stride(2)};
}

// buffer[k] = exp(buffer[k] - shift). std::exp does not vectorise (errno),
// and it is most of this kernel's time, so float uses vec_math.h's exp_vec
// (the same polynomial exp as the softmax kernels). Every argument here is
// <= 0 (the shift is the running maximum or the log-sum-exp), where exp_vec
// is accurate to about 2 ulp; -inf gives 0 and NaN stays NaN.
template <typename acc_t>
void exp_shifted(acc_t* buffer, int64_t n, acc_t shift) {
  for (int64_t k = 0; k < n; ++k) buffer[k] = std::exp(buffer[k] - shift);
}

template <>
void exp_shifted<float>(float* buffer, int64_t n, float shift) {
  using V = Vec<float>;
  constexpr int W = V::kWidth;
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    const VecF e = exp_vec(V::load(buffer + k) - shift);
    std::memcpy(buffer + k, &e, sizeof(e));
  }
  for (; k < n; ++k) buffer[k] = std::exp(buffer[k] - shift);
}

template <typename scalar_t, typename acc_t>
void cross_entropy_rows_kernel(const scalar_t* logits, const RowGeometry& lg, const int64_t* target,
                               const acc_t* weight, scalar_t* grad, const RowGeometry& gg, acc_t scale,
                               int64_t ignore_index, acc_t eps, acc_t* loss) {
  const int64_t C = lg.classes;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const acc_t eps_per_class = eps / static_cast<acc_t>(C);
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(C, 1));
  at::parallel_for(0, lg.rows, grain, [&](int64_t begin, int64_t end) {
    acc_t buffer[kChunkClasses];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / lg.inner, i = r % lg.inner;
      const scalar_t* x = logits + n * lg.outer_stride + i * lg.inner_stride;
      scalar_t* g = grad == nullptr ? nullptr : grad + n * gg.outer_stride + i * gg.inner_stride;
      const int64_t t = target[r];
      if (t == ignore_index) {
        loss[r] = 0;
        if (g != nullptr) {
          for (int64_t c = 0; c < C; ++c) g[c * gg.class_stride] = scalar_t(0);
        }
        continue;
      }
      TORCH_CHECK_INDEX(t >= 0 && t < C, "cross_entropy: target ", t, " is out of bounds for ", C,
                        " classes (and is not ignore_index=", ignore_index, ")");
      acc_t running_max = neg_inf, sum_exp = 0, sum_wx = 0, sum_w = 0;
      for (int64_t c0 = 0; c0 < C; c0 += kChunkClasses) {
        const int64_t len = std::min(kChunkClasses, C - c0);
        acc_t chunk_max = neg_inf;
        for (int64_t k = 0; k < len; ++k) {
          buffer[k] = static_cast<acc_t>(x[(c0 + k) * lg.class_stride]);
          chunk_max = std::max(chunk_max, buffer[k]);
        }
        if (eps > 0) {  // before the buffer is overwritten with exp values
          acc_t chunk_wx = 0, chunk_w = 0;
          if (weight == nullptr) {
            chunk_wx = lane_sum(buffer, len);
            chunk_w = static_cast<acc_t>(len);
          } else {
            for (int64_t k = 0; k < len; ++k) {
              chunk_wx += weight[c0 + k] * buffer[k];
              chunk_w += weight[c0 + k];
            }
          }
          sum_wx += chunk_wx;
          sum_w += chunk_w;
        }
        const acc_t new_max = std::max(running_max, chunk_max);
        if (new_max != neg_inf) {  // all -inf so far: the sum stays 0
          exp_shifted(buffer, len, new_max);
          // 32 partial sums per chunk (vec.h), then one add per chunk: a
          // running scalar sum over 65K values loses ~1e-4 relative in float.
          const acc_t rescale = running_max == neg_inf ? acc_t(0) : std::exp(running_max - new_max);
          sum_exp = sum_exp * rescale + lane_sum(buffer, len);
        }
        running_max = new_max;
      }
      const acc_t lse = running_max == neg_inf ? neg_inf : running_max + std::log(sum_exp);
      const acc_t x_t = static_cast<acc_t>(x[t * lg.class_stride]);
      const acc_t w_t = weight == nullptr ? acc_t(1) : weight[t];
      acc_t row_loss = (1 - eps) * w_t * (lse - x_t);
      if (eps > 0) row_loss += eps_per_class * (sum_w * lse - sum_wx);
      loss[r] = row_loss;
      if (g == nullptr) continue;

      // d loss / d x_c = coef * softmax_c - eps/C * w_c - (1 - eps) * w_t * [c == t]
      const acc_t coef = eps > 0 ? (1 - eps) * w_t + eps_per_class * sum_w : w_t;
      for (int64_t c0 = 0; c0 < C; c0 += kChunkClasses) {
        const int64_t len = std::min(kChunkClasses, C - c0);
        for (int64_t k = 0; k < len; ++k) buffer[k] = static_cast<acc_t>(x[(c0 + k) * lg.class_stride]);
        exp_shifted(buffer, len, lse);  // softmax
        for (int64_t k = 0; k < len; ++k) {
          const int64_t c = c0 + k;
          acc_t value = coef * buffer[k];
          if (eps > 0) value -= eps_per_class * (weight == nullptr ? acc_t(1) : weight[c]);
          if (c == t) value -= (1 - eps) * w_t;
          g[c * gg.class_stride] = static_cast<scalar_t>(value * scale);
        }
      }
    }
  });
}

at::Tensor cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& grad,
                                  const at::Tensor& grad_scale, int64_t ignore_index, double label_smoothing) {
  const char* op = "cross_entropy_rows";
  TORCH_CHECK_VALUE(logits.dim() == 3, op, ": logits must be an (N, C, I) view, got ", logits.dim(), " dims");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble, op,
                   ": logits must be float16, bfloat16, float32 or float64, got ", dtype);
  TORCH_CHECK(logits.device().is_cpu(), op, " (cpu kernel): logits must be a CPU tensor, got ", logits.device());
  const auto acc_type = accumulation_type(dtype);
  const RowGeometry lg = geometry_of(logits);
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong && target.dim() == 1 && target.is_contiguous() &&
                        target.numel() == lg.rows,
                    op, ": target must be a contiguous int64 tensor of ", lg.rows, " rows");
  TORCH_CHECK_VALUE(label_smoothing >= 0 && label_smoothing <= 1, op, ": label_smoothing must be in [0, 1], got ",
                    label_smoothing);
  if (weight.has_value()) {
    TORCH_CHECK_VALUE(weight->scalar_type() == acc_type && weight->dim() == 1 && weight->is_contiguous() &&
                          weight->numel() == lg.classes,
                      op, ": weight must be a contiguous ", acc_type, " tensor of ", lg.classes, " classes");
  }
  TORCH_CHECK_VALUE(grad_scale.scalar_type() == acc_type && grad_scale.numel() == 1 && grad_scale.device().is_cpu(),
                    op, ": grad_scale must be a 1-element ", acc_type, " CPU tensor");
  RowGeometry gg{};
  if (grad.has_value()) {
    TORCH_CHECK_VALUE(grad->sizes() == logits.sizes() && grad->scalar_type() == dtype, op,
                      ": grad must have the logits' shape ", logits.sizes(), " and dtype ", dtype);
    gg = geometry_of(*grad);
  }
  at::Tensor loss = at::empty({lg.rows}, logits.options().dtype(acc_type));
  if (lg.rows == 0) return loss;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "cross_entropy_rows_cpu", [&] {
    using acc_t = accumulation_t<scalar_t>;
    cross_entropy_rows_kernel<scalar_t, acc_t>(
        logits.const_data_ptr<scalar_t>(), lg, target.const_data_ptr<int64_t>(),
        weight.has_value() ? weight->const_data_ptr<acc_t>() : nullptr,
        grad.has_value() ? grad->mutable_data_ptr<scalar_t>() : nullptr, gg, grad_scale.const_data_ptr<acc_t>()[0],
        ignore_index, static_cast<acc_t>(label_smoothing), loss.mutable_data_ptr<acc_t>());
  });
  return loss;
}

}  // namespace
}  // namespace effilayers

TORCH_LIBRARY_FRAGMENT(effilayers_cpu, m) { m.def(effilayers::schema::kCrossEntropyRows); }

TORCH_LIBRARY_IMPL(effilayers_cpu, CPU, m) { m.impl("cross_entropy_rows", &effilayers::cross_entropy_rows_cpu); }
