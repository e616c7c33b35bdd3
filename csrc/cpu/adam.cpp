// Fused Adam/AdamW update on CPU: the CPU kernel of effilayers::adam_step_.
//
// One pass over a run of parameters: each element's param, grad, exp_avg and
// exp_avg_sq (and max_exp_avg_sq, fp32 master) are read once and the new
// values written once, so the step moves the minimum number of bytes (28 per
// fp32 parameter with fp32 states, 20 with bf16 states). The parameters are
// read and written where they live (no gather into a flat copy); only the
// states are flat. One at::parallel_for covers the whole run: each thread
// takes a contiguous slice of the flat index range and walks the tensors
// that slice touches. A parameter may be any dense layout (channels_last
// included): the states follow its memory order, and its gradient must share
// its strides (the optimizer arranges that).
//
// Lanes: 8 floats per AVX2 register, with bf16 widened by a 16-bit shift and
// narrowed with round-to-nearest-even (the same rounding as c10::BFloat16,
// so the vector body and the scalar tail agree bit for bit), fp16 through
// F16C. The arithmetic follows torch.optim.Adam's single-tensor path
// operation by operation (no FMA contraction), so an fp32 trajectory tracks
// torch's to rounding.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace effilayers {
namespace {

// Below this many elements per thread the fork/join costs more than it saves.
constexpr int64_t kGrainElements = 32768;

template <typename acc_t>
struct AdamFactors {
  acc_t one_minus_beta1, beta2, one_minus_beta2, eps;
  acc_t weight_decay;      // coupled (Adam) decay added to the gradient
  acc_t decay_factor;      // decoupled (AdamW): p *= 1 - lr * weight_decay
  acc_t step_size;         // lr / (1 - beta1^step)
  acc_t bias_correction2_sqrt;
  acc_t grad_scale;
  bool scaled, maximize, decoupled, has_weight_decay;
};

template <typename T>
inline T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// One element; also the tail of the vector loop and the whole float64 path.
template <typename param_t, typename state_t, typename acc_t>
inline void update_one(param_t* param, const param_t* grad, float* master, state_t* exp_avg, state_t* exp_avg_sq,
                       state_t* max_exp_avg_sq, const AdamFactors<acc_t>& f) {
  acc_t g = static_cast<acc_t>(*grad);
  if (f.scaled) g = g / f.grad_scale;
  if (f.maximize) g = -g;
  acc_t p = master != nullptr ? static_cast<acc_t>(*master) : static_cast<acc_t>(*param);
  if (f.has_weight_decay) {
    if (f.decoupled) {
      p = p * f.decay_factor;
    } else {
      g = g + f.weight_decay * p;
    }
  }
  acc_t m = static_cast<acc_t>(*exp_avg);
  m = m + f.one_minus_beta1 * (g - m);  // torch.lerp for weight < 0.5
  acc_t v = static_cast<acc_t>(*exp_avg_sq);
  v = v * f.beta2 + f.one_minus_beta2 * g * g;
  acc_t v_hat = v;
  if (max_exp_avg_sq != nullptr) {
    // torch.maximum: NaN propagates
    const acc_t previous = static_cast<acc_t>(*max_exp_avg_sq);
    v_hat = (std::isnan(v) || v > previous) ? v : previous;
    *max_exp_avg_sq = static_cast<state_t>(v_hat);
  }
  const acc_t denom = std::sqrt(v_hat) / f.bias_correction2_sqrt + f.eps;
  p = p + (-f.step_size) * (m / denom);
  *exp_avg = static_cast<state_t>(m);
  *exp_avg_sq = static_cast<state_t>(v);
  if (master != nullptr) *master = static_cast<float>(p);
  *param = static_cast<param_t>(p);
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(c10::BFloat16* p, __m256 v) {
  // c10::round_to_nearest_even: add 0x7fff + the kept lsb, truncate; NaN -> 0x7fc0.
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(is_nan));
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// NaN-propagating maximum, like torch.maximum (max_ps returns its second
// operand when either is NaN, so put the new value second).
inline __m256 nan_max(__m256 previous, __m256 v) {
  const __m256 larger = _mm256_max_ps(previous, v);
  const __m256 v_is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(larger, v, v_is_nan);
}
#endif

template <typename param_t, typename state_t, typename acc_t>
void update_range(param_t* param, const param_t* grad, float* master, state_t* exp_avg, state_t* exp_avg_sq,
                  state_t* max_exp_avg_sq, int64_t n, const AdamFactors<acc_t>& f) {
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 one_minus_beta1 = _mm256_set1_ps(f.one_minus_beta1);
    const __m256 beta2 = _mm256_set1_ps(f.beta2);
    const __m256 one_minus_beta2 = _mm256_set1_ps(f.one_minus_beta2);
    const __m256 eps = _mm256_set1_ps(f.eps);
    const __m256 weight_decay = _mm256_set1_ps(f.weight_decay);
    const __m256 decay_factor = _mm256_set1_ps(f.decay_factor);
    const __m256 neg_step_size = _mm256_set1_ps(-f.step_size);
    const __m256 bias_correction2_sqrt = _mm256_set1_ps(f.bias_correction2_sqrt);
    const __m256 grad_scale = _mm256_set1_ps(f.grad_scale);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
      __m256 g = load8(grad + i);
      if (f.scaled) g = _mm256_div_ps(g, grad_scale);
      if (f.maximize) g = _mm256_xor_ps(g, sign);
      __m256 p = master != nullptr ? load8(master + i) : load8(param + i);
      if (f.has_weight_decay) {
        if (f.decoupled) {
          p = _mm256_mul_ps(p, decay_factor);
        } else {
          g = _mm256_add_ps(g, _mm256_mul_ps(weight_decay, p));
        }
      }
      __m256 m = load8(exp_avg + i);
      m = _mm256_add_ps(m, _mm256_mul_ps(one_minus_beta1, _mm256_sub_ps(g, m)));
      __m256 v = load8(exp_avg_sq + i);
      v = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
      __m256 v_hat = v;
      if (max_exp_avg_sq != nullptr) {
        v_hat = nan_max(load8(max_exp_avg_sq + i), v);
        store8(max_exp_avg_sq + i, v_hat);
      }
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_hat), bias_correction2_sqrt), eps);
      p = _mm256_add_ps(p, _mm256_mul_ps(neg_step_size, _mm256_div_ps(m, denom)));
      store8(exp_avg + i, m);
      store8(exp_avg_sq + i, v);
      if (master != nullptr) store8(master + i, p);
      store8(param + i, p);
    }
  }
