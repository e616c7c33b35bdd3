// Row-wise cross-entropy on CPU: the kernel of effilayers::cross_entropy, and the
// two passes of one vocabulary chunk of a wider row (cross_entropy_chunk_stats_,
// cross_entropy_chunk_grad_, and their cross_entropy_soft_chunk_* forms for
// probability targets; see the end of this file).
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
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "common/checks.h"
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

// Reads n values `stride` apart into buffer in the accumulation type; the
// contiguous case is its own loop, which the compiler vectorises (the
// conversion of fp16/bf16 included).
template <typename scalar_t, typename acc_t>
void widen_into(const scalar_t* x, int64_t stride, int64_t n, acc_t* buffer) {
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) buffer[k] = static_cast<acc_t>(x[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) buffer[k] = static_cast<acc_t>(x[k * stride]);
  }
}

// The maximum of n values, NaN ignored as std::max ignores it when it comes
// second; kLanes independent maxima so the loop needs no reassociation.
template <typename acc_t>
acc_t buffer_max(const acc_t* buffer, int64_t n) {
  constexpr int kLanes = 16;
  acc_t lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<acc_t>::infinity();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], buffer[k + l]);
  }
  acc_t result = -std::numeric_limits<acc_t>::infinity();
  for (int l = 0; l < kLanes; ++l) result = std::max(result, lanes[l]);
  for (; k < n; ++k) result = std::max(result, buffer[k]);
  return result;
}

// A row's running statistics: the maximum, sum exp(x - maximum), and the
// weighted sums sum_c w_c x_c and sum_c w_c: with label smoothing, w_c is
// the class weight (1 without weights); with probability targets, the
// weighted probability q_c.
template <typename acc_t>
struct RowStats {
  acc_t running_max = -std::numeric_limits<acc_t>::infinity();
  acc_t sum_exp = 0, sum_wx = 0, sum_w = 0;
};

// Folds C logits `stride` apart into `stats` (which may carry earlier
// chunks of the same row), kChunkClasses at a time through `buffer`.
// weigh(c0, len, values, stats) sees each piece in the accumulation type
// before it becomes exp values, for the weighted sums.
template <typename scalar_t, typename acc_t, typename Weigh>
void accumulate_row(const scalar_t* x, int64_t stride, int64_t C, acc_t* buffer, RowStats<acc_t>& stats,
                    const Weigh& weigh) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  for (int64_t c0 = 0; c0 < C; c0 += kChunkClasses) {
    const int64_t len = std::min(kChunkClasses, C - c0);
    widen_into(x + c0 * stride, stride, len, buffer);
    const acc_t chunk_max = buffer_max(buffer, len);
    weigh(c0, len, static_cast<const acc_t*>(buffer), stats);
    const acc_t new_max = std::max(stats.running_max, chunk_max);
    if (new_max != neg_inf) {  // all -inf so far: the sum stays 0
      exp_shifted(buffer, len, new_max);
      // 32 partial sums per chunk (vec.h), then one add per chunk: a
      // running scalar sum over 65K values loses ~1e-4 relative in float.
      const acc_t rescale = stats.running_max == neg_inf ? acc_t(0) : std::exp(stats.running_max - new_max);
      stats.sum_exp = stats.sum_exp * rescale + lane_sum(buffer, len);
    }
    stats.running_max = new_max;
  }
}

// Class-index rows' weighted sums: with label smoothing, sum_c w_c x_c and
// sum_c w_c (w_c = weight[c], 1 when null); nothing without.
template <typename acc_t>
auto smoothing_sums(const acc_t* weight, bool smoothing) {
  return [weight, smoothing](int64_t c0, int64_t len, const acc_t* values, RowStats<acc_t>& stats) {
    if (!smoothing) return;
    acc_t chunk_wx = 0, chunk_w = 0;
    if (weight == nullptr) {
      chunk_wx = lane_sum(values, len);
      chunk_w = static_cast<acc_t>(len);
    } else {
      for (int64_t k = 0; k < len; ++k) {
        chunk_wx += weight[c0 + k] * values[k];
        chunk_w += weight[c0 + k];
      }
    }
    stats.sum_wx += chunk_wx;
    stats.sum_w += chunk_w;
  };
}

