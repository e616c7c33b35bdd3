// Softmax, log-softmax and scaled/masked softmax on CPU:
//   the CPU kernels of effilayers::softmax_forward, softmax_backward, scaled_masked_softmax_forward.
//
// The tensor is walked as (outer, reduced, inner) problems, the same merge
// of dimensions as effilayers/_core/layout.py (cpu/layout.h): each group of
// dimensions collapses to one strided index where its strides nest. When one
// does not, the kernel copies the tensor to contiguous first (the one case
// that costs an input-sized buffer); the output then is contiguous too.
//
// Work items are one row (inner == 1) or a block of up to kInnerBlock
// neighbouring rows (inner > 1, e.g. dim=1 of NCHW), fixed by the shape, so
// results do not depend on the thread count. A work item converts its rows
// into a per-thread accumulation buffer (float32 for float16/bfloat16/float32,
// float64 when input or output is float64) - reading the strided input in
// place, a block of rows together so neighbouring columns share cache lines
// - then runs max / exp-and-sum / scale on the contiguous buffer with vector
// code (float: vec_math.h's exp_vec), and converts on the way out. Rows that
// already are unit-stride float32 (float64) in and out skip the buffer.
// The buffer holds at most kScratchElements values whatever the shape: rows
// longer than that are walked in blocks of the reduced range, twice (an
// online max / rescaled sum, then the output), so the extra memory is
// O(threads * kScratchElements) (4 MiB of float per buffer), never input-sized.
//
// Rows of all -inf (fully masked) give 0 (log: -inf) and zero gradient,
// not NaN; a NaN or +inf in a row makes the row NaN.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "cpu/layout.h"
#include "cpu/vec.h"
#include "cpu/vec_math.h"