#endif
  for (; i < n; ++i) {
    update_one(param + i, grad + i, master != nullptr ? master + i : nullptr, exp_avg + i, exp_avg_sq + i,
               max_exp_avg_sq != nullptr ? max_exp_avg_sq + i : nullptr, f);
  }
}

// Same strides wherever a dimension has more than one element: the two
// tensors then hold their values in the same memory order.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

float read_scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.numel() == 1, "adam_step_: ", name, " must have one element, got ", t.numel());
  TORCH_CHECK_VALUE(t.device().is_cpu(), "adam_step_: ", name, " must be on the CPU for the CPU kernel, got ",
                    t.device());
  return t.to(at::kFloat).item<float>();
}

// Checks the params and grads of a step (op names the op in the messages);
// returns how many state elements they take, each parameter padded to a
// multiple of `block`.
int64_t check_params(at::TensorList params, at::TensorList grads, const char* op, bool allow_double, int64_t block) {
  TORCH_CHECK_VALUE(!params.empty(), op, ": params must not be empty");
  TORCH_CHECK_VALUE(params.size() == grads.size(), op, ": ", params.size(), " params but ", grads.size(), " grads");
  const auto param_type = params[0].scalar_type();
  TORCH_CHECK_TYPE(param_type == at::kHalf || param_type == at::kBFloat16 || param_type == at::kFloat ||
                       (allow_double && param_type == at::kDouble),
                   op, ": params must be ",
                   allow_double ? "float16, bfloat16, float32 or float64" : "float16, bfloat16 or float32", ", got ",
                   param_type);
  int64_t total = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    TORCH_CHECK_TYPE(params[t].scalar_type() == param_type && grads[t].scalar_type() == param_type, op, ": params[",
                     t, "] / grads[", t, "] must all have dtype ", param_type);
    TORCH_CHECK_VALUE(params[t].sizes() == grads[t].sizes(), op, ": grads[", t, "] has shape ", grads[t].sizes(),
                      ", param ", params[t].sizes());
    TORCH_CHECK_VALUE(params[t].is_non_overlapping_and_dense() && same_layout(params[t], grads[t]), op, ": params[",
                      t, "] must be dense (contiguous or a permutation of it, like channels_last) and grads[", t,
                      "] must have its strides");
    TORCH_CHECK_VALUE(params[t].device().is_cpu() && grads[t].device().is_cpu(), op, ": params[", t, "] and grads[",
                      t, "] must be on the CPU");
    total += (params[t].numel() + block - 1) / block * block;
  }
  return total;
}