// g[c] = scale * (coef * exp(x_c - lse) - (the row's other terms for c)):
// subtract(c0, len, values) takes those terms off each piece of coef *
// softmax in place. `g` may be `x` itself: each piece is read into `buffer`
// before it is written.
template <typename scalar_t, typename acc_t, typename Subtract>
void write_gradient(const scalar_t* x, int64_t x_stride, scalar_t* g, int64_t g_stride, int64_t C, acc_t lse,
                    acc_t coef, acc_t scale, acc_t* buffer, const Subtract& subtract) {
  for (int64_t c0 = 0; c0 < C; c0 += kChunkClasses) {
    const int64_t len = std::min(kChunkClasses, C - c0);
    widen_into(x + c0 * x_stride, x_stride, len, buffer);
    exp_shifted(buffer, len, lse);  // softmax
    for (int64_t k = 0; k < len; ++k) buffer[k] *= coef;
    subtract(c0, len, buffer);
    scalar_t* out = g + c0 * g_stride;
    if (g_stride == 1) {
      for (int64_t k = 0; k < len; ++k) out[k] = static_cast<scalar_t>(buffer[k] * scale);
    } else {
      for (int64_t k = 0; k < len; ++k) out[k * g_stride] = static_cast<scalar_t>(buffer[k] * scale);
    }
  }
}

// A class-index row's other gradient terms: class_scale * w_c (skipped when
// class_scale is 0; w_c = class_weight[c], 1 when null) and target_coef at
// class t (which, outside [0, C), matches no class).
template <typename acc_t>
auto class_index_terms(int64_t t, acc_t target_coef, const acc_t* class_weight, acc_t class_scale) {
  return [=](int64_t c0, int64_t len, acc_t* values) {
    if (class_scale != 0) {
      for (int64_t k = 0; k < len; ++k) {
        values[k] -= class_scale * (class_weight == nullptr ? acc_t(1) : class_weight[c0 + k]);
      }
    }
    const int64_t local = t - c0;
    if (local >= 0 && local < len) values[local] -= target_coef;
  };
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
      RowStats<acc_t> stats;
      accumulate_row(x, lg.class_stride, C, buffer, stats, smoothing_sums(weight, eps > 0));
      const acc_t lse = stats.running_max == neg_inf ? neg_inf : stats.running_max + std::log(stats.sum_exp);
      const acc_t x_t = static_cast<acc_t>(x[t * lg.class_stride]);
      const acc_t w_t = weight == nullptr ? acc_t(1) : weight[t];
      acc_t row_loss = (1 - eps) * w_t * (lse - x_t);
      if (eps > 0) row_loss += eps_per_class * (stats.sum_w * lse - stats.sum_wx);
      loss[r] = row_loss;
      if (g == nullptr) continue;

      const acc_t coef = eps > 0 ? (1 - eps) * w_t + eps_per_class * stats.sum_w : w_t;
      write_gradient(x, lg.class_stride, g, gg.class_stride, C, lse, coef, scale, buffer,
                     class_index_terms(t, (1 - eps) * w_t, weight, eps > 0 ? eps_per_class : acc_t(0)));
    }
  });
}

at::Tensor cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& grad,
                                  const at::Tensor& grad_scale, int64_t ignore_index, double label_smoothing) {
  const char* op = "cross_entropy_rows";
  TORCH_CHECK_VALUE(logits.dim() == 3, op, ": logits must be an (N, C, I) view, got ", logits.dim(), " dims");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(is_floating_type(dtype), op, ": logits must be float16, bfloat16, float32 or float64, got ", dtype);
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
        logits.const_data_ptr<scalar_t>(), lg, target.const_data_ptr<int64_t>(), optional_data<acc_t>(weight),
        grad.has_value() ? grad->mutable_data_ptr<scalar_t>() : nullptr, gg, grad_scale.const_data_ptr<acc_t>()[0],
        ignore_index, static_cast<acc_t>(label_smoothing), loss.mutable_data_ptr<acc_t>());
  });
  return loss;
}


// ---------------------------------------------------------------------------
// One vocabulary chunk of rows too wide to walk whole (linear_cross_entropy's
// vocabulary chunks): the logits are a (rows, classes) view, classes
// contiguous, holding classes [class_offset, class_offset + classes) of each
// row. Rows whose target is ignore_index are skipped by the statistics and
// get a zero gradient; targets are not range-checked here (the caller did,
// or flags them with a NaN scale).
//
// cross_entropy_chunk_stats_: stats is (4, rows) in the accumulation type,
// updated in place: [0] the running maximum, [1] sum exp(x - maximum),
// rescaled as the maximum grows, [2] the target's logit (written by the
// chunk that holds it), [3] with smoothing, += sum_c w_c x_c.
// cross_entropy_chunk_grad_: row_terms is (4, rows): the row's final
// log-sum-exp, the softmax's coefficient, the target's coefficient and the
// gradient's scale; class_term (classes,) is subtracted from every row's
// gradient (eps / C * w_c with label smoothing). The gradient is written
// over the logits.

