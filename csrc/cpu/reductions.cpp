// Reductions (sum, mean, var, std, vector 2-norm) on CPU: the CPU kernel of
// effilayers::reduce (effilayers/ops/reductions/).
//
// The input is viewed as (outer, reduced, inner) (cpu/layout.h, the same
// view as the Python kernels' contract.as_three) and reduced into a
// contiguous (outer, inner) output of the result dtype. Every output element
// reduces `reduced` values.
//
// Numerics. The reduced range is cut into blocks of at most kBlock values
// (fixed by the shape, never by the thread count: results are bitwise
// reproducible). A block is reduced in the accumulation type (float for
// fp16/bf16/fp32 input, double for double) with several vector
// accumulators; var/std use a two-pass mean/M2 inside the block. Block
// results are combined in double, in order (Chan's formula for mean/M2).
//
// Overflow. fp16 values cannot overflow a float block (65504^2 * 4096 is
// ~1.8e13). bf16 and fp32 values can (bf16 reaches 3.39e38): a block whose
// float result is not finite while its values are finite is recomputed with
// its values multiplied by 2^-e, e the exponent of the block's largest
// magnitude. That multiplication is exact (a power of two; only values
// 2^-126 below the block maximum lose bits), the scaled block cannot
// overflow, and its result goes back up by 2^e (2^2e for squares) in double,
// whose range holds any sum of fp32 values. The fast path costs nothing
// extra; the rescue runs only for blocks that overflowed.
//
// Layouts. reduced stride 1 (the last dims of a contiguous tensor, the
// channel dim of channels_last): each block is converted into an L1 buffer
// and reduced with unit stride. Otherwise: the outputs that sit next to each
// other in memory (inner stride 1, or outer stride 1 when inner == 1, e.g. a
// transposed matrix) are walked as columns of a tile, a row of the tile at a
// time, so the loads are sequential and the per-column accumulators
// vectorise without reassociation.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common/checks.h"
#include "cpu/layout.h"
#include "cpu/vec.h"

namespace effilayers {
namespace {

enum class Kind { Sum, Mean, Var, Std, Norm };
// What a block contributes: a sum, a sum of squares, or (mean, M2).
enum class Partial { Sum, SumSq, Moments };

Kind parse_kind(const std::string& name) {
  if (name == "sum") return Kind::Sum;
  if (name == "mean") return Kind::Mean;
  if (name == "var") return Kind::Var;
  if (name == "std") return Kind::Std;
  if (name == "norm") return Kind::Norm;
  TORCH_CHECK_VALUE(false, "reduce: kind must be one of sum, mean, var, std, norm, got '", name, "'");
}

Partial partial_of(Kind kind) {
  if (kind == Kind::Norm) return Partial::SumSq;
  if (kind == Kind::Var || kind == Kind::Std) return Partial::Moments;
  return Partial::Sum;
}

// 4096 floats = 16 KiB: a block converted to float stays in L1 for its
// second pass.
constexpr int64_t kBlock = 4096;
// Column tiles: up to 256 columns (256 accumulators stay in L1). The
// one-pass kinds take kBlock rows per tile; var/std re-read their tile, so
// it holds at most 16384 values (64 KiB of float, in L2), at least 16 rows.
constexpr int64_t kTileColumns = 256;
constexpr int64_t kTileElements = 16384;
constexpr int64_t kMinTileRows = 16;
// Below ~32K values per thread the fork/join costs more than it saves.
constexpr int64_t kGrainElements = 32768;

// n contiguous values to the accumulation type, 8 per instruction where the
// build enables AVX2/F16C: bf16 is the top half of a float (widen, shift),
// fp16 has its own conversion instruction.
template <typename scalar_t, typename acc_t>
inline void convert(const scalar_t* src, acc_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::memcpy(dst, src, n * sizeof(acc_t));
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i));
      const __m256i words = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(words));
    }
#endif
    for (; i < n; ++i) {
      const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(dst + i, &word, sizeof(word));
    }
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<acc_t, float>) {
      for (; i + 8 <= n; i += 8) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
      }
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
  }
}

// 8 contiguous values as a float vector, converted in registers.
template <typename scalar_t>
inline typename Vec<float>::type load8(const scalar_t* p) {
  typename Vec<float>::type v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec<float>::load(p);
#if defined(__AVX2__)
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    std::memcpy(&v, &f, sizeof(v));
#endif
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &f, sizeof(v));
#endif
  } else {
    for (int l = 0; l < 8; ++l) v[l] = static_cast<float>(p[l]);
  }
  return v;
}