namespace effilayers {
namespace {

// Up to 16 rows per work item when inner > 1: with unit inner stride, one
// 64-byte line of fp32 serves all of them.
constexpr int64_t kInnerBlock = 16;  // (the float column path takes 8 * kMaxColumnGroups)
// Aim for ~32K elements per parallel chunk: less and the fork/join dominates.
constexpr int64_t kChunkElements = 32768;
// Largest buffer a work item fills, in accumulation values (4 MiB of float;
// backward fills two): rows that fit are converted once and reduced from the
// buffer, reading the input once - rows of up to 1,048,576 values, or 16
// neighbouring rows (inner > 1) of up to 65,536. Longer rows are walked in
// blocks of the reduced range (softmax_blocked), reading the input and
// evaluating exp twice: measured on one thread (thread CPU time), 4x1e6 fp16
// rows over dim 1 go from ~6 to ~13 ms and 100000x64 fp16 over dim 0 from
// ~30 to ~63 ms when blocked, so the threshold is set high; what it buys is a
// bound: a whole-row buffer of a 1e8-value row would be 400 MB per thread.
constexpr int64_t kScratchElements = 1 << 20;
// Most rows a work item buffers at once (kInnerBlock, or the float column
// path's remainder of fewer than 8): the per-row running values of the
// blocked path live on the stack.
constexpr int64_t kMaxBufferedRows = 16;
static_assert(kInnerBlock <= kMaxBufferedRows && 8 <= kMaxBufferedRows, "rows a work item buffers");

// The tensor and its groups, copying to contiguous when they do not merge.
std::pair<at::Tensor, Groups> readable(const at::Tensor& t, int64_t dim) {
  if (auto g = three_groups(t, dim, dim + 1)) return {t, *g};
  at::Tensor copy = t.contiguous();
  return {copy, *three_groups(copy, dim, dim + 1)};
}

// The output every kernel of this family allocates, and the fake kernels
// describe (ops/softmax.py output_like): t's strides when the dims around
// `dim` merge (empty_like keeps a dense t's permutation), else contiguous,
// even for a kernel that could read t in place: the layout must not depend
// on the backend, or a compiled graph's stride assertions fail.
at::Tensor output_like(const at::Tensor& t, int64_t dim, at::ScalarType dtype) {
  if (!three_groups(t, dim, dim + 1)) return at::empty(t.sizes(), t.options().dtype(dtype));
  return at::empty_like(t, t.options().dtype(dtype));
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t rank = std::max<int64_t>(ndim, 1);
  TORCH_CHECK_INDEX(dim >= -rank && dim < rank, op, ": dim ", dim, " is out of range for a tensor with ", ndim,
                    " dimensions");
  return dim < 0 ? dim + rank : dim;
}

// ---------------------------------------------------------------- conversion

template <typename scalar_t, typename acc_t>
void load_strided(const void* data, int64_t offset, int64_t stride, int64_t n, acc_t* dst) {
  const scalar_t* src = static_cast<const scalar_t*>(data) + offset;
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<acc_t>(src[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<acc_t>(src[k * stride]);
  }
}

template <typename scalar_t, typename acc_t>
void store_strided(void* data, int64_t offset, int64_t stride, int64_t n, const acc_t* src) {
  scalar_t* dst = static_cast<scalar_t*>(data) + offset;
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<scalar_t>(src[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) dst[k * stride] = static_cast<scalar_t>(src[k]);
  }
}

// `rows` neighbouring rows (inner_stride apart) at once, walking the reduced
// index outside and the rows inside: with a unit inner stride each step
// reads one run of consecutive elements. Row by row, the reduced stride
// (often a multiple of 4 KiB) would map every access of a row to the same
// L1 set and miss on each one. dst holds the rows back to back.
template <typename scalar_t, typename acc_t>
void load_rows(const void* data, int64_t offset, int64_t stride, int64_t n, int64_t rows, int64_t row_stride,
               acc_t* dst) {
  const scalar_t* src = static_cast<const scalar_t*>(data) + offset;
  for (int64_t k = 0; k < n; ++k) {
    const scalar_t* column = src + k * stride;
    for (int64_t r = 0; r < rows; ++r) dst[r * n + k] = static_cast<acc_t>(column[r * row_stride]);
  }
}

template <typename scalar_t, typename acc_t>
void store_rows(void* data, int64_t offset, int64_t stride, int64_t n, int64_t rows, int64_t row_stride,
                const acc_t* src) {
  scalar_t* dst = static_cast<scalar_t*>(data) + offset;
  for (int64_t k = 0; k < n; ++k) {
    scalar_t* column = dst + k * stride;
    for (int64_t r = 0; r < rows; ++r) column[r * row_stride] = static_cast<scalar_t>(src[r * n + k]);
  }
}

template <typename acc_t>
using Loader = void (*)(const void*, int64_t, int64_t, int64_t, acc_t*);
template <typename acc_t>
using Storer = void (*)(void*, int64_t, int64_t, int64_t, const acc_t*);
template <typename acc_t>
using RowsLoader = void (*)(const void*, int64_t, int64_t, int64_t, int64_t, int64_t, acc_t*);
template <typename acc_t>
using RowsStorer = void (*)(void*, int64_t, int64_t, int64_t, int64_t, int64_t, const acc_t*);

// The strided access pair (one row, a block of rows) for one dtype.
template <typename acc_t>
struct Reader {
  Loader<acc_t> row;
  RowsLoader<acc_t> rows;
  // Rows r = 0..count-1 of the work item at `offset`, each `n` long.
  void operator()(const void* data, int64_t offset, int64_t stride, int64_t n, int64_t count, int64_t row_stride,
                  acc_t* dst) const {
    if (count == 1) {
      row(data, offset, stride, n, dst);
    } else {
      rows(data, offset, stride, n, count, row_stride, dst);
    }
  }
};

template <typename acc_t>
struct Writer {
  Storer<acc_t> row;
  RowsStorer<acc_t> rows;
  void operator()(void* data, int64_t offset, int64_t stride, int64_t n, int64_t count, int64_t row_stride,
                  const acc_t* src) const {
    if (count == 1) {
      row(data, offset, stride, n, src);
    } else {
      rows(data, offset, stride, n, count, row_stride, src);
    }
  }
};

// The dtype is one the op checked (floating), so the dispatch never fails.
template <typename acc_t>
Reader<acc_t> reader_for(at::ScalarType t) {
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "softmax", [&]() -> Reader<acc_t> {
    return {&load_strided<scalar_t, acc_t>, &load_rows<scalar_t, acc_t>};
  });
}

template <typename acc_t>
Writer<acc_t> writer_for(at::ScalarType t) {
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "softmax", [&]() -> Writer<acc_t> {
    return {&store_strided<scalar_t, acc_t>, &store_rows<scalar_t, acc_t>};
  });
}

// ---------------------------------------------------------------- row math on a contiguous buffer

template <typename acc_t>
acc_t row_max(const acc_t* v, int64_t n) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  int64_t k = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    using V = Vec<float>;
    constexpr int W = V::kWidth;
    V::type a = V::type{} + m, b = a;
    for (; k + 2 * W <= n; k += 2 * W) {
      const auto x0 = V::load(v + k), x1 = V::load(v + k + W);
      a = x0 > a ? x0 : a;
      b = x1 > b ? x1 : b;
    }
    a = b > a ? b : a;
    for (int l = 0; l < W; ++l) m = a[l] > m ? a[l] : m;
  }
  for (; k < n; ++k) m = v[k] > m ? v[k] : m;
  return m;  // NaNs are skipped here; they reach the sum through exp
}

