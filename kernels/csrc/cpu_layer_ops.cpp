// Fused per-layer CPU ops of a decoder layer: residual add + RMSNorm (Llama's and Gemma's),
// rotary embedding in place on q and k, SiLU(gate) * up, and the KV-cache store. Each
// replaces several torch ops whose dispatch, not their arithmetic, is most of a
// single-stream decode step.
//
// NUMERICS: each op rounds where the torch code it replaces (HF transformers' arithmetic)
// rounds, so results agree with it to the last bit (SiLU's exp: to an ulp):
//   - add + RMSNorm: sum = T(x + r); var = sum(float(sum)^2) / hidden in float32, summed in
//     the order of torch's CPU sum (sum_of_squares below); h = float(sum) * (1 / sqrt(var +
//     float(eps))); out = T(float(w) * float(T(h))).
//   - Gemma's RMSNorm: the same sum and mean; out = T((float(sum) * (1 / sqrt(var + float(eps))))
//     * gain), gain = float32 `1 + weight` (one rounding, at the end).
//   - rotary: c = T(cos), s = T(sin) (cos_table[p].to(q.dtype)); x1' = T(T(x1 c) + T(-x2 s)),
//     x2' = T(T(x2 c) + T(x1 s)).
//   - SiLU * up: T(float(T(g / (1 + exp(-g)))) * float(u)), exp a Cephes-style polynomial
//     (about 1 ulp, as torch's vectorized exp) that the compiler vectorizes.
// Built without -ffast-math and with -ffp-contract=off: no FMA contraction or reassociation
// changes those roundings. Shapes and dtypes are checked here (TORCH_CHECK raises a
// RuntimeError); kvpilot.kernels.cpu_layer_ops holds the launchers and the references.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "entry_points.h"
#include "vec_lanes.h"

namespace {

// Rows per parallel_for chunk: a decode step's few rows stay on the calling thread.
constexpr int64_t kGrainRows = 16;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }   // c10: round to nearest even

template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// torch's float32 sum of a contiguous row (ATen's cascade_sum: kLanes-wide vector
// accumulators, four rows of them interleaved, combined in levels of 16), here of the
// rounded squares x*x as ``h.pow(2)`` makes them. Summed in the same order, the mean is
// bit-identical to torch's (and HF's), not merely within an ulp. Eight lanes is what
// torch 2.13's sum runs on AVX2 and AVX-512 machines alike (checked against torch.sum by
// tests/kernels/test_cpu_layer_ops.py; another order would still be within an ulp).
constexpr int64_t kLanes = 8;

struct Lanes {
  float v[kLanes];
};

inline int64_t ceil_log2(int64_t x) {
  int64_t bits = 0;
  while ((int64_t(1) << bits) < x) ++bits;
  return bits;
}