struct BlockResult {
  double a = 0;  // sum, sum of squares, or mean
  double b = 0;  // M2 (Moments only)
};

template <typename acc_t>
bool block_in_acc(Partial partial, const acc_t* x, int64_t n, BlockResult& out) {
  if (partial == Partial::Sum) {
    const acc_t s = lane_sum(x, n);
    out.a = static_cast<double>(s);
    return std::isfinite(s);
  }
  if (partial == Partial::SumSq) {
    const acc_t s = lane_sum<true>(x, n);
    out.a = static_cast<double>(s);
    return std::isfinite(s);
  }
  // Shift by the first value, then centre again (corrected two-pass):
  // constant data gives M2 exactly 0 however large the values are.
  acc_t sum_d, sum_d2;
  lane_centered_sums(x, n, x[0], sum_d, sum_d2);
  const acc_t center = x[0] + sum_d / static_cast<acc_t>(n);
  lane_centered_sums(x, n, center, sum_d, sum_d2);
  const acc_t mean = center + sum_d / static_cast<acc_t>(n);
  const acc_t m2 = std::max(sum_d2 - sum_d * (sum_d / static_cast<acc_t>(n)), acc_t(0));
  out.a = static_cast<double>(mean);
  out.b = static_cast<double>(m2);
  return std::isfinite(mean) && std::isfinite(m2);
}

// Reduce a block held in `buffer` (n > 0; the buffer may be rescaled in
// place). Non-finite input stays non-finite, as in torch.
template <typename acc_t>
BlockResult reduce_buffer(Partial partial, acc_t* buffer, int64_t n) {
  BlockResult result;
  if (block_in_acc(partial, buffer, n, result)) return result;
  acc_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(buffer[i]));
  if (!std::isfinite(largest)) return result;  // inf/nan in the data itself
  int exponent = 0;
  std::frexp(largest, &exponent);  // largest = f * 2^exponent, f in [0.5, 1)
  const acc_t scale = std::ldexp(acc_t(1), -exponent);
  for (int64_t i = 0; i < n; ++i) buffer[i] *= scale;
  block_in_acc(partial, buffer, n, result);
  // Back up in double: sums scale by 2^e, squares and M2 by 2^2e.
  if (partial == Partial::Moments) {
    result.a = std::ldexp(result.a, exponent);
    result.b = std::ldexp(result.b, 2 * exponent);
  } else {
    result.a = std::ldexp(result.a, partial == Partial::Sum ? exponent : 2 * exponent);
  }
  return result;
}

// Combines block results of one output in order and writes the output.
struct Accumulator {
  Moments moments;  // the count of values always; mean and M2 for Partial::Moments
  double sum = 0;   // Partial::Sum / SumSq

  void add(Partial partial, double n, const BlockResult& r) {
    if (partial == Partial::Moments) {
      moments.merge(n, r.a, r.b);
      return;
    }
    sum += r.a;
    moments.count += n;
  }

  double finish(Kind kind, double correction) const {
    const double count = moments.count;
    switch (kind) {
      case Kind::Sum:
        return sum;
      case Kind::Mean:
        return count > 0 ? sum / count : std::numeric_limits<double>::quiet_NaN();
      case Kind::Norm:
        return std::sqrt(sum);
      default: {
        if (count == 0) return std::numeric_limits<double>::quiet_NaN();
        // torch divides by max(0, n - correction): M2 / 0 is inf, 0 / 0 nan.
        const double dof = std::max(0.0, count - correction);  // any real correction, as torch takes
        const double var = moments.m2 / dof;
        return kind == Kind::Var ? var : std::sqrt(var);
      }
    }
  }
};

template <typename out_t>
inline out_t narrow(double value) {
  if constexpr (std::is_same_v<out_t, double>) {
    return value;
  } else {
    return static_cast<out_t>(static_cast<float>(value));
  }
}