// The float vector body of a row sum: adds terms(k), the vector of the
// terms at k..k+7, over whole pairs of vectors from k on (two accumulators
// cover the add latency) and leaves k at the first term it did not add.
template <typename Terms>
float vector_sum(int64_t n, int64_t& k, Terms&& terms) {
  using V = Vec<float>;
  constexpr int W = V::kWidth;
  V::type s0 = {}, s1 = {};
  for (; k + 2 * W <= n; k += 2 * W) {
    s0 += terms(k);
    s1 += terms(k + W);
  }
  return V::sum(s0 + s1);
}

// dst[k] = exp(src[k] - shift) (dst may be src, or null to only sum);
// returns the sum of the exponentials.
template <typename acc_t>
acc_t exp_sum(const acc_t* src, acc_t* dst, int64_t n, acc_t shift) {
  acc_t total = 0;
  int64_t k = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    total = vector_sum(n, k, [&](int64_t i) {
      const VecF e = exp_vec(Vec<float>::load(src + i) - shift);
      if (dst) __builtin_memcpy(dst + i, &e, sizeof(e));
      return e;
    });
    for (; k < n; ++k) {  // the tail through the same exp as the body
      VecF one = {};
      one[0] = src[k] - shift;
      const acc_t e = exp_vec(one)[0];
      if (dst) dst[k] = e;
      total += e;
    }
  } else {
    for (; k < n; ++k) {
      const acc_t e = std::exp(src[k] - shift);
      if (dst) dst[k] = e;
      total += e;
    }
  }
  return total;
}

// One row: out may be x (the buffered paths) or a separate contiguous row.
template <typename acc_t>
void softmax_row(const acc_t* x, acc_t* out, int64_t n, bool log) {
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const acc_t m = row_max(x, n);
  const acc_t shift = m == -kInf ? acc_t(0) : m;  // all -inf: exp gives 0, not NaN
  const acc_t total = exp_sum(x, log ? nullptr : out, n, shift);
  if (log) {
    // (x - shift) - log(sum): subtracting the shift first keeps the digits
    // of values close to the maximum.
    if (total == 0) {
      std::fill(out, out + n, -kInf);
      return;
    }
    const acc_t log_total = std::log(total);
    for (int64_t k = 0; k < n; ++k) out[k] = (x[k] - shift) - log_total;
  } else {
    const acc_t inverse = total == 0 ? acc_t(0) : acc_t(1) / total;  // NaN total stays NaN
    for (int64_t k = 0; k < n; ++k) out[k] *= inverse;
  }
}

template <typename acc_t>
void softmax_in_place(acc_t* v, int64_t n, bool log) {
  softmax_row(v, v, n, log);
}

// The row sum the gradient needs: sum(g * y) (softmax) or sum(g) (log-softmax).
template <typename acc_t>
acc_t softmax_grad_total(const acc_t* g, const acc_t* y, int64_t n, bool log) {
  if (log) return lane_sum(g, n);
  acc_t dot = 0;
  int64_t k = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    dot = vector_sum(n, k, [&](int64_t i) { return Vec<float>::load(g + i) * Vec<float>::load(y + i); });
  }
  for (; k < n; ++k) dot += g[k] * y[k];
  return dot;
}

// out = scale * y * (g - total)  |  scale * (g - exp(y) * total); out may be g.
template <typename acc_t>
void softmax_grad_apply(const acc_t* g, const acc_t* y, acc_t* out, int64_t n, bool log, acc_t total, acc_t scale) {
  if (log) {
    int64_t k = 0;
    if constexpr (std::is_same_v<acc_t, float>) {
      using V = Vec<float>;
      constexpr int W = V::kWidth;
      for (; k + W <= n; k += W) {
        const auto r = (V::load(g + k) - exp_vec(V::load(y + k)) * total) * scale;
        __builtin_memcpy(out + k, &r, sizeof(r));
      }
    }
    for (; k < n; ++k) out[k] = (g[k] - std::exp(y[k]) * total) * scale;
  } else {
    for (int64_t k = 0; k < n; ++k) out[k] = scale * y[k] * (g[k] - total);
  }
}

template <typename acc_t>
void softmax_grad_row(const acc_t* g, const acc_t* y, acc_t* out, int64_t n, bool log, acc_t scale) {
  softmax_grad_apply(g, y, out, n, log, softmax_grad_total(g, y, n, log), scale);
}

template <typename acc_t>
bool is_acc_row(const at::Tensor& t, const Groups& g) {
  return t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value && (g.reduced_stride == 1 || g.reduced == 1);
}

// Neighbouring float rows whose elements are adjacent in memory (unit inner
// stride, e.g. softmax over C of NCHW): one vector lane per row, `groups`
// vectors of 8 rows side by side, the reduced index walking down with its
// stride. Each pass reads one run of 32 * groups bytes per reduced index,
// so every cache line is fetched once per pass; no buffer, no transpose.
constexpr int kMaxColumnGroups = 8;

