// A tensor as (outer, reduced, inner) problems, the merge of dimensions of
// effilayers/_core/layout.py (three_groups), shared by the CPU kernels that
// take a whole tensor (softmax over one dim, the reductions over a run of
// dims): each group of dimensions collapses to one strided index where its
// strides nest; where one does not, the caller copies.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace effilayers {

struct Groups {
  int64_t outer = 1, reduced = 1, inner = 1;
  int64_t outer_stride = 1, reduced_stride = 1, inner_stride = 1;
};

// One index over dims [lo, hi) of t, or false when the strides do not nest.
// Size-1 dims are ignored, as in layout.py's merge_dims.
inline bool merge_dims(const at::Tensor& t, int64_t lo, int64_t hi, int64_t& size, int64_t& stride) {
  size = 1;
  stride = 1;
  bool first = true;
  for (int64_t d = hi - 1; d >= lo; --d) {
    const int64_t s = t.size(d);
    if (s == 1) continue;
    if (first) {
      size = s;
      stride = t.stride(d);
      first = false;
    } else if (t.stride(d) != stride * size) {
      return false;
    } else {
      size *= s;
    }
  }
  return true;
}

// t with dims [first, last) reduced, or nullopt when a group does not merge.
// A 0-dim tensor is one problem of one value.
inline std::optional<Groups> three_groups(const at::Tensor& t, int64_t first, int64_t last) {
  Groups g;
  if (t.dim() == 0) return g;
  if (merge_dims(t, 0, first, g.outer, g.outer_stride) && merge_dims(t, first, last, g.reduced, g.reduced_stride) &&
      merge_dims(t, last, t.dim(), g.inner, g.inner_stride)) {
    return g;
  }
  return std::nullopt;
}

// t fills one block of memory without gaps or overlaps (contiguous or any
// permutation of it), layout.py's is_dense.
inline bool is_dense(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims with more than one element
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

}  // namespace effilayers