// One task per (output, block of the reduced range), each block copied into
// an L1 buffer (sequential when the reduced stride is 1).
template <typename scalar_t, typename acc_t>
void reduce_rows(const scalar_t* x, const Groups& g, Partial partial, std::vector<BlockResult>& parts,
                 int64_t& blocks, int64_t& block_rows) {
  block_rows = kBlock;
  const int64_t R = g.reduced, rs = g.reduced_stride;
  blocks = (R + kBlock - 1) / kBlock;
  const int64_t outputs = g.outer * g.inner;
  parts.resize(outputs * blocks);
  const int64_t block_len = std::min(R, kBlock);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_len);
  at::parallel_for(0, outputs * blocks, grain, [&](int64_t begin, int64_t end) {
    acc_t buffer[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task / blocks, j = task % blocks;
      const int64_t o = p / g.inner, i = p % g.inner;
      const int64_t first = j * kBlock, n = std::min(kBlock, R - first);
      const scalar_t* src = x + o * g.outer_stride + i * g.inner_stride + first * rs;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        // Already in the accumulation type: reduce in place, copy only for
        // the (rare) rescaled retry.
        if (rs == 1 && block_in_acc(partial, src, n, parts[task])) continue;
      } else {
        // One-pass kinds convert in registers; the rescue (and the two-pass
        // moments) work on the L1 buffer.
        if (rs == 1 && partial != Partial::Moments) {
          // Straight from memory: one pass, no block buffer.
          const auto load = [](const scalar_t* p) { return load8(p); };
          const float total = partial == Partial::Sum ? lane_sum<false, float>(src, n, load)
                                                      : lane_sum<true, float>(src, n, load);
          parts[task].a = total;
          if (std::isfinite(total)) continue;
        }
      }
      if (rs == 1) {
        convert(src, buffer, n);
      } else {
        for (int64_t r = 0; r < n; ++r) buffer[r] = static_cast<acc_t>(src[r * rs]);
      }
      parts[task] = reduce_buffer(partial, buffer, n);
    }
  });
}

// One row block of a column tile: accumulators per column. With unit column
// stride each row is first converted into `row_buffer`, so both loops are
// plain unit-stride float loops the compiler vectorises.
template <typename scalar_t, typename acc_t, bool unit>
void tile_block(const scalar_t* base, int64_t row_stride, int64_t column_stride, int64_t rows, int64_t width,
                Partial partial, acc_t* acc, acc_t* sum_d, acc_t* sum_d2, acc_t* row_buffer) {
  auto load_row = [&](int64_t r) -> const acc_t* {
    const scalar_t* row = base + r * row_stride;
    if constexpr (unit && std::is_same_v<scalar_t, acc_t>) {
      return row;
    } else if constexpr (unit) {
      convert(row, row_buffer, width);
    } else {
      for (int64_t c = 0; c < width; ++c) row_buffer[c] = static_cast<acc_t>(row[c * column_stride]);
    }
    return row_buffer;
  };
  std::fill(acc, acc + width, acc_t(0));
  if (partial == Partial::Moments) {
    // Centers: the first row plus the mean of the differences from it (so
    // constant columns get M2 exactly 0), in sum_d2 as scratch.
    const acc_t* first = load_row(0);
    std::copy(first, first + width, sum_d2);
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* v = load_row(r);
      for (int64_t c = 0; c < width; ++c) acc[c] += v[c] - sum_d2[c];
    }
    const acc_t n = static_cast<acc_t>(rows);
    for (int64_t c = 0; c < width; ++c) acc[c] = sum_d2[c] + acc[c] / n;
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* v = load_row(r);
      if (partial == Partial::SumSq) {
        for (int64_t c = 0; c < width; ++c) acc[c] += v[c] * v[c];
      } else {
        for (int64_t c = 0; c < width; ++c) acc[c] += v[c];
      }
    }
    return;
  }
  std::fill(sum_d, sum_d + width, acc_t(0));
  std::fill(sum_d2, sum_d2 + width, acc_t(0));
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* v = load_row(r);
    for (int64_t c = 0; c < width; ++c) {
      const acc_t d = v[c] - acc[c];
      sum_d[c] += d;
      sum_d2[c] += d * d;
    }
  }
}