inline VecF load8(const float* p) { return Vec<float>::load(p); }
inline void store8(float* p, VecF v) { __builtin_memcpy(p, &v, sizeof(v)); }

void softmax_columns(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t n, int groups,
                     bool log) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  VecF m[kMaxColumnGroups], total[kMaxColumnGroups];
  for (int j = 0; j < groups; ++j) {
    m[j] = VecF{} - kInf;
    total[j] = VecF{};
  }
  for (int64_t k = 0; k < n; ++k) {
    for (int j = 0; j < groups; ++j) {
      const VecF v = load8(x + k * x_stride + 8 * j);
      m[j] = v > m[j] ? v : m[j];
    }
  }
  for (int j = 0; j < groups; ++j) m[j] = m[j] == -kInf ? VecF{} : m[j];  // the shift
  for (int64_t k = 0; k < n; ++k) {
    for (int j = 0; j < groups; ++j) {
      const VecF e = exp_vec(load8(x + k * x_stride + 8 * j) - m[j]);
      if (!log) store8(out + k * out_stride + 8 * j, e);
      total[j] += e;
    }
  }
  if (log) {
    for (int j = 0; j < groups; ++j) {
      for (int l = 0; l < 8; ++l) total[j][l] = total[j][l] == 0 ? kInf : std::log(total[j][l]);
    }
    for (int64_t k = 0; k < n; ++k) {
      for (int j = 0; j < groups; ++j) {  // empty rows: -inf - inf = -inf
        store8(out + k * out_stride + 8 * j, (load8(x + k * x_stride + 8 * j) - m[j]) - total[j]);
      }
    }
  } else {
    for (int j = 0; j < groups; ++j) total[j] = total[j] == 0 ? VecF{} : 1.0f / total[j];
    for (int64_t k = 0; k < n; ++k) {
      for (int j = 0; j < groups; ++j) {
        float* p = out + k * out_stride + 8 * j;
        store8(p, load8(p) * total[j]);
      }
    }
  }
}

void softmax_grad_columns(const float* g, int64_t g_stride, const float* y, int64_t y_stride, float* out,
                          int64_t out_stride, int64_t n, int groups, bool log, float scale) {
  VecF total[kMaxColumnGroups];
  for (int j = 0; j < groups; ++j) total[j] = VecF{};
  for (int64_t k = 0; k < n; ++k) {
    for (int j = 0; j < groups; ++j) {
      const VecF gv = load8(g + k * g_stride + 8 * j);
      total[j] += log ? gv : gv * load8(y + k * y_stride + 8 * j);
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    for (int j = 0; j < groups; ++j) {
      const VecF gv = load8(g + k * g_stride + 8 * j), yv = load8(y + k * y_stride + 8 * j);
      const VecF r = log ? (gv - exp_vec(yv) * total[j]) * scale : yv * (gv - total[j]) * scale;
      store8(out + k * out_stride + 8 * j, r);
    }
  }
}

// The float column path's share of a work item of `rows` rows: when
// `enabled`, its whole groups of 8 rows, run as columns(groups). Returns how
// many rows that took; the rest go through a buffer.
template <typename acc_t, typename Columns>
int64_t column_rows(bool enabled, int64_t rows, Columns&& columns) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const int64_t done = enabled ? rows - rows % 8 : 0;
    if (done > 0) columns(static_cast<int>(done / 8));
    return done;
  } else {
    return 0;
  }
}

// Runs fn(o, i0, rows, scratch, capacity) for every work item: rows
// i0..i0+rows of outer index o. scratch holds `buffers` arrays of `capacity`
// values each: rows * reduced when that fits in kScratchElements (the rows are
// buffered whole), else kScratchElements (the blocked paths). Allocated once
// per parallel chunk, uninitialised, and never input-sized.
template <typename acc_t, typename Fn>
void for_each_block(const Groups& shape, int64_t buffers, int64_t block, Fn&& fn) {
  const int64_t rows_per_item = shape.inner == 1 ? 1 : std::min(block, shape.inner);
  const int64_t blocks = (shape.inner + rows_per_item - 1) / rows_per_item;
  const int64_t items = shape.outer * blocks;
  const int64_t grain = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, shape.reduced * rows_per_item));
  const int64_t capacity = std::min(kScratchElements, rows_per_item * shape.reduced);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<acc_t[]> scratch(buffers > 0 ? new acc_t[buffers * capacity] : nullptr);  // not zero-filled
    for (int64_t item = begin; item < end; ++item) {
      const int64_t o = item / blocks;
      const int64_t i0 = (item % blocks) * rows_per_item;
      fn(o, i0, std::min(rows_per_item, shape.inner - i0), scratch.get(), capacity);
    }
  });
}

