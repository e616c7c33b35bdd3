// Small SIMD sums, and the moment merge, shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace effilayers {

// Reductions over a buffer use GCC/Clang vector types: one 32-byte register
// per accumulator (8 floats or 4 doubles; AVX2 where the build enables it,
// two SSE registers otherwise), four accumulators to cover the add latency.
// Writing them out keeps the compiler from needing to reassociate a single
// running sum, which it will not do without -ffast-math.
template <typename acc_t>
struct Vec {
  typedef acc_t type __attribute__((vector_size(32)));
  static constexpr int kWidth = 32 / sizeof(acc_t);
  static type load(const acc_t* p) {
    type v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static acc_t sum(type v) {
    acc_t total = 0;
    for (int l = 0; l < kWidth; ++l) total += v[l];
    return total;
  }
};

// Sum of n contiguous values (kSquares: of their squares) in acc_t. load(p)
// reads kWidth values at p as a vector of acc_t: Vec::load, or a converting
// load for a narrower type; the tail converts one value at a time.
template <bool kSquares, typename acc_t, typename scalar_t, typename Load>
acc_t lane_sum(const scalar_t* x, int64_t n, Load load) {
  using V = Vec<acc_t>;
  constexpr int W = V::kWidth;
  typename V::type a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    auto v0 = load(x + i), v1 = load(x + i + W), v2 = load(x + i + 2 * W), v3 = load(x + i + 3 * W);
    if constexpr (kSquares) {
      v0 *= v0;
      v1 *= v1;
      v2 *= v2;
      v3 *= v3;
    }
    a0 += v0;
    a1 += v1;
    a2 += v2;
    a3 += v3;
  }
  acc_t total = V::sum((a0 + a1) + (a2 + a3));
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(x[i]);
    total += kSquares ? v * v : v;
  }
  return total;
}

template <bool kSquares = false, typename acc_t>
acc_t lane_sum(const acc_t* x, int64_t n) {
  return lane_sum<kSquares, acc_t>(x, n, [](const acc_t* p) { return Vec<acc_t>::load(p); });
}

// Sums of (x - center) and (x - center)^2 over a buffer: the inner loop of
// the shifted two-pass variance (batch statistics, var/std reductions).
template <typename acc_t>
void lane_centered_sums(const acc_t* x, int64_t n, acc_t center, acc_t& sum_d, acc_t& sum_d2) {
  using V = Vec<acc_t>;
  constexpr int W = V::kWidth;
  typename V::type d0 = {}, d1 = {}, q0 = {}, q1 = {};
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const auto v0 = V::load(x + i) - center;
    const auto v1 = V::load(x + i + W) - center;
    d0 += v0;
    d1 += v1;
    q0 += v0 * v0;
    q1 += v1 * v1;
  }
  sum_d = V::sum(d0 + d1);
  sum_d2 = V::sum(q0 + q1);
  for (; i < n; ++i) {
    const acc_t d = x[i] - center;
    sum_d += d;
    sum_d2 += d * d;
  }
}

// Chan et al.'s combination of (count, mean, M2) summaries, in double and in
// the order of the merge calls: the per-chunk moments of batch statistics
// and of the var/std reductions.
struct Moments {
  double count = 0;
  double mean = 0;
  double m2 = 0;

  void merge(double other_count, double other_mean, double other_m2) {
    if (other_count == 0) return;
    const double total = count + other_count;
    const double delta = other_mean - mean;
    mean += delta * (other_count / total);
    m2 += other_m2 + delta * delta * (count * other_count / total);
    count = total;
  }
};

}  // namespace effilayers