// The scalars of one step, formed in double and rounded once, as torch does
// with its Python-float hyperparameters.
template <typename acc_t>
AdamFactors<acc_t> adam_factors(double lr, double beta1, double beta2, double eps, double weight_decay,
                                bool decoupled_weight_decay, bool maximize, double step,
                                const std::optional<at::Tensor>& grad_scale) {
  AdamFactors<acc_t> f;
  f.one_minus_beta1 = static_cast<acc_t>(1.0 - beta1);
  f.beta2 = static_cast<acc_t>(beta2);
  f.one_minus_beta2 = static_cast<acc_t>(1.0 - beta2);
  f.eps = static_cast<acc_t>(eps);
  f.weight_decay = static_cast<acc_t>(weight_decay);
  f.decay_factor = static_cast<acc_t>(1.0 - lr * weight_decay);
  f.step_size = static_cast<acc_t>(lr / (1.0 - std::pow(beta1, step)));
  f.bias_correction2_sqrt = static_cast<acc_t>(std::sqrt(1.0 - std::pow(beta2, step)));
  f.scaled = grad_scale.has_value();
  f.grad_scale = f.scaled ? static_cast<acc_t>(read_scalar(*grad_scale, "grad_scale")) : acc_t(1);
  f.maximize = maximize;
  f.decoupled = decoupled_weight_decay;
  f.has_weight_decay = weight_decay != 0.0;
  return f;
}