// Strided rows to and from a buffer: `rows` rows of the tensor at `data` +
// `offset`, values `stride` apart, rows `row_stride` apart.
struct RowSet {
  int64_t offset, stride, row_stride;
  RowSet at(int64_t k0) const { return {offset + k0 * stride, stride, row_stride}; }
};

// Forward of `rows` rows of n values too long to buffer whole. Pass 1 reads
// them in blocks of the reduced range, keeping per row a running maximum and
// a sum of exponentials rescaled by exp(old - new) when the maximum grows;
// pass 2 reads each block again and writes exp(x - max) / sum (or
// x - max - log(sum)). The same exp_vec as the one-pass path, so the values
// differ from it only in the order of the sum.
template <typename acc_t>
void softmax_blocked(const Reader<acc_t>& load, const void* xp, RowSet x, const Writer<acc_t>& store, void* op,
                     RowSet out, int64_t n, int64_t rows, bool log, acc_t* buffer) {
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  TORCH_INTERNAL_ASSERT(rows <= kMaxBufferedRows);
  const int64_t block = kScratchElements / rows;
  // shift: the running maximum, or 0 while it is -inf (exp(-inf - 0) is 0,
  // where -inf - -inf would be NaN); total: sum of exp(x - shift) so far. A
  // NaN (skipped by row_max) reaches total through exp, as in softmax_row.
  acc_t shift[kMaxBufferedRows], total[kMaxBufferedRows];
  for (int64_t r = 0; r < rows; ++r) {
    shift[r] = 0;
    total[r] = 0;
  }
  bool finite_max[kMaxBufferedRows] = {};
  for (int64_t k0 = 0; k0 < n; k0 += block) {
    const int64_t len = std::min(block, n - k0);
    load(xp, x.at(k0).offset, x.stride, len, rows, x.row_stride, buffer);
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* v = buffer + r * len;
      const acc_t block_max = row_max(v, len);
      if (block_max != -kInf && (!finite_max[r] || block_max > shift[r])) {
        // The maximum grew: rescale what was summed. Before the first finite
        // maximum the sum holds only 0 (-inf values) or NaN, and shift is the
        // placeholder 0, so there is nothing to rescale; exp(0 - block_max)
        // would overflow to inf for a block_max below about -88 (float) and
        // make 0 * inf = NaN.
        if (finite_max[r]) total[r] *= std::exp(shift[r] - block_max);
        shift[r] = block_max;
        finite_max[r] = true;
      }
      total[r] += exp_sum(v, static_cast<acc_t*>(nullptr), len, shift[r]);
    }
  }
  for (int64_t k0 = 0; k0 < n; k0 += block) {
    const int64_t len = std::min(block, n - k0);
    load(xp, x.at(k0).offset, x.stride, len, rows, x.row_stride, buffer);
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* v = buffer + r * len;
      if (log) {
        // As softmax_row: (x - shift) - log(sum), -inf for an empty row.
        const acc_t log_total = total[r] == 0 ? kInf : std::log(total[r]);
        for (int64_t k = 0; k < len; ++k) v[k] = (v[k] - shift[r]) - log_total;
      } else {
        exp_sum(v, v, len, shift[r]);
        const acc_t inverse = total[r] == 0 ? acc_t(0) : acc_t(1) / total[r];  // NaN total stays NaN
        for (int64_t k = 0; k < len; ++k) v[k] *= inverse;
      }
    }
    store(op, out.at(k0).offset, out.stride, len, rows, out.row_stride, buffer);
  }
}

// Backward of rows too long to buffer whole: the row sums over blocks, then
// the gradient block by block (two reads of grad and output).
template <typename acc_t>
void softmax_grad_blocked(const Reader<acc_t>& load_grad, const void* gp, RowSet g, const Reader<acc_t>& load_y,
                          const void* yp, RowSet y, const Writer<acc_t>& store, void* op, RowSet out, int64_t n,
                          int64_t rows, bool log, acc_t scale, acc_t* gbuf, acc_t* ybuf) {
  TORCH_INTERNAL_ASSERT(rows <= kMaxBufferedRows);
  const int64_t block = kScratchElements / rows;
  acc_t total[kMaxBufferedRows] = {};
  for (int64_t k0 = 0; k0 < n; k0 += block) {
    const int64_t len = std::min(block, n - k0);
    load_grad(gp, g.at(k0).offset, g.stride, len, rows, g.row_stride, gbuf);
    if (!log) load_y(yp, y.at(k0).offset, y.stride, len, rows, y.row_stride, ybuf);
    for (int64_t r = 0; r < rows; ++r) total[r] += softmax_grad_total(gbuf + r * len, ybuf + r * len, len, log);
  }
  for (int64_t k0 = 0; k0 < n; k0 += block) {
    const int64_t len = std::min(block, n - k0);
    load_grad(gp, g.at(k0).offset, g.stride, len, rows, g.row_stride, gbuf);
    load_y(yp, y.at(k0).offset, y.stride, len, rows, y.row_stride, ybuf);
    for (int64_t r = 0; r < rows; ++r) {
      softmax_grad_apply(gbuf + r * len, ybuf + r * len, gbuf + r * len, len, log, total[r], scale);
    }
    store(op, out.at(k0).offset, out.stride, len, rows, out.row_stride, gbuf);
  }
}