struct ChunkGeometry {
  int64_t rows, classes, row_stride;
};

// The checks every chunk kernel makes: the logits, the optional per-class
// vectors (each with its name) and the per-row table (`count` rows of
// `rows` values, named `per_row_name`), the vectors and table in the
// accumulation type.
ChunkGeometry check_chunk(const char* op, const at::Tensor& logits, std::initializer_list<std::pair<
                              const std::optional<at::Tensor>*, const char*>> vectors,
                          const at::Tensor& per_row, const char* per_row_name, int64_t count) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && (logits.stride(1) == 1 || logits.size(1) <= 1), op,
                    ": logits must be a (rows, classes) view with contiguous classes, got sizes ", logits.sizes(),
                    " and strides ", logits.strides());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK_TYPE(is_floating_type(dtype), op, ": logits must be float16, bfloat16, float32 or float64, got ", dtype);
  TORCH_CHECK(logits.device().is_cpu(), op, " (cpu kernel): logits must be a CPU tensor, got ", logits.device());
  const auto acc_type = accumulation_type(dtype);
  const int64_t rows = logits.size(0), classes = logits.size(1);
  for (const auto& [vector, vector_name] : vectors) {
    if (!vector->has_value()) continue;
    const at::Tensor& v = **vector;
    TORCH_CHECK_VALUE(v.scalar_type() == acc_type && v.dim() == 1 && v.is_contiguous() && v.numel() == classes, op,
                      ": ", vector_name, " must be a contiguous ", acc_type, " tensor of ", classes, " classes");
  }
  TORCH_CHECK_VALUE(per_row.scalar_type() == acc_type && per_row.dim() == 2 && per_row.size(0) == count &&
                        per_row.size(1) == rows && per_row.is_contiguous(),
                    op, ": ", per_row_name, " must be a contiguous (", count, ", ", rows, ") ", acc_type, " tensor");
  return {rows, classes, logits.stride(0)};
}

// What the class-index chunk kernels check beside check_chunk's.
void check_class_index_chunk(const char* op, const ChunkGeometry& cg, const at::Tensor& target, int64_t class_offset) {
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong && target.dim() == 1 && target.is_contiguous() &&
                        target.numel() == cg.rows,
                    op, ": target must be a contiguous int64 tensor of ", cg.rows, " rows");
  TORCH_CHECK_VALUE(class_offset >= 0, op, ": class_offset must be >= 0, got ", class_offset);
}

// body(r, buffer) for every row of a chunk, in parallel blocks fixed by the
// shape, each with its stack buffer of kChunkClasses values.
template <typename acc_t, typename Body>
void for_each_chunk_row(const ChunkGeometry& cg, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(cg.classes, 1));
  at::parallel_for(0, cg.rows, grain, [&](int64_t begin, int64_t end) {
    acc_t buffer[kChunkClasses];
    for (int64_t r = begin; r < end; ++r) body(r, buffer);
  });
}

void cross_entropy_chunk_stats_cpu(const at::Tensor& logits, const at::Tensor& target,
                                   const std::optional<at::Tensor>& weight, const at::Tensor& stats,
                                   int64_t class_offset, int64_t ignore_index, bool smoothing) {
  const char* op = "cross_entropy_chunk_stats_";
  const ChunkGeometry cg = check_chunk(op, logits, {{&weight, "weight"}}, stats, "stats", 4);
  check_class_index_chunk(op, cg, target, class_offset);
  if (cg.rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_chunk_cpu", [&] {
    using acc_t = accumulation_t<scalar_t>;
    const scalar_t* data = logits.const_data_ptr<scalar_t>();
    const int64_t* targets = target.const_data_ptr<int64_t>();
    const acc_t* w = optional_data<acc_t>(weight);
    acc_t* s = stats.mutable_data_ptr<acc_t>();
    const int64_t R = cg.rows;
    for_each_chunk_row<acc_t>(cg, [&](int64_t r, acc_t* buffer) {
      const int64_t t = targets[r];
      if (t == ignore_index) return;
      const scalar_t* x = data + r * cg.row_stride;
      RowStats<acc_t> row;
      row.running_max = s[r];
      row.sum_exp = s[R + r];
      accumulate_row(x, 1, cg.classes, buffer, row, smoothing_sums(w, smoothing));
      s[r] = row.running_max;
      s[R + r] = row.sum_exp;
      const int64_t local = t - class_offset;
      if (local >= 0 && local < cg.classes) s[2 * R + r] = static_cast<acc_t>(x[local]);
      if (smoothing) s[3 * R + r] += row.sum_wx;
    });
  });
}