template <typename param_t, typename state_t, typename acc_t>
void adam_step_typed(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                     const std::optional<at::Tensor>& master, const AdamFactors<acc_t>& f) {
  const int64_t count = static_cast<int64_t>(params.size());
  std::vector<int64_t> offsets(count + 1, 0);
  std::vector<param_t*> param_data(count);
  std::vector<const param_t*> grad_data(count);
  for (int64_t t = 0; t < count; ++t) {
    offsets[t + 1] = offsets[t] + params[t].numel();
    param_data[t] = params[t].data_ptr<param_t>();
    grad_data[t] = grads[t].data_ptr<param_t>();
  }
  state_t* m = exp_avg.data_ptr<state_t>();
  state_t* v = exp_avg_sq.data_ptr<state_t>();
  state_t* v_max = data_or_null<state_t>(max_exp_avg_sq);
  float* master_data = data_or_null<float>(master);
  at::parallel_for(0, offsets[count], kGrainElements, [&](int64_t begin, int64_t end) {
    // first tensor whose range holds `begin`
    int64_t t = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    while (begin < end && t < count) {
      const int64_t stop = std::min(end, offsets[t + 1]);
      const int64_t local = begin - offsets[t];
      update_range<param_t, state_t, acc_t>(param_data[t] + local, grad_data[t] + local,
                                            master_data != nullptr ? master_data + begin : nullptr, m + begin,
                                            v + begin, v_max != nullptr ? v_max + begin : nullptr, stop - begin, f);
      begin = stop;
      ++t;
    }
  });
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                   const std::optional<at::Tensor>& master, const at::Tensor& step,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
                   bool maximize) {
  const int64_t total = check_params(params, grads, "adam_step_", /*allow_double=*/true, /*block=*/1);
  const auto param_type = params[0].scalar_type();
  const auto state_type = exp_avg.scalar_type();
  for (const at::Tensor* state : {&exp_avg, &exp_avg_sq, max_exp_avg_sq.has_value() ? &*max_exp_avg_sq : nullptr}) {
    if (state == nullptr) continue;
    TORCH_CHECK_VALUE(state->dim() == 1 && state->numel() == total && state->is_contiguous() &&
                          state->device().is_cpu(),
                      "adam_step_: states must be contiguous 1-D CPU tensors of ", total, " elements");
    TORCH_CHECK_TYPE(state->scalar_type() == state_type, "adam_step_: all states must have one dtype");
  }
  if (param_type == at::kDouble) {
    TORCH_CHECK_TYPE(state_type == at::kDouble, "adam_step_: float64 params need float64 states, got ", state_type);
  } else {
    TORCH_CHECK_TYPE(state_type == at::kFloat || state_type == at::kBFloat16,
                     "adam_step_: states must be float32 or bfloat16, got ", state_type);
  }
  if (master.has_value()) {
    TORCH_CHECK_VALUE(master->scalar_type() == at::kFloat && master->dim() == 1 && master->numel() == total &&
                          master->is_contiguous() && param_type != at::kDouble,
                      "adam_step_: master must be a contiguous 1-D float32 tensor of ", total, " elements");
  }
  // A skipped (overflowed) step writes nothing.
  if (found_inf.has_value() && read_scalar(*found_inf, "found_inf") != 0.0f) return;

  const double step_value = read_scalar(step, "step");
  auto run = [&](auto acc_zero, auto param_zero, auto state_zero) {
    using acc_t = decltype(acc_zero);
    using param_t = decltype(param_zero);
    using state_t = decltype(state_zero);
    const auto f = adam_factors<acc_t>(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize,
                                       step_value, grad_scale);
    adam_step_typed<param_t, state_t, acc_t>(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, master, f);
  };

  // dtype dispatch in one place: (param, state) pairs
  const bool bf16_states = state_type == at::kBFloat16;
  switch (param_type) {
    case at::kDouble:
      run(0.0, 0.0, 0.0);
      break;
    case at::kFloat:
      bf16_states ? run(0.0f, 0.0f, c10::BFloat16()) : run(0.0f, 0.0f, 0.0f);
      break;
    case at::kHalf:
      bf16_states ? run(0.0f, c10::Half(), c10::BFloat16()) : run(0.0f, c10::Half(), 0.0f);
      break;
    case at::kBFloat16:
      bf16_states ? run(0.0f, c10::BFloat16(), c10::BFloat16()) : run(0.0f, c10::BFloat16(), 0.0f);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------
// 8-bit block-quantized states: the CPU kernel of effilayers::adam_step_8bit_.
//
// Each block of kQuantBlock state elements belongs to one parameter (the
// states are padded per parameter). A block is decoded into three small
// float buffers on the stack, updated by update_range above (the same
// vectorised fp32 math as the unquantized kernel), and re-encoded with a
// fresh absmax. Blocks are independent, so at::parallel_for splits the run by
// blocks. The codes (see effilayers/ops/adam/): exp_avg = sign(q)(|q|/127)^2
// a, exp_avg_sq = (q/255)^4 a; encoding rounds with floor(x + 0.5), a non-zero
// exp_avg_sq keeps code >= 1. Decode and encode use the same operations in
// the same order in the vector body and the scalar tail (division, sqrt,
// separate multiply and add), so both give the same codes.

constexpr int64_t kQuantBlock = 256;

// The two codes, by code type: int8_t for exp_avg, uint8_t for exp_avg_sq.
template <typename code_t>
constexpr bool kSignedCode = std::is_signed_v<code_t>;
template <typename code_t>
constexpr float kLevels = kSignedCode<code_t> ? 127.0f : 255.0f;

template <typename code_t>
inline float decode(code_t q, float absmax) {
  if constexpr (kSignedCode<code_t>) {
    const float t = std::fabs(static_cast<float>(q)) / kLevels<code_t>;
    const float magnitude = (t * t) * absmax;
    return q < 0 ? -magnitude : magnitude;
  } else {
    const float t = static_cast<float>(q) / kLevels<code_t>;
    const float t2 = t * t;
    return (t2 * t2) * absmax;
  }
}

template <typename code_t>
inline code_t encode(float x, float absmax) {
  constexpr bool kSigned = kSignedCode<code_t>;
  const float ratio = absmax > 0.0f ? (kSigned ? std::fabs(x) : x) / absmax : 0.0f;
  const float root = kSigned ? std::sqrt(ratio) : std::sqrt(std::sqrt(ratio));
  float q = std::min(std::floor(root * kLevels<code_t> + 0.5f), kLevels<code_t>);
  if constexpr (kSigned) {
    return static_cast<code_t>(x < 0.0f ? -q : q);
  } else {
    if (q == 0.0f && x > 0.0f) q = 1.0f;
    return static_cast<code_t>(q);
  }
}

template <typename code_t>
void decode_block(const code_t* codes, float absmax, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 levels = _mm256_set1_ps(kLevels<code_t>);
  const __m256 scale = _mm256_set1_ps(absmax);
  for (; i + 8 <= n; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    if constexpr (kSignedCode<code_t>) {
      const __m256 sign = _mm256_set1_ps(-0.0f);
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 t = _mm256_div_ps(_mm256_andnot_ps(sign, q), levels);
      const __m256 magnitude = _mm256_mul_ps(_mm256_mul_ps(t, t), scale);
      _mm256_storeu_ps(out + i, _mm256_or_ps(magnitude, _mm256_and_ps(sign, q)));
    } else {
      const __m256 t = _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), levels);
      const __m256 t2 = _mm256_mul_ps(t, t);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(t2, t2), scale));
    }
  }