// ATen's multi_row_sum: 4 interleaved rows, each a cascade of 4 levels; load(i, k) is
// element k of row i. Acc is float (a scalar row) or Lanes (a vector row).
template <typename Acc, typename Load, typename Add>
void multi_row_sum(Acc out[4], int64_t size, Load load, Add add, const Acc& zero) {
  constexpr int64_t num_levels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / num_levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Acc acc[4][num_levels];
  for (auto& row : acc)
    for (auto& a : row) a = zero;
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) add(acc[k][0], load(i, k));
    for (int64_t j = 1; j < num_levels; ++j) {
      for (int k = 0; k < 4; ++k) {
        add(acc[k][j], acc[k][j - 1]);
        acc[k][j - 1] = zero;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) add(acc[k][0], load(i, k));
  for (int64_t j = 1; j < num_levels; ++j)
    for (int k = 0; k < 4; ++k) add(acc[k][0], acc[k][j]);
  for (int k = 0; k < 4; ++k) out[k] = acc[k][0];
}

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  auto sq = [x](int64_t i) {
    const float v = static_cast<float>(x[i]);
    return v * v;
  };
  if (n >= kLanes) {   // vectorized_inner_sum: row_sum over vectors, then a scalar tail
    const int64_t vec_count = n / kLanes, size_ilp = vec_count / 4;
    Lanes zero{}, parts[4];
    auto load = [&](int64_t i, int k) {
      Lanes l;
      const int64_t base = (i * 4 + k) * kLanes;
      for (int64_t e = 0; e < kLanes; ++e) l.v[e] = sq(base + e);
      return l;
    };
    auto add = [](Lanes& a, const Lanes& b) {
      for (int64_t e = 0; e < kLanes; ++e) a.v[e] += b.v[e];
    };
    multi_row_sum<Lanes>(parts, size_ilp, load, add, zero);
    for (int64_t i = size_ilp * 4; i < vec_count; ++i) {
      Lanes l;
      for (int64_t e = 0; e < kLanes; ++e) l.v[e] = sq(i * kLanes + e);
      add(parts[0], l);
    }
    for (int k = 1; k < 4; ++k) add(parts[0], parts[k]);
    float total = 0;
    for (int64_t i = vec_count * kLanes; i < n; ++i) total += sq(i);
    for (int64_t e = 0; e < kLanes; ++e) total += parts[0].v[e];
    return total;
  }
  // scalar_inner_sum: row_sum over elements
  const int64_t size_ilp = n / 4;
  float parts[4];
  multi_row_sum<float>(parts, size_ilp, [&](int64_t i, int k) { return sq(i * 4 + k); },
                       [](float& a, float b) { a += b; }, 0.0f);
  for (int64_t i = size_ilp * 4; i < n; ++i) parts[0] += sq(i);
  for (int k = 1; k < 4; ++k) parts[0] += parts[k];
  return parts[0];
}

// The row a norm normalises: x itself, or x + residual rounded to T, written to `sum`.
template <typename T>
const T* summed_row(const T* x, const T* residual, T* sum, int64_t n) {
  if (!residual) return x;
  for (int64_t i = 0; i < n; ++i) sum[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
  return sum;
}

// 1 / sqrt(mean(x^2) + eps) in float32, the sum in torch's order (sum_of_squares).
template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  const float var = sum_of_squares<T>(x, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(var + eps);
}

template <typename T>
void add_rms_norm_rows(const torch::Tensor& x, const torch::Tensor* residual, const torch::Tensor& weight,
                       double eps, torch::Tensor& out, torch::Tensor* sum_out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t x_stride = x.stride(0);
  const int64_t r_stride = residual ? residual->stride(0) : 0;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = sum_out ? sum_out->data_ptr<T>() : nullptr;
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* orow = op + row * hidden;
      const T* src = summed_row<T>(xp + row * x_stride, rp ? rp + row * r_stride : nullptr,
                                   sp ? sp + row * hidden : nullptr, hidden);
      const float inv = inverse_rms<T>(src, hidden, eps_f);
      for (int64_t k = 0; k < hidden; ++k) {
        const float h = round_to<T>(to_float(src[k]) * inv);
        orow[k] = from_float<T>(to_float(wp[k]) * h);
      }
    }
  });
}

// Gemma's RMSNorm (GemmaRMSNorm._norm) over rows of x, each row `dim` contiguous values at
// row_offset(r) elements from the start: h = float(x) (x + residual first, rounded to T),
// out = T((h * (1 / sqrt(mean(h^2) + eps))) * gain), gain = float32 `1 + weight`.
template <typename T, typename Offset>
void gemma_norm_rows(const T* xp, int64_t rows, int64_t dim, Offset row_offset, const T* rp, int64_t r_stride,
                     const float* gain, double eps, T* op, T* sp) {
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* src = summed_row<T>(xp + row_offset(row), rp ? rp + row * r_stride : nullptr,
                                   sp ? sp + row * dim : nullptr, dim);
      const float inv = inverse_rms<T>(src, dim, eps_f);
      T* orow = op + row * dim;
      for (int64_t k = 0; k < dim; ++k) orow[k] = from_float<T>((to_float(src[k]) * inv) * gain[k]);
    }
  });
}