void cross_entropy_chunk_grad_cpu(const at::Tensor& logits, const at::Tensor& target,
                                  const std::optional<at::Tensor>& class_term, const at::Tensor& row_terms,
                                  int64_t class_offset, int64_t ignore_index) {
  const char* op = "cross_entropy_chunk_grad_";
  const ChunkGeometry cg = check_chunk(op, logits, {{&class_term, "class_term"}}, row_terms, "row_terms", 4);
  check_class_index_chunk(op, cg, target, class_offset);
  if (cg.rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_chunk_cpu", [&] {
    using acc_t = accumulation_t<scalar_t>;
    scalar_t* data = logits.mutable_data_ptr<scalar_t>();
    const int64_t* targets = target.const_data_ptr<int64_t>();
    const acc_t* term = optional_data<acc_t>(class_term);
    const acc_t* rt = row_terms.const_data_ptr<acc_t>();
    const int64_t R = cg.rows;
    for_each_chunk_row<acc_t>(cg, [&](int64_t r, acc_t* buffer) {
      scalar_t* g = data + r * cg.row_stride;
      const int64_t t = targets[r];
      if (t == ignore_index) {
        std::fill(g, g + cg.classes, scalar_t(0));
        return;
      }
      write_gradient(g, 1, g, 1, cg.classes, rt[r], rt[R + r], rt[3 * R + r], buffer,
                     class_index_terms(t - class_offset, rt[2 * R + r], term, term == nullptr ? acc_t(0) : acc_t(1)));
    });
  });
}

// -- probability targets ----------------------------------------------------
//
// cross_entropy_soft_chunk_stats_ / _grad_: the same two passes for rows
// whose target is a probability row `probs` (the chunk's classes, any
// floating type, any strides: a column slice of a transposed table is read
// where it lies), weighted as q_c = p_c * prob_weight_c + class_term_c
// (label smoothing and class weights, folded in by the caller; each vector
// optional). stats (4, rows): [0], [1] as above, [2] += sum_c q_c x_c,
// [3] += sum_c q_c. row_terms (3, rows): the final log-sum-exp, sum_c q_c
// over the whole row, and the gradient's scale; the gradient
// scale * (sum_q * softmax_c - q_c) is written over the logits.

// Where the probabilities are, resolved once per call: the type is
// switched on once per piece of kChunkClasses values, not per value.
struct ProbsView {
  const char* data;
  at::ScalarType type;
  int64_t row_stride, class_stride;  // in elements
};

// One piece of a probability row's weights: q[k] for classes c0 .. c0 + len.
template <typename acc_t>
void soft_weights(const ProbsView& probs, int64_t row, int64_t c0, int64_t len, const acc_t* prob_weight,
                  const acc_t* class_term, acc_t* q) {
  const int64_t offset = row * probs.row_stride + c0 * probs.class_stride;
  switch (probs.type) {
    case at::kDouble:
      widen_into(reinterpret_cast<const double*>(probs.data) + offset, probs.class_stride, len, q);
      break;
    case at::kFloat:
      widen_into(reinterpret_cast<const float*>(probs.data) + offset, probs.class_stride, len, q);
      break;
    case at::kHalf:
      widen_into(reinterpret_cast<const c10::Half*>(probs.data) + offset, probs.class_stride, len, q);
      break;
    default:  // check_probs let through only these four
      widen_into(reinterpret_cast<const c10::BFloat16*>(probs.data) + offset, probs.class_stride, len, q);
  }
  if (prob_weight != nullptr) {
    for (int64_t k = 0; k < len; ++k) q[k] *= prob_weight[c0 + k];
  }
  if (class_term != nullptr) {
    for (int64_t k = 0; k < len; ++k) q[k] += class_term[c0 + k];
  }
}

ProbsView check_probs(const char* op, const at::Tensor& logits, const at::Tensor& probs) {
  TORCH_CHECK_VALUE(probs.sizes() == logits.sizes(), op, ": probs must have the logits' shape ", logits.sizes(),
                    ", got ", probs.sizes());
  TORCH_CHECK_TYPE(is_floating_type(probs.scalar_type()), op, ": probs must be float16, bfloat16, float32 or float64, got ",
                   probs.scalar_type());
  TORCH_CHECK(probs.device().is_cpu(), op, " (cpu kernel): probs must be a CPU tensor, got ", probs.device());
  return {static_cast<const char*>(probs.const_data_ptr()), probs.scalar_type(), probs.stride(0), probs.stride(1)};
}