#endif
  for (; i < n; ++i) out[i] = decode(codes[i], absmax);
}

// Largest |x| of the block, or NaN when the block holds a NaN (as torch's
// amax in the reference): the block's codes become 0 and it decodes to NaN,
// so a NaN gradient is never hidden behind a finite state.
float block_absmax(const float* x, int64_t n) {
  float result = 0.0f;
  bool has_nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 best = _mm256_setzero_ps();
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 value = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, _mm256_andnot_ps(sign, value));  // drops NaN lanes: counted below
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  }
  has_nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  for (float lane : lanes) result = std::max(result, lane);
#endif
  for (; i < n; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    result = std::max(result, std::fabs(x[i]));
  }
  return has_nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

// Encodes a block with its absmax, which it returns.
template <typename code_t>
float encode_block(const float* x, code_t* codes, int64_t n) {
  constexpr bool kSigned = kSignedCode<code_t>;
  const float absmax = block_absmax(x, n);
  int64_t i = 0;
#if defined(__AVX2__)
  if (absmax > 0.0f) {
    const __m256 levels = _mm256_set1_ps(kLevels<code_t>);
    const __m256 scale = _mm256_set1_ps(absmax);
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256 zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 value = _mm256_loadu_ps(x + i);
      const __m256 ratio = _mm256_div_ps(kSigned ? _mm256_andnot_ps(_mm256_set1_ps(-0.0f), value) : value, scale);
      const __m256 root = kSigned ? _mm256_sqrt_ps(ratio) : _mm256_sqrt_ps(_mm256_sqrt_ps(ratio));
      __m256 q = _mm256_min_ps(_mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(root, levels), half)), levels);
      if constexpr (kSigned) {
        // -q where x < 0 (q == 0 stays 0 either way once converted)
        q = _mm256_blendv_ps(q, _mm256_sub_ps(zero, q), _mm256_cmp_ps(value, zero, _CMP_LT_OQ));
        const __m256i ints = _mm256_cvtps_epi32(q);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packs_epi16(words, words));
      } else {
        // A non-zero value keeps code >= 1.
        const __m256 lifted = _mm256_and_ps(_mm256_cmp_ps(q, zero, _CMP_EQ_OQ), _mm256_cmp_ps(value, zero, _CMP_GT_OQ));
        q = _mm256_blendv_ps(q, _mm256_set1_ps(1.0f), lifted);
        const __m256i ints = _mm256_cvtps_epi32(q);
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(words, words));
      }
    }
  }