template <typename T>
void rotate_heads(T* base, int64_t num_heads, int64_t head_stride, int64_t half, const float* cos_row,
                  const float* sin_row) {
  for (int64_t h = 0; h < num_heads; ++h) {
    T* x = base + h * head_stride;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
      const float c1 = round_to<T>(cos_row[j]), s1 = round_to<T>(sin_row[j]);
      const float c2 = round_to<T>(cos_row[j + half]), s2 = round_to<T>(sin_row[j + half]);
      x[j] = from_float<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
      x[j + half] = from_float<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
    }
  }
}

template <typename T>
void rotary_rows(const torch::Tensor& positions, torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos,
                 const torch::Tensor& sin, int64_t rotary_dim) {
  const int64_t tokens = q.size(0), half = rotary_dim / 2, table_len = cos.size(0);
  const int64_t table_stride = cos.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table_len, "rotary: position ", pos[t], " outside the table of ",
                table_len);
  at::parallel_for(0, tokens, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * table_stride;
      const float* s = sp + pos[t] * table_stride;
      rotate_heads<T>(qp + t * q.stride(0), q.size(1), q.stride(1), half, c, s);
      rotate_heads<T>(kp + t * k.stride(0), k.size(1), k.stride(1), half, c, s);
    }
  });
}

// exp(x) for x in float: Cephes' expf (range reduction by ln 2 in two parts, a degree-6
// polynomial, the exponent put in by bits), about 1 ulp; branch-free so loops vectorize.
// exp_reduced is its core for F = float and F = VecF alike, written once: a scalar and
// every lane run the same operations in the same order, so they give the same bits.
template <typename F>
inline F exp_reduced(F x, F n) {   // exp(x) / 2^n for a clamped x, n = floor(x / ln 2 + 1/2)
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * (r * r) + r + 1.0f;
}

inline float exp_approx(float x) {
  x = std::fmin(std::fmax(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_reduced(x, n) * scale;
}

// SiLU(g) * u over one row, W lanes at a time in GCC's vector extensions (a build for
// AVX-512 gets 16-lane vectors, AVX2 8, the baseline 4): the same IEEE operations in the
// same order as the scalar code (no contraction: -ffp-contract=off), so every lane's bits
// equal what the scalar loop gives; the auto-vectorizer does not take the scalar loop (the
// exp's clamps and floor). bfloat16 is converted by bits (round to nearest even, NaN kept
// quiet, as c10::BFloat16 does); float16 and double keep the scalar loop.
using vec_lanes::load_lanes;
using vec_lanes::round_lanes;
using vec_lanes::store_lanes;
using vec_lanes::VecF;
using vec_lanes::VecI;
constexpr int64_t kSiluLanes = vec_lanes::kVecLanes;

inline VecF exp_approx(VecF x) {   // exp_approx above, lane by lane
  x = x < -87.3f ? VecF{} - 87.3f : x;
  x = x > 88.3f ? VecF{} + 88.3f : x;
  const VecF t = x * 1.44269504088896341f + 0.5f;
  VecF n = __builtin_convertvector(__builtin_convertvector(t, VecI), VecF);   // trunc
  n = n > t ? n - 1.0f : n;                                                   // floor
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  return exp_reduced(x, n) * reinterpret_cast<const VecF&>(bits);
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t inner) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    for (; i + kSiluLanes <= inner; i += kSiluLanes) {
      const VecF gv = load_lanes(g + i);
      const VecF act = round_lanes(gv / (1.0f + exp_approx(-gv)), static_cast<T*>(nullptr));
      store_lanes(o + i, act * load_lanes(u + i));
    }
  }
  for (; i < inner; ++i) {
    const float gv = to_float(g[i]);
    const float act = round_to<T>(gv / (1.0f + exp_approx(-gv)));
    o[i] = from_float<T>(act * to_float(u[i]));
  }
}

template <typename T>
void silu_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), inner = out.size(1), stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* g = gp + row * stride;
      silu_mul_row<T>(g, g + inner, op + row * inner, inner);
    }
  });
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor; got one on ", t.device());
}

void check_float_dtype(const torch::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name,
              " must be float32, bfloat16 or float16; got ", dt);
}