// Reduced stride != 1: tasks are (group, column tile, row block).
template <typename scalar_t, typename acc_t>
void reduce_columns(const scalar_t* x, const Groups& g, Partial partial, std::vector<BlockResult>& parts,
                    int64_t& blocks, int64_t& block_rows) {
  // Columns are the outputs adjacent in memory: the inner index, or the
  // outer one when there is no inner index.
  const bool columns_inner = g.inner > 1;
  const int64_t columns = columns_inner ? g.inner : g.outer;
  const int64_t column_stride = columns_inner ? g.inner_stride : g.outer_stride;
  const int64_t groups = columns_inner ? g.outer : 1;
  const int64_t group_stride = columns_inner ? g.outer_stride : 0;
  const int64_t R = g.reduced;
  const int64_t tile_width = std::min(columns, kTileColumns);
  const int64_t tiles = (columns + tile_width - 1) / tile_width;
  // One pass (sum, squares): a whole block of rows per task. Two passes
  // (moments): a tile small enough to be re-read from L2.
  const int64_t tile_rows =
      partial == Partial::Moments ? std::max(kMinTileRows, kTileElements / tile_width) : kBlock;
  blocks = (R + tile_rows - 1) / tile_rows;
  block_rows = tile_rows;
  parts.resize(groups * columns * blocks);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (tile_width * std::min(R, tile_rows)));

  at::parallel_for(0, groups * tiles * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(tile_width), sum_d(tile_width), sum_d2(tile_width), row(tile_width), column(tile_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task % blocks;
      const int64_t t = (task / blocks) % tiles;
      const int64_t grp = task / (blocks * tiles);
      const int64_t r0 = j * tile_rows, rows = std::min(tile_rows, R - r0);
      const int64_t c0 = t * tile_width, width = std::min(tile_width, columns - c0);
      const scalar_t* base = x + grp * group_stride + c0 * column_stride + r0 * g.reduced_stride;
      if (column_stride == 1) {
        tile_block<scalar_t, acc_t, true>(base, g.reduced_stride, 1, rows, width, partial, acc.data(), sum_d.data(),
                                          sum_d2.data(), row.data());
      } else {
        tile_block<scalar_t, acc_t, false>(base, g.reduced_stride, column_stride, rows, width, partial, acc.data(),
                                           sum_d.data(), sum_d2.data(), row.data());
      }
      const acc_t n = static_cast<acc_t>(rows);
      for (int64_t c = 0; c < width; ++c) {
        BlockResult r;
        bool finite;
        if (partial == Partial::Moments) {
          const acc_t mean = acc[c] + sum_d[c] / n;
          const acc_t m2 = std::max(sum_d2[c] - sum_d[c] * (sum_d[c] / n), acc_t(0));
          r.a = mean;
          r.b = m2;
          finite = std::isfinite(mean) && std::isfinite(m2);
        } else {
          r.a = acc[c];
          finite = std::isfinite(acc[c]);
        }
        if (!finite) {  // the rescue path: gather the column, rescale
          const scalar_t* src = base + c * column_stride;
          for (int64_t k = 0; k < rows; ++k) column[k] = static_cast<acc_t>(src[k * g.reduced_stride]);
          r = reduce_buffer(partial, column.data(), rows);
        }
        parts[((grp * columns) + c0 + c) * blocks + j] = r;
      }
    }
  });
}

template <typename scalar_t, typename acc_t, typename out_t>
void reduce_kernel(const scalar_t* x, const Groups& g, Kind kind, double correction, out_t* out) {
  const Partial partial = partial_of(kind);
  const int64_t outputs = g.outer * g.inner;
  if (g.reduced == 0) {
    const Accumulator empty;
    std::fill(out, out + outputs, narrow<out_t>(empty.finish(kind, correction)));
    return;
  }
  std::vector<BlockResult> parts;
  int64_t blocks = 0, block_rows = 0;
  const bool rows = g.reduced_stride == 1 || g.reduced == 1 || (g.inner == 1 && g.outer == 1);
  if (rows) {
    // Unit reduced stride, or a single output / a single value per output
    // (gathered with the reduced stride into the same blocks).
    reduce_rows<scalar_t, acc_t>(x, g, partial, parts, blocks, block_rows);
  } else {
    reduce_columns<scalar_t, acc_t>(x, g, partial, parts, blocks, block_rows);
  }
  // Output p = o * inner + i. The column path stored its parts by
  // (group, column), which is the same order.
  at::parallel_for(0, outputs, 256, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      Accumulator total;
      for (int64_t j = 0; j < blocks; ++j) {
        const double n = static_cast<double>(std::min(block_rows, g.reduced - j * block_rows));
        total.add(partial, n, parts[p * blocks + j]);
      }
      out[p] = narrow<out_t>(total.finish(kind, correction));
    }
  });
}