template <typename acc_t>
void softmax_forward_impl(const at::Tensor& x, const Groups& xg, at::Tensor& out, const Groups& og, bool log) {
  const Reader<acc_t> load = reader_for<acc_t>(x.scalar_type());
  const Writer<acc_t> store = writer_for<acc_t>(out.scalar_type());
  const void* xp = x.const_data_ptr();
  void* op = out.mutable_data_ptr();
  const int64_t n = xg.reduced;
  // Rows of the accumulation type with unit stride, in and out: no buffer.
  const bool direct = xg.inner == 1 && is_acc_row<acc_t>(x, xg) && is_acc_row<acc_t>(out, og);
  // Rows side by side in memory (unit inner stride), float in and out: by columns of 8.
  const bool columns = xg.inner > 1 && xg.inner_stride == 1 && og.inner_stride == 1 &&
                       x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat;
  const int64_t block = columns ? 8 * kMaxColumnGroups : kInnerBlock;
  for_each_block<acc_t>(xg, direct ? 0 : 1, block, [&](int64_t o, int64_t i0, int64_t rows, acc_t* buffer,
                                                       int64_t /*capacity*/) {
    if (direct) {
      softmax_row(x.const_data_ptr<acc_t>() + o * xg.outer_stride, out.mutable_data_ptr<acc_t>() + o * og.outer_stride,
                  n, log);
      return;
    }
    const int64_t done = column_rows<acc_t>(columns, rows, [&](int groups) {
      softmax_columns(x.const_data_ptr<float>() + o * xg.outer_stride + i0, xg.reduced_stride,
                      out.mutable_data_ptr<float>() + o * og.outer_stride + i0, og.reduced_stride, n, groups, log);
    });
    const int64_t left = rows - done, first = i0 + done;
    if (left == 0) return;
    const RowSet in{o * xg.outer_stride + first * xg.inner_stride, xg.reduced_stride, xg.inner_stride};
    const RowSet to{o * og.outer_stride + first * og.inner_stride, og.reduced_stride, og.inner_stride};
    if (left * n > kScratchElements) {
      softmax_blocked(load, xp, in, store, op, to, n, left, log, buffer);
      return;
    }
    load(xp, in.offset, in.stride, n, left, in.row_stride, buffer);
    for (int64_t r = 0; r < left; ++r) softmax_in_place(buffer + r * n, n, log);
    store(op, to.offset, to.stride, n, left, to.row_stride, buffer);
  });
}

at::Tensor softmax_forward_cpu(const at::Tensor& x_arg, int64_t dim, bool log, std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "softmax_forward";
  check_floating_input(x_arg, op);
  TORCH_CHECK(x_arg.device().is_cpu(), op, " (cpu kernel): x must be a CPU tensor, got ", x_arg.device());
  const at::ScalarType out_type = dtype.value_or(x_arg.scalar_type());
  TORCH_CHECK_TYPE(is_floating_type(out_type), op, ": dtype must be float16, bfloat16, float32 or float64, got ",
                   out_type);
  dim = wrap_dim(dim, x_arg.dim(), op);
  auto [x, xg] = readable(x_arg, dim);
  at::Tensor out = output_like(x_arg, dim, out_type);
  if (x.numel() == 0) return out;
  const Groups og = *three_groups(out, dim, dim + 1);
  if (x.scalar_type() == at::kDouble || out_type == at::kDouble) {
    softmax_forward_impl<double>(x, xg, out, og, log);
  } else {
    softmax_forward_impl<float>(x, xg, out, og, log);
  }
  return out;
}