// A norm's outputs: {out} or, with a residual (checked: a CPU tensor like x, rows
// contiguous), {out, x + residual}, new tensors of x's shape.
std::vector<torch::Tensor> norm_outputs(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual) {
  std::vector<torch::Tensor> result{torch::empty(x.sizes(), x.options())};
  if (residual.has_value()) {
    const auto& r = *residual;
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == x.scalar_type() && r.sizes() == x.sizes() &&
                    r.stride(-1) == 1,
                "residual must be a CPU tensor like x ", x.sizes(), " ", x.scalar_type(), "; got ", r.sizes(),
                " ", r.scalar_type());
    result.push_back(torch::empty(x.sizes(), x.options()));
  }
  return result;
}

}  // namespace

// x [rows, hidden] (rows may be strided, dims contiguous), weight [hidden] of x's dtype,
// residual None or like x. Returns norm(x) or (norm(x + residual), x + residual), new tensors.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, hidden] with contiguous rows; got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              "weight must be a contiguous CPU [", x.size(1), "] of x's dtype ", x.scalar_type(), "; got ",
              weight.scalar_type(), " ", weight.sizes());
  auto result = norm_outputs(x, residual);
  torch::Tensor out = result[0];
  torch::Tensor summed = residual.has_value() ? result[1] : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x, residual.has_value() ? &*residual : nullptr, weight, eps, out,
                                residual.has_value() ? &summed : nullptr);
  });
  return result;
}

// Gemma's RMSNorm: x [rows, dim] or [tokens, heads, dim] (a view of a fused projection: any
// leading strides, the last dim contiguous), gain float32 [dim] (`1 + weight`), residual None
// or [rows, dim] like a 2-D x. Returns norm(x) or (norm(x + residual), x + residual), new
// contiguous tensors of x's shape.
std::vector<torch::Tensor> gemma_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                          torch::Tensor gain, double eps) {
  check_cpu(x, "x");
  check_float_dtype(x, "x");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x must be [rows, dim] or [tokens, heads, dim] with a contiguous last dim; got ", x.sizes(),
              " strides ", x.strides());
  const int64_t dim = x.size(-1);
  TORCH_CHECK(gain.dim() == 1 && gain.size(0) == dim && gain.is_contiguous() &&
                  gain.scalar_type() == at::kFloat && gain.device().is_cpu(),
              "gain must be a contiguous float32 CPU [", dim, "] (1 + weight); got ", gain.scalar_type(), " ",
              gain.sizes());
  TORCH_CHECK(!residual.has_value() || x.dim() == 2, "a residual needs a 2-D x; got ", x.sizes());
  auto result = norm_outputs(x, residual);
  torch::Tensor out = result[0];
  torch::Tensor summed = residual.has_value() ? result[1] : torch::Tensor();
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1, rows = x.numel() / std::max<int64_t>(dim, 1);
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  auto offset = [heads, s0, s1](int64_t row) { return (row / heads) * s0 + (row % heads) * s1; };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gemma_rms_norm", [&] {
    gemma_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), rows, dim, offset,
                              residual ? residual->data_ptr<scalar_t>() : nullptr, residual ? residual->stride(0) : 0,
                              gain.data_ptr<float>(), eps, out.data_ptr<scalar_t>(),
                              residual ? summed.data_ptr<scalar_t>() : nullptr);
  });
  return result;
}

// positions [tokens] int64; q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (any
// token and head strides, dims contiguous), rotated in place on their first rotary_dim dims;
// cos, sin [table_len, >= rotary_dim] float32 with contiguous rows.
void rotary_inplace(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                    torch::Tensor sin, int64_t rotary_dim) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  check_cpu(positions, "positions");
  check_float_dtype(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q and k must be [tokens, heads, head_dim] of one token count and head size; got ", q.sizes(),
              " and ", k.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must have contiguous head dims");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "q and k must share a dtype; got ", q.scalar_type(), " and ",
              k.scalar_type());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous int64 [", q.size(0), "]; got ", positions.scalar_type(), " ",
              positions.sizes());
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= q.size(2),
              "rotary_dim must be even and within the head size ", q.size(2), "; got ", rotary_dim);
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) >= rotary_dim &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.stride(1) == 1 &&
                  sin.strides() == cos.strides() && cos.device().is_cpu() && sin.device().is_cpu(),
              "cos and sin must be float32 CPU [table_len, >= ", rotary_dim, "] tables of one layout; got ",
              cos.sizes(), " ", cos.scalar_type(), " and ", sin.sizes(), " ", sin.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "rotary_inplace", [&] {
    rotary_rows<scalar_t>(positions, q, k, cos, sin, rotary_dim);
  });
}