// The reduction of the (outer, reduced, inner) view x over dim 1 into the
// contiguous (outer, inner) out, whose dtype is the result's.
void reduce_into(const at::Tensor& x, const at::Tensor& out, Kind kind, double correction) {
  const at::ScalarType out_type = out.scalar_type();
  TORCH_CHECK_TYPE(is_floating_type(out_type), "reduce: dtype must be float16, bfloat16, float32 or float64, got ",
                   out_type);
  const Groups g{x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), x.stride(2)};
  if (out.numel() == 0) return;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "reduce_cpu", [&] {
    using in_t = scalar_t;
    using acc_t = accumulation_t<in_t>;
    const in_t* data = x.const_data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_type, "reduce_cpu_out", [&] {
      reduce_kernel<in_t, acc_t, scalar_t>(data, g, kind, correction, out.mutable_data_ptr<scalar_t>());
    });
  });
}

// x as the (outer, reduced, inner) strided tensor whose reduction over dim 1,
// laid out (outer, inner), is the reduction over dims (sorted, distinct) in
// the order of the kept dims: a view where the dims are a run and each group
// merges, else one input-sized copy with the reduced dims moved last. A full
// reduction of a dense tensor reads it in memory order (contract.as_three).
at::Tensor as_three(const at::Tensor& x, at::IntArrayRef dims) {
  const int64_t rank = x.dim();
  if (static_cast<int64_t>(dims.size()) == rank) {
    if (x.is_contiguous() || (x.numel() > 0 && is_dense(x))) {
      return x.as_strided({1, x.numel(), 1}, {0, 1, 0}, x.storage_offset());
    }
    return x.contiguous().view({1, x.numel(), 1});
  }
  const int64_t first = dims.empty() ? rank : dims.front();
  const int64_t last = dims.empty() ? rank : dims.back() + 1;
  at::Tensor t = x;
  std::optional<Groups> g;
  if (last - first == static_cast<int64_t>(dims.size())) g = three_groups(x, first, last);
  if (!g) {
    std::vector<int64_t> order;
    for (int64_t d = 0; d < rank; ++d) {
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) order.push_back(d);
    }
    const int64_t kept = static_cast<int64_t>(order.size());
    order.insert(order.end(), dims.begin(), dims.end());
    t = x.permute(order).contiguous();
    g = three_groups(t, kept, rank);
  }
  return t.as_strided({g->outer, g->reduced, g->inner}, {g->outer_stride, g->reduced_stride, g->inner_stride},
                      t.storage_offset());
}

// effilayers::reduce: the reduction of x over dims (sorted, distinct; the
// Python functions normalise torch's dim arguments) as a new contiguous
// tensor of dtype (None: x's).
at::Tensor reduce_cpu(const at::Tensor& x, at::IntArrayRef dims, const std::string& kind_name, double correction,
                      bool keepdim, std::optional<at::ScalarType> dtype) {
  check_floating_input(x, "reduce");
  TORCH_CHECK(x.device().is_cpu(), "reduce (cpu kernel): x must be a CPU tensor, got ", x.device());
  const Kind kind = parse_kind(kind_name);
  const int64_t rank = x.dim();
  for (size_t i = 0; i < dims.size(); ++i) {
    TORCH_CHECK_VALUE(dims[i] >= 0 && dims[i] < std::max<int64_t>(rank, 1) && (i == 0 || dims[i - 1] < dims[i]),
                      "reduce: dims must be distinct dims of x in increasing order, got ", dims, " for a ", rank,
                      "-dimensional x");
  }
  const at::Tensor three = as_three(x, rank == 0 ? at::IntArrayRef() : dims);
  at::Tensor out = at::empty({three.size(0), three.size(2)}, x.options().dtype(dtype.value_or(x.scalar_type())));
  reduce_into(three, out, kind, correction);
  std::vector<int64_t> shape;
  for (int64_t d = 0; d < rank; ++d) {
    const bool reduced = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!reduced) {
      shape.push_back(x.size(d));
    } else if (keepdim) {
      shape.push_back(1);
    }
  }
  return out.view(shape);
}

}  // namespace
}  // namespace effilayers

// The op is declared once, in Python (effilayers/ops/reductions/op.py); this
// library only gives it its CPU kernel.
TORCH_LIBRARY_IMPL(effilayers, CPU, m) { m.impl("reduce", &effilayers::reduce_cpu); }