#endif
  for (; i < n; ++i) codes[i] = encode<code_t>(x[i], absmax);
  return absmax;
}

struct QuantizedStates {
  int8_t* exp_avg;
  float* exp_avg_absmax;
  uint8_t* exp_avg_sq;
  float* exp_avg_sq_absmax;
  uint8_t* max_exp_avg_sq;  // null without amsgrad
  float* max_exp_avg_sq_absmax;
  float* master;            // padded layout; null without master weights
};

template <typename param_t>
void adam_step_8bit_typed(at::TensorList params, at::TensorList grads, const QuantizedStates& s,
                          const AdamFactors<float>& f) {
  const int64_t count = static_cast<int64_t>(params.size());
  std::vector<int64_t> first_block(count + 1, 0);  // block index where each parameter starts
  std::vector<int64_t> numel(count);
  std::vector<param_t*> param_data(count);
  std::vector<const param_t*> grad_data(count);
  for (int64_t t = 0; t < count; ++t) {
    numel[t] = params[t].numel();
    first_block[t + 1] = first_block[t] + (numel[t] + kQuantBlock - 1) / kQuantBlock;
    param_data[t] = params[t].data_ptr<param_t>();
    grad_data[t] = grads[t].data_ptr<param_t>();
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / kQuantBlock);
  at::parallel_for(0, first_block[count], grain, [&](int64_t begin, int64_t end) {
    float m[kQuantBlock], v[kQuantBlock], v_max[kQuantBlock];
    int64_t t = std::upper_bound(first_block.begin(), first_block.end(), begin) - first_block.begin() - 1;
    for (int64_t block = begin; block < end; ++block) {
      while (block >= first_block[t + 1]) ++t;
      const int64_t local = (block - first_block[t]) * kQuantBlock;  // first element of the block in param t
      const int64_t n = std::min(kQuantBlock, numel[t] - local);
      const int64_t base = block * kQuantBlock;                      // the block in the padded state layout
      decode_block(s.exp_avg + base, s.exp_avg_absmax[block], m, n);
      decode_block(s.exp_avg_sq + base, s.exp_avg_sq_absmax[block], v, n);
      if (s.max_exp_avg_sq != nullptr) {
        decode_block(s.max_exp_avg_sq + base, s.max_exp_avg_sq_absmax[block], v_max, n);
      }
      update_range<param_t, float, float>(param_data[t] + local, grad_data[t] + local,
                                          s.master != nullptr ? s.master + base : nullptr, m, v,
                                          s.max_exp_avg_sq != nullptr ? v_max : nullptr, n, f);
      s.exp_avg_absmax[block] = encode_block(m, s.exp_avg + base, n);
      s.exp_avg_sq_absmax[block] = encode_block(v, s.exp_avg_sq + base, n);
      if (s.max_exp_avg_sq != nullptr) {
        s.max_exp_avg_sq_absmax[block] = encode_block(v_max, s.max_exp_avg_sq + base, n);
      }
    }
  });
}