// gate_up [rows, 2 * inner] (rows may be strided): SiLU(gate_up[:, :inner]) * gate_up[:, inner:].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_cpu(gate_up, "gate_up");
  check_float_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be [rows, 2 * inner] with contiguous rows; got ", gate_up.sizes(), " strides ",
              gate_up.strides());
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up, out);
  });
  return out;
}

// The first num_tokens rows of key, value [tokens, kv_heads, head_dim] (any token stride,
// heads and dims contiguous) written to slots slot_mapping[:num_tokens] (int64, -1: skipped)
// of kv_cache [2, num_blocks, block_size, kv_heads, head_dim] (contiguous, K then V, of the
// same dtype: no fp8 scaling here); slot = block * block_size + offset.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slot_mapping,
              int64_t num_tokens) {
  for (const auto* t : {&key, &value, &kv_cache, &slot_mapping}) check_cpu(*t, "store_kv tensors");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "key and value must be [tokens, kv_heads, head_dim] and kv_cache [2, blocks, block_size, kv_heads, "
              "head_dim] of those heads; got ", key.sizes(), ", ", value.sizes(), ", ", kv_cache.sizes());
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache must share a dtype; got ", key.scalar_type(), ", ", value.scalar_type(),
              ", ", kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key and value must have contiguous heads");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [tokens]; got ", slot_mapping.scalar_type(), " ",
              slot_mapping.sizes());
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= key.size(0) && num_tokens <= slot_mapping.size(0),
              "store_kv: ", num_tokens, " tokens, but key has ", key.size(0), " rows and slot_mapping ",
              slot_mapping.size(0));
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t elem = key.element_size();
  const int64_t row_bytes = key.size(1) * key.size(2) * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(kv_cache.data_ptr());
  auto* vc = kc + num_slots * row_bytes;
  const int64_t k_stride = key.stride(0) * elem, v_stride = value.stride(0) * elem;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "store_kv: slot ", slot, " outside the cache's ", num_slots);
    std::memcpy(kc + slot * row_bytes, kp + t * k_stride, row_bytes);
    std::memcpy(vc + slot * row_bytes, vp + t * v_stride, row_bytes);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (HF rounding)", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("gemma_rms_norm", &gemma_rms_norm, "residual add + Gemma's RMSNorm (a 1 + weight gain, rounded once)",
        py::arg("x"), py::arg("residual"), py::arg("gain"), py::arg("eps"));
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding of q and k, in place");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused gate_up projection");
  m.def("store_kv", &store_kv, "write K and V rows into their cache slots");
  m.def("entry_points", [] {
    py::dict d;
    d["add_rms_norm"] = entry_points::wrap<entry_points::AddRmsNorm>(&add_rms_norm, entry_points::kAddRmsNorm);
    d["gemma_rms_norm"] = entry_points::wrap<entry_points::AddRmsNorm>(&gemma_rms_norm, entry_points::kGemmaRmsNorm);
    d["rotary_inplace"] = entry_points::wrap<entry_points::RotaryInplace>(&rotary_inplace,
                                                                          entry_points::kRotaryInplace);
    d["silu_mul"] = entry_points::wrap<entry_points::SiluMul>(&silu_mul, entry_points::kSiluMul);
    d["store_kv"] = entry_points::wrap<entry_points::StoreKv>(&store_kv, entry_points::kStoreKv);
    return d;
  }, "the ops as capsules, for another kernel module's native calls (entry_points.h)");
}