template <typename acc_t>
void softmax_backward_impl(const at::Tensor& grad, const Groups& gg, const at::Tensor& y, const Groups& yg,
                           at::Tensor& out, const Groups& og, bool log, double scale) {
  const Reader<acc_t> load_grad = reader_for<acc_t>(grad.scalar_type());
  const Reader<acc_t> load_y = reader_for<acc_t>(y.scalar_type());
  const Writer<acc_t> store = writer_for<acc_t>(out.scalar_type());
  const void* gp = grad.const_data_ptr();
  const void* yp = y.const_data_ptr();
  void* op = out.mutable_data_ptr();
  const int64_t n = yg.reduced;
  const bool direct = yg.inner == 1 && is_acc_row<acc_t>(grad, gg) && is_acc_row<acc_t>(y, yg) &&
                      is_acc_row<acc_t>(out, og);
  const bool columns = yg.inner > 1 && gg.inner_stride == 1 && yg.inner_stride == 1 && og.inner_stride == 1 &&
                       grad.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                       out.scalar_type() == at::kFloat;
  const int64_t block = columns ? 8 * kMaxColumnGroups : kInnerBlock;
  for_each_block<acc_t>(yg, direct ? 0 : 2, block, [&](int64_t o, int64_t i0, int64_t rows, acc_t* scratch,
                                                       int64_t capacity) {
    if (direct) {
      softmax_grad_row(grad.const_data_ptr<acc_t>() + o * gg.outer_stride,
                       y.const_data_ptr<acc_t>() + o * yg.outer_stride,
                       out.mutable_data_ptr<acc_t>() + o * og.outer_stride, n, log, static_cast<acc_t>(scale));
      return;
    }
    const int64_t done = column_rows<acc_t>(columns, rows, [&](int groups) {
      softmax_grad_columns(grad.const_data_ptr<float>() + o * gg.outer_stride + i0, gg.reduced_stride,
                           y.const_data_ptr<float>() + o * yg.outer_stride + i0, yg.reduced_stride,
                           out.mutable_data_ptr<float>() + o * og.outer_stride + i0, og.reduced_stride, n, groups,
                           log, static_cast<float>(scale));
    });
    const int64_t left = rows - done, first = i0 + done;
    if (left == 0) return;
    acc_t* gbuf = scratch;
    acc_t* ybuf = scratch + capacity;
    const RowSet g_rows{o * gg.outer_stride + first * gg.inner_stride, gg.reduced_stride, gg.inner_stride};
    const RowSet y_rows{o * yg.outer_stride + first * yg.inner_stride, yg.reduced_stride, yg.inner_stride};
    const RowSet to{o * og.outer_stride + first * og.inner_stride, og.reduced_stride, og.inner_stride};
    if (left * n > kScratchElements) {
      softmax_grad_blocked(load_grad, gp, g_rows, load_y, yp, y_rows, store, op, to, n, left, log,
                           static_cast<acc_t>(scale), gbuf, ybuf);
      return;
    }
    load_grad(gp, g_rows.offset, g_rows.stride, n, left, g_rows.row_stride, gbuf);
    load_y(yp, y_rows.offset, y_rows.stride, n, left, y_rows.row_stride, ybuf);
    for (int64_t r = 0; r < left; ++r) {
      softmax_grad_row(gbuf + r * n, ybuf + r * n, gbuf + r * n, n, log, static_cast<acc_t>(scale));
    }
    store(op, to.offset, to.stride, n, left, to.row_stride, gbuf);
  });
}

at::Tensor softmax_backward_cpu(const at::Tensor& grad_arg, const at::Tensor& output_arg, int64_t dim, bool log,
                                double scale, at::ScalarType input_dtype) {
  constexpr const char* op = "softmax_backward";
  check_floating_input(grad_arg, op);
  check_floating_input(output_arg, op);
  TORCH_CHECK_TYPE(is_floating_type(input_dtype), op, ": input_dtype must be floating, got ", input_dtype);
  TORCH_CHECK_VALUE(grad_arg.sizes() == output_arg.sizes(), op, ": grad has shape ", grad_arg.sizes(),
                    ", output ", output_arg.sizes());
  TORCH_CHECK(output_arg.device().is_cpu() && grad_arg.device().is_cpu(), op,
              " (cpu kernel): grad and output must be CPU tensors");
  dim = wrap_dim(dim, output_arg.dim(), op);
  auto [y, yg] = readable(output_arg, dim);
  auto [grad, gg] = readable(grad_arg, dim);
  at::Tensor out = output_like(output_arg, dim, input_dtype);
  if (y.numel() == 0) return out;
  const Groups og = *three_groups(out, dim, dim + 1);
  const bool wide = grad.scalar_type() == at::kDouble || y.scalar_type() == at::kDouble || input_dtype == at::kDouble;
  if (wide) {
    softmax_backward_impl<double>(grad, gg, y, yg, out, og, log, scale);
  } else {
    softmax_backward_impl<float>(grad, gg, y, yg, out, og, log, scale);
  }
  return out;
}

// ---------------------------------------------------------------- scaled / masked softmax over the last dim