void cross_entropy_soft_chunk_stats_cpu(const at::Tensor& logits, const at::Tensor& probs,
                                        const std::optional<at::Tensor>& prob_weight,
                                        const std::optional<at::Tensor>& class_term, const at::Tensor& stats) {
  const char* op = "cross_entropy_soft_chunk_stats_";
  const ChunkGeometry cg =
      check_chunk(op, logits, {{&prob_weight, "prob_weight"}, {&class_term, "class_term"}}, stats, "stats", 4);
  const ProbsView view = check_probs(op, logits, probs);
  if (cg.rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_soft_cpu", [&] {
    using acc_t = accumulation_t<scalar_t>;
    const scalar_t* data = logits.const_data_ptr<scalar_t>();
    const acc_t* pw = optional_data<acc_t>(prob_weight);
    const acc_t* ct = optional_data<acc_t>(class_term);
    acc_t* s = stats.mutable_data_ptr<acc_t>();
    const int64_t R = cg.rows;
    for_each_chunk_row<acc_t>(cg, [&](int64_t r, acc_t* buffer) {
      acc_t q[kChunkClasses];
      RowStats<acc_t> row;
      row.running_max = s[r];
      row.sum_exp = s[R + r];
      accumulate_row(data + r * cg.row_stride, 1, cg.classes, buffer, row,
                     [&](int64_t c0, int64_t len, const acc_t* values, RowStats<acc_t>& sums) {
                       soft_weights(view, r, c0, len, pw, ct, q);
                       sums.sum_w += lane_sum(q, len);
                       for (int64_t k = 0; k < len; ++k) q[k] *= values[k];
                       sums.sum_wx += lane_sum(q, len);
                     });
      s[r] = row.running_max;
      s[R + r] = row.sum_exp;
      s[2 * R + r] += row.sum_wx;
      s[3 * R + r] += row.sum_w;
    });
  });
}

void cross_entropy_soft_chunk_grad_cpu(const at::Tensor& logits, const at::Tensor& probs,
                                       const std::optional<at::Tensor>& prob_weight,
                                       const std::optional<at::Tensor>& class_term, const at::Tensor& row_terms) {
  const char* op = "cross_entropy_soft_chunk_grad_";
  const ChunkGeometry cg = check_chunk(op, logits, {{&prob_weight, "prob_weight"}, {&class_term, "class_term"}},
                                       row_terms, "row_terms", 3);
  const ProbsView view = check_probs(op, logits, probs);
  if (cg.rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_soft_cpu", [&] {
    using acc_t = accumulation_t<scalar_t>;
    scalar_t* data = logits.mutable_data_ptr<scalar_t>();
    const acc_t* pw = optional_data<acc_t>(prob_weight);
    const acc_t* ct = optional_data<acc_t>(class_term);
    const acc_t* rt = row_terms.const_data_ptr<acc_t>();
    const int64_t R = cg.rows;
    for_each_chunk_row<acc_t>(cg, [&](int64_t r, acc_t* buffer) {
      acc_t q[kChunkClasses];
      scalar_t* g = data + r * cg.row_stride;
      write_gradient(g, 1, g, 1, cg.classes, rt[r], rt[R + r], rt[2 * R + r], buffer,
                     [&](int64_t c0, int64_t len, acc_t* values) {
                       soft_weights(view, r, c0, len, pw, ct, q);
                       for (int64_t k = 0; k < len; ++k) values[k] -= q[k];
                     });
    });
  });
}

}  // namespace
}  // namespace effilayers

// The ops are declared once, in effilayers/ops/cross_entropy/op.py; torch checks
// these kernels against those schemas when the library loads.
TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  m.impl("cross_entropy", &effilayers::cross_entropy_rows_cpu);
  m.impl("cross_entropy_chunk_stats_", &effilayers::cross_entropy_chunk_stats_cpu);
  m.impl("cross_entropy_chunk_grad_", &effilayers::cross_entropy_chunk_grad_cpu);
  m.impl("cross_entropy_soft_chunk_stats_", &effilayers::cross_entropy_soft_chunk_stats_cpu);
  m.impl("cross_entropy_soft_chunk_grad_", &effilayers::cross_entropy_soft_chunk_grad_cpu);
}