void check_codes(const at::Tensor& codes, const at::Tensor& absmax, at::ScalarType code_type, const char* name,
                 int64_t total) {
  TORCH_CHECK_VALUE(codes.scalar_type() == code_type && codes.dim() == 1 && codes.numel() == total &&
                        codes.is_contiguous() && codes.device().is_cpu(),
                    "adam_step_8bit_: ", name, " must be a contiguous 1-D ", code_type, " CPU tensor of ", total,
                    " elements (each parameter padded to a multiple of ", kQuantBlock, ")");
  TORCH_CHECK_VALUE(absmax.scalar_type() == at::kFloat && absmax.dim() == 1 &&
                        absmax.numel() == total / kQuantBlock && absmax.is_contiguous() && absmax.device().is_cpu(),
                    "adam_step_8bit_: ", name, "_absmax must be a contiguous 1-D float32 CPU tensor of ",
                    total / kQuantBlock, " elements");
}

void adam_step_8bit_cpu(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq,
                        const at::Tensor& exp_avg_sq_absmax, const std::optional<at::Tensor>& max_exp_avg_sq,
                        const std::optional<at::Tensor>& max_exp_avg_sq_absmax,
                        const std::optional<at::Tensor>& master, const at::Tensor& step,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                        double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled_weight_decay, bool maximize) {
  const int64_t total = check_params(params, grads, "adam_step_8bit_", /*allow_double=*/false, kQuantBlock);
  const auto param_type = params[0].scalar_type();
  check_codes(exp_avg, exp_avg_absmax, at::kChar, "exp_avg", total);
  check_codes(exp_avg_sq, exp_avg_sq_absmax, at::kByte, "exp_avg_sq", total);
  TORCH_CHECK_VALUE(max_exp_avg_sq.has_value() == max_exp_avg_sq_absmax.has_value(),
                    "adam_step_8bit_: max_exp_avg_sq and max_exp_avg_sq_absmax go together (amsgrad)");
  if (max_exp_avg_sq.has_value()) {
    check_codes(*max_exp_avg_sq, *max_exp_avg_sq_absmax, at::kByte, "max_exp_avg_sq", total);
  }
  if (master.has_value()) {
    TORCH_CHECK_VALUE(master->scalar_type() == at::kFloat && master->dim() == 1 && master->numel() == total &&
                          master->is_contiguous() && master->device().is_cpu(),
                      "adam_step_8bit_: master must be a contiguous 1-D float32 CPU tensor of ", total, " elements");
  }
  if (found_inf.has_value() && read_scalar(*found_inf, "found_inf") != 0.0f) return;

  const auto f = adam_factors<float>(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize,
                                     read_scalar(step, "step"), grad_scale);
  QuantizedStates s{exp_avg.data_ptr<int8_t>(),
                    exp_avg_absmax.data_ptr<float>(),
                    exp_avg_sq.data_ptr<uint8_t>(),
                    exp_avg_sq_absmax.data_ptr<float>(),
                    data_or_null<uint8_t>(max_exp_avg_sq),
                    data_or_null<float>(max_exp_avg_sq_absmax),
                    data_or_null<float>(master)};
  switch (param_type) {
    case at::kFloat:
      adam_step_8bit_typed<float>(params, grads, s, f);
      break;
    case at::kHalf:
      adam_step_8bit_typed<c10::Half>(params, grads, s, f);
      break;
    case at::kBFloat16:
      adam_step_8bit_typed<c10::BFloat16>(params, grads, s, f);
      break;
    default:
      break;
  }
}

}  // namespace
}  // namespace effilayers

// The ops are declared once, in Python (effilayers/ops/adam/op.py); this
// library only gives them their CPU kernels.
TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  m.impl("adam_step_", &effilayers::adam_step_cpu);
  m.impl("adam_step_8bit_", &effilayers::adam_step_8bit_cpu);
}