template <typename acc_t>
void scaled_masked_impl(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                        const std::vector<int64_t>& mask_strides, double scale, bool causal, at::Tensor& out) {
  const int64_t nd = x.dim();
  const int64_t cols = x.size(nd - 1);
  const int64_t rows = x.numel() / cols;
  const int64_t causal_rows = nd >= 2 ? x.size(nd - 2) : 1;
  const Loader<acc_t> load = reader_for<acc_t>(x.scalar_type()).row;
  const Storer<acc_t> store = writer_for<acc_t>(out.scalar_type()).row;
  const void* xp = x.const_data_ptr();
  void* op = out.mutable_data_ptr();
  const bool bool_mask = mask.has_value() && mask->scalar_type() == at::kBool;
  const bool* mask_bool = bool_mask ? mask->const_data_ptr<bool>() : nullptr;
  const void* mask_data = mask.has_value() && !bool_mask ? mask->const_data_ptr() : nullptr;
  const Loader<acc_t> load_mask = mask_data ? reader_for<acc_t>(mask->scalar_type()).row : nullptr;
  const int64_t mask_col_stride = mask.has_value() ? mask_strides[nd - 1] : 0;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const acc_t scale_acc = static_cast<acc_t>(scale);
  const int64_t grain = std::max<int64_t>(1, kChunkElements / cols);

  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> z(cols), added(mask_data ? cols : 0);
    for (int64_t row = begin; row < end; ++row) {
      // Offsets of this row in each tensor, from its index over dims [0, nd-1).
      int64_t x_off = 0, out_off = 0, mask_off = 0, rest = row;
      for (int64_t d = nd - 2; d >= 0; --d) {
        const int64_t idx = rest % x.size(d);
        rest /= x.size(d);
        x_off += idx * x.stride(d);
        out_off += idx * out.stride(d);
        if (mask.has_value()) mask_off += idx * mask_strides[d];
      }
      load(xp, x_off, x.stride(nd - 1), cols, z.data());
      for (int64_t k = 0; k < cols; ++k) z[k] *= scale_acc;
      if (bool_mask) {
        const bool* m = mask_bool + mask_off;
        for (int64_t k = 0; k < cols; ++k) {
          if (!m[k * mask_col_stride]) z[k] = kNegInf;
        }
      } else if (mask_data) {
        load_mask(mask_data, mask_off, mask_col_stride, cols, added.data());
        for (int64_t k = 0; k < cols; ++k) z[k] += added[k];
      }
      if (causal) {
        const int64_t keep = row % causal_rows + 1;  // columns 0..i of row i
        for (int64_t k = keep; k < cols; ++k) z[k] = kNegInf;
      }
      softmax_in_place(z.data(), cols, false);
      store(op, out_off, out.stride(nd - 1), cols, z.data());
    }
  });
}

at::Tensor scaled_masked_softmax_forward_cpu(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                                             double scale, bool causal) {
  constexpr const char* op = "scaled_masked_softmax_forward";
  check_floating_input(x, op);
  TORCH_CHECK(x.device().is_cpu(), op, " (cpu kernel): x must be a CPU tensor, got ", x.device());
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(!causal || x.dim() >= 2, op, ": causal=True needs x with at least 2 dimensions");
  const int64_t nd = x.dim();
  std::vector<int64_t> mask_strides(nd, 0);
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK_TYPE(m.scalar_type() == at::kBool || is_floating_type(m.scalar_type()), op,
                     ": mask dtype must be bool or floating, got ", m.scalar_type());
    TORCH_CHECK_VALUE(m.device() == x.device(), op, ": mask is on ", m.device(), " but x is on ", x.device());
    TORCH_CHECK_VALUE(m.dim() <= nd, op, ": mask of shape ", m.sizes(), " does not broadcast to ", x.sizes());
    // Broadcast strides: 0 where the mask has size 1 (or lacks the dim).
    for (int64_t d = 0; d < m.dim(); ++d) {
      const int64_t xd = nd - m.dim() + d;
      TORCH_CHECK_VALUE(m.size(d) == 1 || m.size(d) == x.size(xd), op, ": mask of shape ", m.sizes(),
                        " does not broadcast to ", x.sizes());
      mask_strides[xd] = m.size(d) == 1 ? 0 : m.stride(d);
    }
  }
  // x is read in place whatever its strides; the output still follows the family's rule.
  at::Tensor out = output_like(x, nd - 1, x.scalar_type());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kDouble) {
    scaled_masked_impl<double>(x, mask, mask_strides, scale, causal, out);
  } else {
    scaled_masked_impl<float>(x, mask, mask_strides, scale, causal, out);
  }
  return out;
}

}  // namespace
}  // namespace effilayers

// The ops are declared once, in Python (effilayers/ops/softmax/op.py); this
// library only gives them their CPU kernels.
TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  m.impl("softmax_forward", &effilayers::softmax_forward_cpu);
  m.impl("softmax_backward", &effilayers::softmax_backward_cpu);
  m.impl("scaled_masked_softmax_forward", &effilayers::scaled_masked_softmax_forward_cpu);
}
