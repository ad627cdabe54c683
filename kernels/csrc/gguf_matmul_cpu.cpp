// GGUF (ggml) block-quantized weights on CPU: decode and multiply without a dequantized copy.
//
// A weight is its GGUF bytes as the file holds them, one row per output feature:
// uint8 [rows, blocks_per_row * type_size], the blocks running along the input dimension.
// `matmul` decodes one block of one row at a time into a float buffer (at most 256 values,
// in L1) and accumulates its dot product with every activation row, so each weight byte is
// read once per call whatever the batch; `dequantize` writes float32 rows (the reference),
// or bfloat16/float16 ones rounded once (the large-batch path, which multiplies a few rows
// at a time, and the embedding lookup). Block layouts follow
// ggml-quants.c (dequantize_row_*); the type ids are ggml's (GGMLQuantizationType).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "entry_points.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

enum QType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline void decode_q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int i = 0; i < 32; ++i) y[i] = d * q[i];
}

inline void decode_q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* q = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * (float)((q[i] & 0xF) - 8);
    y[i + 16] = d * (float)((q[i] >> 4) - 8);
  }
}

inline void decode_q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* q = b + 4;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * (float)(q[i] & 0xF) + m;
    y[i + 16] = d * (float)(q[i] >> 4) + m;
  }
}

inline void decode_q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* q = b + 6;
  for (int i = 0; i < 16; ++i) {
    const int h0 = ((qh >> i) << 4) & 0x10, h1 = (qh >> (i + 12)) & 0x10;
    y[i] = d * (float)(((q[i] & 0xF) | h0) - 16);
    y[i + 16] = d * (float)(((q[i] >> 4) | h1) - 16);
  }
}

inline void decode_q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* q = b + 8;
  for (int i = 0; i < 16; ++i) {
    const int h0 = ((qh >> i) << 4) & 0x10, h1 = (qh >> (i + 12)) & 0x10;
    y[i] = d * (float)((q[i] & 0xF) | h0) + m;
    y[i + 16] = d * (float)((q[i] >> 4) | h1) + m;
  }
}

// The k-quants' 6-bit sub-block scale and min j (of 8) from their 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, float* sc, float* m) {
  if (j < 4) {
    *sc = (float)(s[j] & 63);
    *m = (float)(s[j + 4] & 63);
  } else {
    *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

inline void decode_q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    float sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[j + l] = d1 * (float)(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * (float)(q[l] >> 4) - m2;
  }
}

inline void decode_q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
    float sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[j + l] = d1 * (float)((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
  }
}

inline void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[n + l] = d * sc[is] * q1;
      y[n + l + 32] = d * sc[is + 2] * q2;
      y[n + l + 64] = d * sc[is + 4] * q3;
      y[n + l + 96] = d * sc[is + 6] * q4;
    }
  }
}

#ifdef __AVX512F__
// AVX-512 decoders (the same values as the portable ones above, 16 lanes at a time).
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512 lanes(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i lo4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xF)); }
inline __m512i hi4(__m512i v) { return _mm512_srli_epi32(v, 4); }
// bits `shift`.. of v, `width` wide, moved up to bit 4 (the high part of a 5- or 6-bit code)
inline __m512i high_bits(__m512i v, int shift, int mask) {
  return _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask)), 4);
}

inline void decode_q8_0_v(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(half(b));
  for (int k = 0; k < 2; ++k) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * k)));
    _mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(d, lanes(q)));
  }
}

inline void decode_q4_0_v(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(half(b));
  const __m512i q = bytes16(b + 2), eight = _mm512_set1_epi32(8);
  _mm512_storeu_ps(y, _mm512_mul_ps(d, lanes(_mm512_sub_epi32(lo4(q), eight))));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, lanes(_mm512_sub_epi32(hi4(q), eight))));
}

inline void decode_q4_1_v(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(half(b)), m = _mm512_set1_ps(half(b + 2));
  const __m512i q = bytes16(b + 4);
  _mm512_storeu_ps(y, _mm512_fmadd_ps(d, lanes(lo4(q)), m));
  _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(d, lanes(hi4(q)), m));
}

// Q4_K and Q5_K: 4 pairs of 32-value sub-blocks; `qh` (Q5_K) adds bit 2j / 2j+1 as bit 4.
template <bool Five>
inline void decode_k4_v(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = Five ? b + 48 : b + 16;
  const __m512i h[2] = {bytes16(qh), bytes16(qh + 16)};
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    float sc, mn;
    scale_min_k4(2 * j, scales, &sc, &mn);
    const __m512 d1 = _mm512_set1_ps(d * sc), m1 = _mm512_set1_ps(dmin * mn);
    scale_min_k4(2 * j + 1, scales, &sc, &mn);
    const __m512 d2 = _mm512_set1_ps(d * sc), m2 = _mm512_set1_ps(dmin * mn);
    for (int k = 0; k < 2; ++k) {
      __m512i lo = lo4(bytes16(q + 16 * k)), hi = hi4(bytes16(q + 16 * k));
      if (Five) {
        lo = _mm512_or_si512(lo, high_bits(h[k], 2 * j, 1));
        hi = _mm512_or_si512(hi, high_bits(h[k], 2 * j + 1, 1));
      }
      _mm512_storeu_ps(y + 16 * k, _mm512_fmsub_ps(d1, lanes(lo), m1));
      _mm512_storeu_ps(y + 32 + 16 * k, _mm512_fmsub_ps(d2, lanes(hi), m2));
    }
  }
}

inline void decode_q6_k_v(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  const __m512i off = _mm512_set1_epi32(32);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int k = 0; k < 2; ++k) {     // values 16k..16k+15 of each 32, scale index k
      const __m512i a = bytes16(ql + 16 * k), c = bytes16(ql + 32 + 16 * k), hh = bytes16(qh + 16 * k);
      const __m512i q1 = _mm512_sub_epi32(_mm512_or_si512(lo4(a), high_bits(hh, 0, 3)), off);
      const __m512i q2 = _mm512_sub_epi32(_mm512_or_si512(lo4(c), high_bits(hh, 2, 3)), off);
      const __m512i q3 = _mm512_sub_epi32(_mm512_or_si512(hi4(a), high_bits(hh, 4, 3)), off);
      const __m512i q4 = _mm512_sub_epi32(_mm512_or_si512(hi4(c), high_bits(hh, 6, 3)), off);
      _mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(_mm512_set1_ps(d * sc[k]), lanes(q1)));
      _mm512_storeu_ps(y + 32 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(d * sc[k + 2]), lanes(q2)));
      _mm512_storeu_ps(y + 64 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(d * sc[k + 4]), lanes(q3)));
      _mm512_storeu_ps(y + 96 + 16 * k, _mm512_mul_ps(_mm512_set1_ps(d * sc[k + 6]), lanes(q4)));
    }
  }
}
#define KVPILOT_DECODER(t) decode_##t##_v
#define KVPILOT_K4(five, t) decode_k4_v<five>
#else
#define KVPILOT_DECODER(t) decode_##t
#define KVPILOT_K4(five, t) decode_##t
#endif

constexpr int64_t kMaxVectorBatch = 16;

// One type: its block (values), its size (bytes) and its decoder, inlined into the loops.
template <int Block, int TypeSize, void (*Decode)(const uint8_t*, float*)>
struct Format {
  static constexpr int block = Block, type_size = TypeSize;
  static inline void decode(const uint8_t* b, float* y) { Decode(b, y); }
};

int64_t check_weight(const torch::Tensor& w, int type_size, int block) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "the weight must be a contiguous CPU uint8 [rows, bytes per row] tensor");
  TORCH_CHECK(w.size(1) % type_size == 0, "bytes per row (", w.size(1), ") is not a whole number of ",
              type_size, "-byte blocks");
  return w.size(1) / type_size * block;   // columns
}

// Rows per task: enough weight bytes (256 KiB) for waking another thread to pay off;
// a smaller layer runs on the calling thread without an OpenMP region.
int64_t grain_rows(int64_t bytes_per_row) { return std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(bytes_per_row, 1)); }

// Rows per matmul task: 32 KiB of weight, so that every layer of a small model (a few
// hundred KiB) runs on all threads; the work grows with the batch.
int64_t matmul_grain_rows(int64_t bytes_per_row, int64_t batch) {
  const int64_t work = std::max<int64_t>(bytes_per_row, 1) * (1 + batch / 4);
  return std::max<int64_t>(1, (32 << 10) / work);
}

// float -> bfloat16 bits, round to nearest even with NaN kept quiet (c10::BFloat16's
// rounding), branch-free so that a block's loop vectorizes.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

inline void store_block(const float* y, int n, float* dst) { std::memcpy(dst, y, n * sizeof(float)); }
inline void store_block(const float* y, int n, c10::BFloat16* dst) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int i = 0; i < n; ++i) bits[i] = bf16_bits(y[i]);
}
inline void store_block(const float* y, int n, c10::Half* dst) {
  for (int i = 0; i < n; ++i) dst[i] = c10::Half(y[i]);
}

// The weight's values in Out (float32, or rounded once to bfloat16/float16: what the
// large-batch path hands F.linear, without a float32 copy converted afterwards).
template <typename F, typename Out>
torch::Tensor dequantize_as(const torch::Tensor& w, at::ScalarType dtype) {
  const int64_t cols = check_weight(w, F::type_size, F::block), rows = w.size(0), bpr = w.size(1);
  auto out = torch::empty({rows, cols}, torch::TensorOptions().dtype(dtype));
  const uint8_t* src = w.data_ptr<uint8_t>();
  Out* dst = out.data_ptr<Out>();
  at::parallel_for(0, rows, grain_rows(bpr), [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[F::block];
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < cols / F::block; ++b) {
        F::decode(src + r * bpr + b * F::type_size, buf);
        store_block(buf, F::block, dst + r * cols + b * F::block);
      }
  });
  return out;
}

template <typename F>
torch::Tensor dequantize_as(const torch::Tensor& w, at::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return dequantize_as<F, float>(w, dtype);
    case torch::kBFloat16: return dequantize_as<F, c10::BFloat16>(w, dtype);
    case torch::kHalf: return dequantize_as<F, c10::Half>(w, dtype);
    default: TORCH_CHECK(false, "dequantize writes float32, bfloat16 or float16; got ", dtype);
  }
}

// x [batch, columns] float32 times the weight's transpose: float32 [batch, rows].
template <typename F>
torch::Tensor matmul_as(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t cols = check_weight(w, F::type_size, F::block), rows = w.size(0), bpr = w.size(1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU float32 [batch, columns] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns; the weight has ", cols);
  const int64_t batch = x.size(0), nblocks = cols / F::block;
  auto out = torch::empty({batch, rows}, torch::kFloat32);
  const uint8_t* src = w.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, matmul_grain_rows(bpr, batch), [&](int64_t r0, int64_t r1) {
    alignas(64) float buf[F::block];
#ifdef __AVX512F__
    if (batch <= kMaxVectorBatch) {   // one 16-lane accumulator per activation row
      __m512 acc[kMaxVectorBatch];
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t m = 0; m < batch; ++m) acc[m] = _mm512_setzero_ps();
        const uint8_t* row = src + r * bpr;
        for (int64_t b = 0; b < nblocks; ++b) {
          F::decode(row + b * F::type_size, buf);
          for (int64_t m = 0; m < batch; ++m) {
            const float* xm = xs + m * cols + b * F::block;
            for (int v = 0; v < F::block; v += 16)
              acc[m] = _mm512_fmadd_ps(_mm512_load_ps(buf + v), _mm512_loadu_ps(xm + v), acc[m]);
          }
        }
        for (int64_t m = 0; m < batch; ++m) dst[m * rows + r] = _mm512_reduce_add_ps(acc[m]);
      }
      return;
    }
#endif
    std::vector<float> acc(batch);
    for (int64_t r = r0; r < r1; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint8_t* row = src + r * bpr;
      for (int64_t b = 0; b < nblocks; ++b) {
        F::decode(row + b * F::type_size, buf);
        for (int64_t m = 0; m < batch; ++m) {
          const float* xm = xs + m * cols + b * F::block;
          float t = 0.f;
#pragma omp simd reduction(+ : t)
          for (int i = 0; i < F::block; ++i) t += buf[i] * xm[i];
          acc[m] += t;
        }
      }
      for (int64_t m = 0; m < batch; ++m) dst[m * rows + r] = acc[m];
    }
  });
  return out;
}

using FQ4_0 = Format<32, 18, KVPILOT_DECODER(q4_0)>;
using FQ4_1 = Format<32, 20, KVPILOT_DECODER(q4_1)>;
using FQ5_0 = Format<32, 22, decode_q5_0>;
using FQ5_1 = Format<32, 24, decode_q5_1>;
using FQ8_0 = Format<32, 34, KVPILOT_DECODER(q8_0)>;
using FQ4_K = Format<256, 144, KVPILOT_K4(false, q4_k)>;
using FQ5_K = Format<256, 176, KVPILOT_K4(true, q5_k)>;
using FQ6_K = Format<256, 210, KVPILOT_DECODER(q6_k)>;

#define KVPILOT_GGUF_DISPATCH(qtype, CALL)                                   \
  switch (qtype) {                                                           \
    case Q4_0: return CALL(FQ4_0);                                           \
    case Q4_1: return CALL(FQ4_1);                                           \
    case Q5_0: return CALL(FQ5_0);                                           \
    case Q5_1: return CALL(FQ5_1);                                           \
    case Q8_0: return CALL(FQ8_0);                                           \
    case Q4_K: return CALL(FQ4_K);                                           \
    case Q5_K: return CALL(FQ5_K);                                           \
    case Q6_K: return CALL(FQ6_K);                                           \
    default: TORCH_CHECK(false, "no CPU kernel for ggml type ", qtype);      \
  }


// ---------------------------------------------------------------------------------------
// The q8-activation path (llama.cpp's vec_dot_q*_q8): each token's activations are
// quantized per 32-value block to int8 codes a with one float scale dx = amax / 127
// (a = round-to-nearest-even(x * 127 / amax), |a| <= 127), and each weight block is its unsigned
// codes u (0..255) with scale dw, offset o and min mw: value = dw * (u - o) + mw.
// A block's dot product is then
//     dw * dx * (sum(u * a) - o * sum(a)) + mw * dx * sum(a),
// the parenthesis in exact int32 arithmetic (AVX512-VNNI dpbusd, or AVX2 maddubs + madd),
// the scales in float32. Types: Q4_0 (o 8), Q4_1 (min), Q5_0 (o 16), Q5_1 (min), Q8_0
// (o 128: u = q + 128; the AVX2 path multiplies |q| by sign(q) * a, as maddubs would
// overflow 255 * 127 * 2). A tile of kRowTile rows is decoded once into codes and scales
// (in L1) and then multiplied into every token, kTokenTile tokens at a time; a row wider
// than kTileColumns, one chunk of that many columns at a time (see kTileColumns).

constexpr int kRowTile = 4;
constexpr int kTokenTile = 4;
// Rows the interleaved layout groups (one 512-bit lane of int32 sums per row).
constexpr int kInterleave = 16;

// Weight bytes one task multiplies at the least (rows x bytes per row x token tiles).
constexpr int64_t kMinTaskBytes = 16 << 10;

enum Isa : int64_t { kIsaBest = 0, kIsaVnni = 1, kIsaAvx2 = 2 };

bool cpu_has_vnni() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// 4-bit codes: byte i holds value i (low nibble) and value i + 16 (high nibble).
inline void unpack4(const uint8_t* q, uint8_t* u) {
  for (int i = 0; i < 16; ++i) u[i] = q[i] & 0xF, u[i + 16] = q[i] >> 4;
}
// 5-bit codes: the 4-bit ones, bit 4 of value j from bit j of the 32-bit `qh` at `h`.
inline void unpack5(const uint8_t* h, const uint8_t* q, uint8_t* u) {
  uint32_t qh;
  std::memcpy(&qh, h, 4);
  for (int i = 0; i < 16; ++i) {
    u[i] = (q[i] & 0xF) | (((qh >> i) << 4) & 0x10);
    u[i + 16] = (q[i] >> 4) | ((qh >> (i + 12)) & 0x10);
  }
}
// A weight block's codes (32 unsigned bytes in activation order) and scales.
template <int Type> struct Codes;
template <> struct Codes<Q4_0> {
  static constexpr int type_size = 18, offset = 8;
  static constexpr bool has_min = false;
  static inline void decode(const uint8_t* b, uint8_t* u, float* dw, float* mw) {
    *dw = half(b), *mw = 0.f;
    unpack4(b + 2, u);
  }
};
template <> struct Codes<Q4_1> {
  static constexpr int type_size = 20, offset = 0;
  static constexpr bool has_min = true;
  static inline void decode(const uint8_t* b, uint8_t* u, float* dw, float* mw) {
    *dw = half(b), *mw = half(b + 2);
    unpack4(b + 4, u);
  }
};
template <> struct Codes<Q5_0> {
  static constexpr int type_size = 22, offset = 16;
  static constexpr bool has_min = false;
  static inline void decode(const uint8_t* b, uint8_t* u, float* dw, float* mw) {
    *dw = half(b), *mw = 0.f;
    unpack5(b + 2, b + 6, u);
  }
};
template <> struct Codes<Q5_1> {
  static constexpr int type_size = 24, offset = 0;
  static constexpr bool has_min = true;
  static inline void decode(const uint8_t* b, uint8_t* u, float* dw, float* mw) {
    *dw = half(b), *mw = half(b + 2);
    unpack5(b + 4, b + 8, u);
  }
};
template <> struct Codes<Q8_0> {
  static constexpr int type_size = 34, offset = 128;
  static constexpr bool has_min = false;
  static inline void decode(const uint8_t* b, uint8_t* u, float* dw, float* mw) {
    *dw = half(b), *mw = 0.f;
    for (int i = 0; i < 32; ++i) u[i] = b[2 + i] ^ 0x80;
  }
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// One token's activations as q8 blocks: codes [kp], per block the scale dx, dx * sum(a)
// (sx), and (VNNI) dx spread over the 8 lanes of its half of a block pair (dx16).
struct QuantizedX {
  int64_t nb, nbp, kp, ns;   // blocks, blocks padded to pairs, codes per token, sx stride
  std::vector<int8_t> a;
  std::vector<float> dx, sx, dx16;
  std::vector<float> sxi;   // [batch][ni]: 0, sx0, 0, sx1, ... (to pair with the VNNI tile's d0 m0 d1 m1 ...)
  int64_t ni;
  std::vector<int32_t> sum;
};

// x rows [batch, cols] (cols a multiple of 32) -> q8 blocks, zero-padded to an even number.
template <typename T>
void quantize_rows(const T* x, int64_t batch, int64_t cols, QuantizedX& q) {
  q.nb = cols / 32, q.nbp = (q.nb + 1) / 2 * 2, q.kp = q.nbp * 32, q.ns = (q.nbp + 15) / 16 * 16;
  q.a.assign(batch * q.kp, 0);
  q.dx.assign(batch * q.nbp, 0.f);
  q.sx.assign(batch * q.ns, 0.f);
  q.dx16.assign(batch * q.nbp * 8, 0.f);
  q.ni = (2 * q.nbp + 15) / 16 * 16;
  q.sxi.assign(batch * q.ni, 0.f);
  q.sum.assign(batch * q.nbp, 0);
  at::parallel_for(0, batch, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < q.nb; ++b) {
        float v[32], amax = 0.f;
        const T* xb = x + t * cols + b * 32;
        for (int i = 0; i < 32; ++i) v[i] = to_float(xb[i]), amax = std::max(amax, std::abs(v[i]));
        // (written so that -ffast-math has nothing to reassociate: the tests model it exactly)
        const float d = amax * (1.0f / 127.0f), id = amax > 0.f ? 127.0f / amax : 0.f;
        int8_t* a = q.a.data() + t * q.kp + b * 32;
        int32_t s = 0;
        for (int i = 0; i < 32; ++i) {
          const int c = static_cast<int>(std::nearbyint(v[i] * id));
          a[i] = static_cast<int8_t>(c);
          s += c;
        }
        q.dx[t * q.nbp + b] = d;
        q.sum[t * q.nbp + b] = s;
        q.sx[t * q.ns + b] = d * static_cast<float>(s);
        q.sxi[t * q.ni + 2 * b + 1] = d * static_cast<float>(s);
        for (int i = 0; i < 8; ++i) q.dx16[(t * q.nbp + b) * 8 + i] = d;
      }
    }
  });
}

// Columns a tile holds: a wider row is decoded and multiplied a tile's width (a chunk) at a
// time, each token's sums carried from one chunk to the next, so that a row's terms add up
// in the same order whatever its width (a row of at most this many columns is one chunk).
constexpr int64_t kTileColumns = 4096;
constexpr int64_t kTileBlocks = kTileColumns / 32;

// n floats on the heap, zeroed, 64-byte aligned (a tile's per-row scales, its carried sums).
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n) : buf_(n + 16, 0.f) {
    data_ = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t(63));
  }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data() const { return data_; }

 private:
  std::vector<float> buf_;
  float* data_;
};

// A tile of decoded weight rows for the AVX2 path: one chunk's codes [kRowTile][chunk codes]
// and scales dw, and the whole rows' mins mw [kRowTile][ns] (added after the last chunk);
// carry: [token][kRowTile] 8-lane sums between chunks (a row of more than one chunk).
struct RowTile {
  alignas(64) uint8_t u[kRowTile][kTileColumns];
  alignas(64) float dw[kRowTile][kTileBlocks];
  const int64_t ns;
  AlignedFloats mw, carry;
  RowTile(const QuantizedX& q, int64_t batch)
      : ns(q.ns), mw(kRowTile * q.ns), carry(q.nbp > kTileBlocks ? kRowTile * batch * 8 : 0) {}
  float* mins(int r) const { return mw.data() + r * ns; }
};

// Blocks b0..b1 (a chunk) of the tile of rows r0.. (n of them real; the others zero).
template <int Type>
void decode_tile(const uint8_t* src, int64_t bpr, int64_t r0, int n, const QuantizedX& q, int64_t b0, int64_t b1,
                 RowTile& tile) {
  using C = Codes<Type>;
  for (int r = 0; r < kRowTile; ++r) {
    float* mw = tile.mins(r);
    if (r >= n) {   // rows past the layer's end: zero codes and scales (the mins past nbp stay zero)
      std::memset(tile.u[r], 0, (b1 - b0) * 32);
      std::memset(tile.dw[r], 0, sizeof(tile.dw[r]));
      std::memset(mw + b0, 0, (b1 - b0) * sizeof(float));
      continue;
    }
    const uint8_t* row = src + (r0 + r) * bpr;
    for (int64_t b = b0; b < b1; ++b) {
      float d = 0.f, m = 0.f;
      if (b < q.nb) C::decode(row + b * C::type_size, tile.u[r] + (b - b0) * 32, &d, &m);
      else std::memset(tile.u[r] + (b - b0) * 32, C::offset, 32);
      tile.dw[r][b - b0] = d, mw[b] = m;
    }
  }
}

template <typename T>
inline void store(T* dst, float v) { *dst = static_cast<T>(v); }

// fn(t0, NT) for the token tiles of a batch: kTokenTile tokens at a time, then the 1 to 3
// left (NT a std::integral_constant, for the kernels' template argument).
template <typename Fn>
inline void for_token_tiles(int64_t batch, Fn&& fn) {
  int64_t t0 = 0;
  for (; t0 + kTokenTile <= batch; t0 += kTokenTile) fn(t0, std::integral_constant<int, kTokenTile>());
  switch (batch - t0) {
    case 3: fn(t0, std::integral_constant<int, 3>()); break;
    case 2: fn(t0, std::integral_constant<int, 2>()); break;
    case 1: fn(t0, std::integral_constant<int, 1>()); break;
    default: break;
  }
}

// fn(c0, c1) for the chunks of at most `step` that cover 0..total in order (at least one,
// however small the total).
template <typename Fn>
inline void for_chunks(int64_t total, int64_t step, Fn&& fn) {
  int64_t c0 = 0;
  do {
    const int64_t c1 = std::min(total, c0 + step);
    fn(c0, c1);
    c0 = c1;
  } while (c0 < total);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KVPILOT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define KVPILOT_AVX2 __attribute__((target("avx2,fma,f16c")))

// Blocks 2p and 2p+1 of a row as one 64-byte vector of codes in activation order and their
// scales (d16) and mins (m16), each spread over its block's 8 lanes.
struct PairVnni {
  __m512i u;
  __m512 d;
  __m128 dm;   // d0 m0 d1 m1
};

alignas(64) constexpr uint8_t kZeroBlock[64] = {};

template <int Type>
KVPILOT_VNNI inline PairVnni decode_pair_vnni(const uint8_t* b0, const uint8_t* b1) {
  const __m512i spread_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  uint16_t d0, d1, m0 = 0, m1 = 0;
  std::memcpy(&d0, b0, 2), std::memcpy(&d1, b1, 2);
  constexpr bool has_min = Type == Q4_1 || Type == Q5_1;
  if (has_min) std::memcpy(&m0, b0 + 2, 2), std::memcpy(&m1, b1 + 2, 2);
  const __m128 f = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, m1, d1, m0, d0));   // d0 m0 d1 m1
  PairVnni out;
  out.d = _mm512_permutexvar_ps(spread_d, _mm512_castps128_ps512(f));
  out.dm = f;
  if (Type == Q8_0) {
    const __m512i w = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
    out.u = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
    return out;
  }
  constexpr int qoff = Type == Q4_0 ? 2 : Type == Q4_1 ? 4 : Type == Q5_0 ? 6 : 8;
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qoff))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qoff)), 1);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);   // lo0 lo1 hi0 hi1
  out.u = _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));              // lo0 hi0 lo1 hi1
  if (Type == Q5_0 || Type == Q5_1) {     // bit j of qh is bit 4 of code j
    constexpr int hoff = Type == Q5_0 ? 2 : 4;
    uint32_t h0, h1;
    std::memcpy(&h0, b0 + hoff, 4), std::memcpy(&h1, b1 + hoff, 4);
    const __mmask64 high = static_cast<uint64_t>(h0) | (static_cast<uint64_t>(h1) << 32);
    out.u = _mm512_or_si512(out.u, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
  }
  return out;
}

constexpr int64_t kTilePairs = kTileColumns / 64;

// kRowTile rows (n of them real) decoded once per call: one chunk's block pairs
// [kRowTile][chunk pairs], and the whole rows' d0 m0 d1 m1 ... [kRowTile][ni] (zero-padded
// to 16; the mins are added after the last chunk); carry: [token][kRowTile] 16-lane sums
// between chunks (a row of more than one chunk).
struct TileVnni {
  struct Pair {
    __m512i u;
    __m512 d;
  } pair[kRowTile][kTilePairs];
  const int64_t ni;
  AlignedFloats dm, carry;
  TileVnni(const QuantizedX& q, int64_t batch)
      : ni(q.ni), dm(kRowTile * q.ni), carry(q.nbp / 2 > kTilePairs ? kRowTile * batch * 16 : 0) {}
  float* scales(int r) const { return dm.data() + r * ni; }
};

// Pairs p0..p1 (a chunk) of the tile of rows r0.. (n of them real; the others repeat the last).
template <int Type>
KVPILOT_VNNI void decode_tile_vnni(const uint8_t* src, int64_t bpr, int64_t r0, int n, const QuantizedX& q,
                                   int64_t p0, int64_t p1, TileVnni& tile) {
  constexpr int ts = Codes<Type>::type_size;
  for (int r = 0; r < kRowTile; ++r) {
    const uint8_t* row = src + (r0 + std::min(r, n - 1)) * bpr;   // rows past the end repeat the last
    float* dm = tile.scales(r);   // (past 2 * nbp it stays zero from the allocation)
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* b0 = row + 2 * p * ts;
      const uint8_t* b1 = 2 * p + 1 < q.nb ? b0 + ts : kZeroBlock;
      const PairVnni w = decode_pair_vnni<Type>(b0, b1);
      tile.pair[r][p - p0] = {w.u, w.d};
      _mm_store_ps(dm + 4 * p, w.dm);
    }
  }
}

// Tokens t0..t0+NT of a decoded row tile over its chunk of pairs p0..p1: the sums start at
// zero (the first chunk) or from tile.carry, and go back to tile.carry (not the last chunk)
// or, with the mins, to out[t][r] += bias.
template <int Type, int NT, typename T>
KVPILOT_VNNI void dot_tile_vnni(const TileVnni& tile, int n, const QuantizedX& q, int64_t t0, int64_t p0,
                                int64_t p1, const float* bias, int64_t r0, T* out, int64_t rows) {
  using C = Codes<Type>;
  __m512 acc[kRowTile][NT];
  for (int r = 0; r < kRowTile; ++r)
    for (int t = 0; t < NT; ++t)
      acc[r][t] = p0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(tile.carry.data() + ((t0 + t) * kRowTile + r) * 16);
  const __m512i off = _mm512_set1_epi8(static_cast<char>(C::offset));
  for (int64_t p = p0; p < p1; ++p) {
    for (int t = 0; t < NT; ++t) {
      const __m512i a = _mm512_loadu_si512(q.a.data() + (t0 + t) * q.kp + p * 64);
      const __m512 dx = _mm512_loadu_ps(q.dx16.data() + ((t0 + t) * q.nbp + 2 * p) * 8);
      __m512i corr = _mm512_setzero_si512();
      if (C::offset) corr = _mm512_dpbusd_epi32(corr, off, a);
      for (int r = 0; r < kRowTile; ++r) {
        const TileVnni::Pair& w = tile.pair[r][p - p0];
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.u, a);
        if (C::offset) s = _mm512_sub_epi32(s, corr);
        acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), w.d, acc[r][t]);
      }
    }
  }
  if (p1 < q.nbp / 2) {   // more chunks to come
    for (int r = 0; r < kRowTile; ++r)
      for (int t = 0; t < NT; ++t) _mm512_store_ps(tile.carry.data() + ((t0 + t) * kRowTile + r) * 16, acc[r][t]);
    return;
  }
  if (C::has_min)   // sum over blocks of m * dx * sum(a)
    for (int64_t j = 0; j < q.ni; j += 16)
      for (int t = 0; t < NT; ++t) {
        const __m512 sx = _mm512_loadu_ps(q.sxi.data() + (t0 + t) * q.ni + j);
        for (int r = 0; r < kRowTile; ++r)
          acc[r][t] = _mm512_fmadd_ps(_mm512_load_ps(tile.scales(r) + j), sx, acc[r][t]);
      }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < n; ++r)
      store(out + (t0 + t) * rows + r0 + r, _mm512_reduce_add_ps(acc[r][t]) + (bias ? bias[r0 + r] : 0.f));
}

KVPILOT_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int Type, int NT, typename T>
KVPILOT_AVX2 void dot_tile_avx2(const RowTile& tile, int n, const QuantizedX& q, int64_t t0, int64_t b0,
                                int64_t b1, const float* bias, int64_t r0, T* out, int64_t rows) {
  using C = Codes<Type>;
  __m256 acc[kRowTile][NT];
  for (int r = 0; r < kRowTile; ++r)
    for (int t = 0; t < NT; ++t)
      acc[r][t] = b0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(tile.carry.data() + ((t0 + t) * kRowTile + r) * 8);
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i off = _mm256_set1_epi8(static_cast<char>(C::offset == 128 ? 0 : C::offset));
  for (int64_t b = b0; b < b1; ++b) {
    __m256i w[kRowTile];
    __m256 dw[kRowTile];
    for (int r = 0; r < kRowTile; ++r) {
      w[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tile.u[r] + (b - b0) * 32));
      if (C::offset == 128) w[r] = _mm256_xor_si256(w[r], flip);   // back to the signed q
      dw[r] = _mm256_broadcast_ss(tile.dw[r] + (b - b0));
    }
    for (int t = 0; t < NT; ++t) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.a.data() + (t0 + t) * q.kp + b * 32));
      const __m256 dx = _mm256_broadcast_ss(q.dx.data() + (t0 + t) * q.nbp + b);
      __m256i corr = _mm256_setzero_si256();
      if (C::offset && C::offset != 128) corr = _mm256_madd_epi16(_mm256_maddubs_epi16(off, a), ones);
      for (int r = 0; r < kRowTile; ++r) {
        __m256i s;
        if (C::offset == 128)
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[r], w[r]), _mm256_sign_epi8(a, w[r])), ones);
        else
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], a), ones);
        if (C::offset && C::offset != 128) s = _mm256_sub_epi32(s, corr);
        acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dx), dw[r], acc[r][t]);
      }
    }
  }
  if (b1 < q.nbp) {   // more chunks to come
    for (int r = 0; r < kRowTile; ++r)
      for (int t = 0; t < NT; ++t) _mm256_store_ps(tile.carry.data() + ((t0 + t) * kRowTile + r) * 8, acc[r][t]);
    return;
  }
  if (C::has_min)
    for (int64_t j = 0; j < q.ns; j += 8)
      for (int t = 0; t < NT; ++t) {
        const __m256 sx = _mm256_loadu_ps(q.sx.data() + (t0 + t) * q.ns + j);
        for (int r = 0; r < kRowTile; ++r) acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(tile.mins(r) + j), sx, acc[r][t]);
      }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < n; ++r)
      store(out + (t0 + t) * rows + r0 + r, hsum8(acc[r][t]) + (bias ? bias[r0 + r] : 0.f));
}

// ---------------------------------------------------------------------------------------
// The row-interleaved layout (kInterleave rows; llama.cpp repacks Q4_0 similarly): the same
// bytes as kInterleave GGUF rows, rearranged so that one 512-bit VNNI instruction multiplies
// 4 codes of each of 16 rows by the same 4 activation codes, and each row's sum stays in
// its own lane: no tile is decoded and stored, and no horizontal sum is taken. Per group of
// 16 rows and per block along the input, in order:
//   d[16] (the rows' fp16 scales), m[16] (Q4_1 only: the fp16 mins), then the codes in
//   chunks of 64 bytes: chunk j holds, for row r at bytes 4r..4r+3, the row's code bytes
//   4j..4j+3 (Q4: qs bytes, each the values i (low nibble) and i + 16 (high nibble);
//   Q8_0: the signed codes + 128).
// A group's block is 16 x type_size bytes, so an interleaved weight is exactly as large as
// the file's rows. Each token's sum for a row adds the same terms in the same order however
// many tokens a call takes (verification steps match single-token decoding bit for bit).

template <int Type> struct Interleaved;
template <> struct Interleaved<Q4_0> { static constexpr int scales = 1, chunks = 4, offset = 8; };
template <> struct Interleaved<Q4_1> { static constexpr int scales = 2, chunks = 4, offset = 0; };
template <> struct Interleaved<Q8_0> { static constexpr int scales = 1, chunks = 8, offset = 128; };

// forward: rows -> interleaved (true) or back (false); rows a multiple of kInterleave
template <int Type>
void interleave_as(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t bpr, bool forward) {
  using I = Interleaved<Type>;
  constexpr int ts = Codes<Type>::type_size, code_bytes = I::chunks * 4;
  const int64_t nb = bpr / ts;
  at::parallel_for(0, rows / kInterleave, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* group = (forward ? dst : const_cast<uint8_t*>(src)) + g * kInterleave * bpr + b * kInterleave * ts;
        for (int r = 0; r < kInterleave; ++r) {
          uint8_t* row = (forward ? const_cast<uint8_t*>(src) : dst) + (g * kInterleave + r) * bpr + b * ts;
          const uint8_t flip = Type == Q8_0 ? 0x80 : 0;
          for (int s = 0; s < I::scales; ++s) {
            if (forward) std::memcpy(group + s * 32 + r * 2, row + s * 2, 2);
            else std::memcpy(row + s * 2, group + s * 32 + r * 2, 2);
          }
          uint8_t* codes = group + 32 * I::scales;
          for (int k = 0; k < code_bytes; ++k) {
            uint8_t& packed = codes[(k / 4) * 64 + r * 4 + k % 4];
            if (forward) packed = row[2 * I::scales + k] ^ flip;
            else row[2 * I::scales + k] = packed ^ flip;
          }
        }
      }
  });
}

// Row r's block b of an interleaved weight, put back together from its group (scales, then
// codes four bytes at a time) into GGUF's own block layout.
template <int Type>
inline void gather_block(const uint8_t* src, int64_t bpr, int64_t row, int64_t b, uint8_t* block) {
  using I = Interleaved<Type>;
  constexpr int ts = Codes<Type>::type_size, code_bytes = I::chunks * 4;
  const int64_t r = row % kInterleave;
  const uint8_t* group = src + (row - r) * bpr + b * kInterleave * ts;
  const uint8_t* codes = group + 32 * I::scales;
  for (int s = 0; s < I::scales; ++s) std::memcpy(block + s * 2, group + s * 32 + r * 2, 2);
  for (int c = 0; c < I::chunks; ++c) std::memcpy(block + 2 * I::scales + 4 * c, codes + c * 64 + r * 4, 4);
  if (Type == Q8_0)
    for (int k = 0; k < code_bytes; ++k) block[2 * I::scales + k] ^= 0x80;
}

// An interleaved weight's values in Out: every row in the file's order (ids null), or the
// rows ids[0..n-1] in that order (an embedding lookup). Each row's blocks are put back
// together (gather_block) and decoded by the type's own decoder, so the values are
// dequantize(deinterleave(w))'s bit for bit, without the deinterleaved copy (the
// large-batch path decodes its tiles with it).
template <int Type, typename F, typename Out>
void dequantize_interleaved_as(const uint8_t* src, Out* dst, int64_t rows, int64_t bpr, const int64_t* ids) {
  constexpr int ts = Codes<Type>::type_size;
  static_assert(F::type_size == ts && F::block == 32, "a 32-value type with its decoder");
  const int64_t nb = bpr / ts, cols = nb * 32;
  // whole groups: a group's blocks are read together, once (rows: the groups' rows)
  const int64_t units = ids ? rows : rows / kInterleave, per_unit = ids ? 1 : kInterleave;
  at::parallel_for(0, units, std::max<int64_t>(1, grain_rows(bpr) / per_unit), [&](int64_t u0, int64_t u1) {
    alignas(64) uint8_t block[ts];
    alignas(64) float values[32];
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t i = 0; i < per_unit; ++i) {
          const int64_t out_row = u * per_unit + i;
          gather_block<Type>(src, bpr, ids ? ids[u] : out_row, b, block);
          F::decode(block, values);
          store_block(values, 32, dst + out_row * cols + b * 32);
        }
  });
}

// dequantize_interleaved_as for whole groups into float32 on AVX2: a row's block is its code
// words gathered from the group's chunks into one register, widened, scaled and stored, 8
// values at a time (the portable loop above decodes byte by byte, 2.4 G values/s on a Zen 3
// core: 45 ms of a 128-token float32 prefill of SmolLM2-135M). The values are the row
// decoder's: Q4_1 is d * q + m in one rounding as the decoders contract it (-ffast-math; the
// AVX-512 ones call fmadd), Q4_0 and Q8_0 one product. Here groups g0 .. g1 - 1: a function
// of its own, called from dequantize_groups_avx2's parallel loop (a lambda would not carry
// KVPILOT_AVX2's target, and a build for an older CPU would not compile it).
template <int Type>
KVPILOT_AVX2 void dequantize_group_range_avx2(const uint8_t* src, float* dst, int64_t g0, int64_t g1, int64_t bpr) {
  using I = Interleaved<Type>;
  constexpr int ts = Codes<Type>::type_size;
  const int64_t nb = bpr / ts, cols = nb * 32;
  const __m128i low4 = _mm_set1_epi8(0x0F), flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* group = src + g * kInterleave * bpr + b * kInterleave * ts;
      const uint8_t* codes = group + 32 * I::scales;
      for (int r = 0; r < kInterleave; ++r) {
        float* y = dst + (g * kInterleave + r) * cols + b * 32;
        const __m256 d = _mm256_set1_ps(half(group + 2 * r));
        int32_t word[8];
        for (int c = 0; c < I::chunks; ++c) std::memcpy(&word[c], codes + c * 64 + r * 4, 4);
        if (I::chunks == 4) {   // byte k: value k (low nibble) and k + 16 (high)
          const __m128i q = _mm_setr_epi32(word[0], word[1], word[2], word[3]);
          const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
          const __m128i halves[2] = {lo, hi};
          for (int k = 0; k < 4; ++k) {
            __m256i v = _mm256_cvtepu8_epi32(k % 2 ? _mm_srli_si128(halves[k / 2], 8) : halves[k / 2]);
            if (I::offset) v = _mm256_sub_epi32(v, _mm256_set1_epi32(I::offset));
            const __m256 f = _mm256_cvtepi32_ps(v);
            _mm256_storeu_ps(y + 8 * k, I::scales == 2
                                            ? _mm256_fmadd_ps(d, f, _mm256_set1_ps(half(group + 32 + 2 * r)))
                                            : _mm256_mul_ps(d, f));
          }
        } else {                // Q8_0: byte k is value k, stored xor 0x80
          for (int k = 0; k < 2; ++k) {
            const __m128i q = _mm_xor_si128(_mm_setr_epi32(word[4 * k], word[4 * k + 1], word[4 * k + 2],
                                                           word[4 * k + 3]), flip);
            _mm256_storeu_ps(y + 16 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            _mm256_storeu_ps(y + 16 * k + 8,
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
          }
        }
      }
    }
}

template <int Type>
void dequantize_groups_avx2(const uint8_t* src, float* dst, int64_t groups, int64_t bpr) {
  at::parallel_for(0, groups, std::max<int64_t>(1, grain_rows(bpr) / kInterleave), [&](int64_t g0, int64_t g1) {
    dequantize_group_range_avx2<Type>(src, dst, g0, g1, bpr);
  });
}

// The 4 activation codes at p in every int32 lane, broadcast straight from memory (a load,
// not a move from a general register; the sums are integers, so how they are fed never
// changes them). A function of its own: a lambda would not carry KVPILOT_VNNI's target.
KVPILOT_VNNI inline __m512i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The same broadcast in a 256-bit register, for the AVX2 product.
KVPILOT_AVX2 inline __m256i broadcast_word_avx2(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One group's 16 outputs for tokens t0..t0+NT (+ bias), from the interleaved blocks at gp.
template <int Type, int NT, typename T>
KVPILOT_VNNI void interleaved_group(const uint8_t* gp, const QuantizedX& q, int64_t t0, const float* bias,
                                    int64_t r0, T* out, int64_t rows) {
  using I = Interleaved<Type>;
  constexpr int block_bytes = kInterleave * Codes<Type>::type_size;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < q.nb; ++b) {
    const uint8_t* bp = gp + b * block_bytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp)));
    __m512 m = _mm512_setzero_ps();
    if (I::scales == 2) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 32)));
    const uint8_t* cp = bp + 32 * I::scales;
    __m512i w[8];   // w[j] pairs with the activation codes 4j..4j+3 of the block
    if (I::chunks == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(cp + 64 * j);
        w[j] = _mm512_and_si512(v, nibble);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(cp + 64 * j);
    }
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * q.nbp + b;
      const int8_t* a = q.a.data() + (t0 + t) * q.kp + b * 32;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast_word(a));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], broadcast_word(a + 4));
      for (int j = 2; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast_word(a + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1], broadcast_word(a + 4 * j + 4));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      if (I::offset) s = _mm512_sub_epi32(s, _mm512_set1_epi32(I::offset * q.sum[k]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(q.dx[k])), acc[t]);
      if (I::scales == 2) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(q.sx[(t0 + t) * q.ns + b]), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    alignas(64) float v[kInterleave];
    _mm512_store_ps(v, acc[t]);
    T* o = out + (t0 + t) * rows + r0;
    for (int r = 0; r < kInterleave; ++r) store(o + r, v[r] + (bias ? bias[r0 + r] : 0.f));
  }
}

// Bytes ahead of the block in hand that the AVX2 tiles ask the cache for. A core decoding
// one token is compute-bound at about 20 GB/s with its weights in cache but made 10-14 GB/s
// out of memory: the hardware prefetcher alone left it waiting. With 4 KiB (SmolLM2-135M's
// matrices at 1 token, 2 threads of a Zen 3 EPYC): 2.81 against 3.31 ms a pass; 1 KiB and 2
// KiB did as well with 2 threads, 4 KiB best with 1; nothing changed at 4 tokens.
constexpr int kPrefetchAhead = 4096;

// One half (h: rows 8h..8h+7) of an interleaved block's codes at cp, as the AVX2 products
// multiply them: w[j] pairs with the activation codes 4j..4j+3 (Q8_0: the signed codes).
template <int Type>
KVPILOT_AVX2 inline void unpack_half_avx2(const uint8_t* cp, int h, __m256i* w) {
  if (Interleaved<Type>::chunks == 4) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * j + 32 * h));
      w[j] = _mm256_and_si256(v, nibble);
      w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j)
      w[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * j + 32 * h)), flip);
  }
}

// The 8 rows' integer sums of one half's codes w times a token's activation words av[j]
// (each broadcast to every lane); sum: that token's block sum of codes (Q4_0's offset).
// Q4: each code byte pair times its activations is at most 2 x 15 x 127, so all 8 products
// of a block add up in int16 (at most 30,480) before one madd widens them. Q8_0: |q| times
// sign(q) * a, each chunk's int16 pairs widened at once (2 x 128 x 127 leaves no room for a
// second).
template <int Type>
KVPILOT_AVX2 inline __m256i half_sums_avx2(const __m256i* w, const __m256i* av, int32_t sum) {
  using I = Interleaved<Type>;
  const __m256i ones = _mm256_set1_epi16(1);
  if (I::chunks == 4) {
    __m256i p = _mm256_maddubs_epi16(w[0], av[0]);
    for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], av[j]));
    __m256i s = _mm256_madd_epi16(p, ones);
    if (I::offset) s = _mm256_sub_epi32(s, _mm256_set1_epi32(I::offset * sum));
    return s;
  }
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j)
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]),
                                                                    _mm256_sign_epi8(av[j], w[j])),
                                              ones));
  return s;
}

// The same product on AVX2 (no VNNI): a 256-bit register holds 8 rows' int32 lanes, so a
// group is two halves, and maddubs + madd stand in for dpbusd (half_sums_avx2). The integer
// sums are the VNNI kernel's exactly and the float terms are added in its order, so the
// outputs are its bits.
template <int Type, int NT, typename T>
KVPILOT_AVX2 void interleaved_tile_avx2(const uint8_t* gp, const QuantizedX& q, int64_t t0, const float* bias,
                                        int64_t r0, T* out, int64_t rows) {
  using I = Interleaved<Type>;
  constexpr int block_bytes = kInterleave * Codes<Type>::type_size;
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < q.nb; ++b) {
    const uint8_t* bp = gp + b * block_bytes;
    for (int l = 0; l < block_bytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(bp + kPrefetchAhead + l), _MM_HINT_T0);
    __m256 d[2], m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * h)));
      if (I::scales == 2) m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 32 + 16 * h)));
    }
    const uint8_t* cp = bp + 32 * I::scales;
    __m256i w[2][8];   // w[h]: half h's codes (unpack_half_avx2)
    for (int h = 0; h < 2; ++h) unpack_half_avx2<Type>(cp, h, w[h]);
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * q.nbp + b;
      const int8_t* a = q.a.data() + (t0 + t) * q.kp + b * 32;
      __m256i av[8];
      for (int j = 0; j < 8; ++j) av[j] = broadcast_word_avx2(a + 4 * j);
      const __m256 dx = _mm256_set1_ps(q.dx[k]);
      for (int h = 0; h < 2; ++h) {
        const __m256i s = half_sums_avx2<Type>(w[h], av, I::offset ? q.sum[k] : 0);
        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d[h], dx), acc[t][h]);
        if (I::scales == 2) acc[t][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(q.sx[(t0 + t) * q.ns + b]), acc[t][h]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    alignas(32) float v[kInterleave];
    _mm256_store_ps(v, acc[t][0]);
    _mm256_store_ps(v + 8, acc[t][1]);
    T* o = out + (t0 + t) * rows + r0;
    for (int r = 0; r < kInterleave; ++r) store(o + r, v[r] + (bias ? bias[r0 + r] : 0.f));
  }
}

// Batches of more than kAvx2ChunkFrom - 1 tokens take the AVX2 product below instead of
// the tiles above, kAvx2TokenChunk tokens at a time (their float sums, 32 bytes a token and
// half-group, live in L1 on the stack).
constexpr int64_t kAvx2ChunkFrom = 9, kAvx2TokenChunk = 64;

// The tiles' product for larger batches, one half (h) of a group. AVX2 has 16 vector
// registers, which one block's two halves of codes alone fill, so the tiles spill them:
// here a half's codes are unpacked once per block into 8 registers and multiplied into
// every token of the chunk (tokens t0..t0+nt), whose sums wait in L1 (acc) between blocks.
// Per token and half the sums are the same terms in the same order as the tiles', so the
// same bits. A function of its own, not inlined: GCC at -O3 otherwise jams the two halves
// into one loop, and their codes spill again. On a 2-core AVX2 EPYC, SmolLM2-135M's
// matrices at 32 tokens: 34 against 39 ms a pass; at 1 to 4 tokens the tiles are 10-20%
// faster, at 8 the two are even.
template <int Type, typename T>
KVPILOT_AVX2 __attribute__((noinline)) void interleaved_half_avx2(const uint8_t* gp, const QuantizedX& q, int64_t t0,
                                                                  int64_t nt, int h, const float* bias, int64_t r0,
                                                                  T* out, int64_t rows) {
  using I = Interleaved<Type>;
  constexpr int block_bytes = kInterleave * Codes<Type>::type_size;
  alignas(32) __m256 acc[kAvx2TokenChunk];
  for (int64_t t = 0; t < nt; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < q.nb; ++b) {
    const uint8_t* bp = gp + b * block_bytes;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * h)));
    __m256 m = _mm256_setzero_ps();
    if (I::scales == 2) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 32 + 16 * h)));
    const uint8_t* cp = bp + 32 * I::scales;
    __m256i w[8];
    unpack_half_avx2<Type>(cp, h, w);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t k = (t0 + t) * q.nbp + b;
      const int8_t* a = q.a.data() + (t0 + t) * q.kp + b * 32;
      __m256i av[8];
      for (int j = 0; j < 8; ++j) av[j] = broadcast_word_avx2(a + 4 * j);
      const __m256i s = half_sums_avx2<Type>(w, av, I::offset ? q.sum[k] : 0);
      __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(q.dx[k])), acc[t]);
      if (I::scales == 2) sum = _mm256_fmadd_ps(m, _mm256_set1_ps(q.sx[(t0 + t) * q.ns + b]), sum);
      acc[t] = sum;
    }
  }
  for (int64_t t = 0; t < nt; ++t) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc[t]);
    T* o = out + (t0 + t) * rows + r0 + 8 * h;
    for (int r = 0; r < 8; ++r) store(o + r, v[r] + (bias ? bias[r0 + 8 * h + r] : 0.f));
  }
}

template <int Type, typename T>
KVPILOT_AVX2 void interleaved_chunk_avx2(const uint8_t* gp, const QuantizedX& q, int64_t t0, int64_t nt,
                                         const float* bias, int64_t r0, T* out, int64_t rows) {
  for (int h = 0; h < 2; ++h) interleaved_half_avx2<Type, T>(gp, q, t0, nt, h, bias, r0, out, rows);
}

template <int Type, typename T>
void matmul_interleaved_as(const QuantizedX& q, const uint8_t* w, int64_t rows, int64_t bpr, int64_t batch,
                           const float* bias, T* out, int64_t isa) {
  const int64_t groups = rows / kInterleave, group_bytes = kInterleave * bpr;
  const int64_t work = group_bytes * ((batch + kTokenTile - 1) / kTokenTile);
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(work, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = w + g * group_bytes;
      const int64_t r0 = g * kInterleave;
      if (isa == kIsaVnni)
        for_token_tiles(batch, [&](int64_t t0, auto nt) {
          interleaved_group<Type, decltype(nt)::value, T>(gp, q, t0, bias, r0, out, rows);
        });
      else if (batch < kAvx2ChunkFrom)
        for_token_tiles(batch, [&](int64_t t0, auto nt) {
          interleaved_tile_avx2<Type, decltype(nt)::value, T>(gp, q, t0, bias, r0, out, rows);
        });
      else
        for (int64_t t0 = 0; t0 < batch; t0 += kAvx2TokenChunk)
          interleaved_chunk_avx2<Type, T>(gp, q, t0, std::min(kAvx2TokenChunk, batch - t0), bias, r0, out, rows);
    }
  });
}

// Float activations times an interleaved weight (AVX2, so every CPU with the layout runs it):
// the float path for the few rows of a prompt step (the LM head's sampling rows, a short
// prompt remainder after a prefix hit) in a float32 model, where decoding the whole weight
// into tiles for F.linear would cost more than the product. Per block and row, sum(code * x)
// in float32, then d times it (Q4_0: minus 8 sum(x); Q4_1: plus m sum(x)): the file's
// values times x to float32 rounding, no 8-bit activations.
template <int Type, int NT>
KVPILOT_AVX2 void interleaved_float_group(const uint8_t* gp, const float* x, const float* xsum, int64_t nb,
                                          int64_t cols, int64_t t0, const float* bias, int64_t r0, float* out,
                                          int64_t rows) {
  using I = Interleaved<Type>;
  constexpr int block_bytes = kInterleave * Codes<Type>::type_size;
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0x0F), low8 = _mm256_set1_epi32(0xFF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = gp + b * block_bytes;
    const uint8_t* cp = bp + 32 * I::scales;
    for (int h = 0; h < 2; ++h) {
      __m256 s[NT];
      for (int t = 0; t < NT; ++t) s[t] = _mm256_setzero_ps();
      for (int j = 0; j < I::chunks; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 64 * j + 32 * h));
        for (int k = 0; k < 4; ++k) {
          if (I::chunks == 4) {   // byte 4j + k: value 4j + k (low nibble) and 4j + k + 16 (high)
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * k), low4));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * k + 4), low4));
            for (int t = 0; t < NT; ++t) {
              const float* xb = x + (t0 + t) * cols + b * 32 + 4 * j + k;
              s[t] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xb), s[t]);
              s[t] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xb + 16), s[t]);
            }
          } else {                // byte 4j + k: value 4j + k, stored + 128
            const __m256 c = _mm256_cvtepi32_ps(_mm256_sub_epi32(
                _mm256_and_si256(_mm256_srli_epi32(v, 8 * k), low8), _mm256_set1_epi32(128)));
            for (int t = 0; t < NT; ++t)
              s[t] = _mm256_fmadd_ps(c, _mm256_broadcast_ss(x + (t0 + t) * cols + b * 32 + 4 * j + k), s[t]);
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * h)));
      for (int t = 0; t < NT; ++t) {
        const __m256 sx = _mm256_set1_ps(xsum[(t0 + t) * nb + b]);
        if (I::offset == 8) s[t] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sx, s[t]);
        acc[t][h] = _mm256_fmadd_ps(d, s[t], acc[t][h]);
        if (I::scales == 2) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 32 + 16 * h)));
          acc[t][h] = _mm256_fmadd_ps(m, sx, acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    alignas(32) float v[kInterleave];
    _mm256_store_ps(v, acc[t][0]);
    _mm256_store_ps(v + 8, acc[t][1]);
    float* o = out + (t0 + t) * rows + r0;
    for (int r = 0; r < kInterleave; ++r) o[r] = v[r] + (bias ? bias[r0 + r] : 0.f);
  }
}

template <int Type>
void matmul_interleaved_float_as(const float* x, const uint8_t* w, int64_t rows, int64_t bpr, int64_t batch,
                                 int64_t cols, const float* bias, float* out) {
  const int64_t nb = cols / 32, groups = rows / kInterleave, group_bytes = kInterleave * bpr;
  std::vector<float> xsum(batch * nb);   // each block's sum of x (the offset's and the min's term)
  for (int64_t t = 0; t < batch; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += x[t * cols + b * 32 + i];
      xsum[t * nb + b] = s;
    }
  const int64_t work = group_bytes * ((batch + kTokenTile - 1) / kTokenTile);
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(work, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for_token_tiles(batch, [&](int64_t t0, auto nt) {
        interleaved_float_group<Type, decltype(nt)::value>(w + g * group_bytes, x, xsum.data(), nb, cols, t0, bias,
                                                           g * kInterleave, out, rows);
      });
  });
}
#endif

int64_t resolve_isa(int64_t isa) {
  const bool vnni = cpu_has_vnni(), avx2 = cpu_has_avx2();
  if (isa == kIsaBest) return vnni ? kIsaVnni : avx2 ? kIsaAvx2 : -1;
  TORCH_CHECK(isa == kIsaVnni || isa == kIsaAvx2, "isa must be 0 (best), 1 (AVX512-VNNI) or 2 (AVX2)");
  TORCH_CHECK(isa == kIsaVnni ? vnni : avx2, "this CPU lacks ", isa == kIsaVnni ? "AVX512-VNNI" : "AVX2");
  return isa;
}


template <int Type, typename T>
void matmul_q8_as(const QuantizedX& q, const uint8_t* src, int64_t rows, int64_t bpr, int64_t batch,
                  const float* bias, T* out, int64_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  const int64_t work = kRowTile * bpr * ((batch + kTokenTile - 1) / kTokenTile);
  const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(work, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t i0, int64_t i1) {
    if (isa == kIsaVnni) {
      std::unique_ptr<TileVnni> tile(new TileVnni(q, batch));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r0 = i * kRowTile;
        const int n = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
        for_chunks(q.nbp / 2, kTilePairs, [&](int64_t p0, int64_t p1) {
          decode_tile_vnni<Type>(src, bpr, r0, n, q, p0, p1, *tile);
          for_token_tiles(batch, [&](int64_t t0, auto nt) {
            dot_tile_vnni<Type, decltype(nt)::value, T>(*tile, n, q, t0, p0, p1, bias, r0, out, rows);
          });
        });
      }
      return;
    }
    std::unique_ptr<RowTile> tile(new RowTile(q, batch));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r0 = i * kRowTile;
      const int n = static_cast<int>(std::min<int64_t>(kRowTile, rows - r0));
      for_chunks(q.nbp, kTileBlocks, [&](int64_t b0, int64_t b1) {
        decode_tile<Type>(src, bpr, r0, n, q, b0, b1, *tile);
        for_token_tiles(batch, [&](int64_t t0, auto nt) {
          dot_tile_avx2<Type, decltype(nt)::value, T>(*tile, n, q, t0, b0, b1, bias, r0, out, rows);
        });
      });
    }
  });
#else
  TORCH_CHECK(false, "the q8 path needs an x86-64 CPU");
#endif
}

// The interleaved layout's product for a type it takes.
template <typename T>
void matmul_interleaved(int64_t qtype, const QuantizedX& q, const uint8_t* src, int64_t rows, int64_t bpr,
                        int64_t batch, const float* bias, T* dst, int64_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (qtype) {
    case Q4_0: matmul_interleaved_as<Q4_0, T>(q, src, rows, bpr, batch, bias, dst, isa); break;
    case Q4_1: matmul_interleaved_as<Q4_1, T>(q, src, rows, bpr, batch, bias, dst, isa); break;
    case Q8_0: matmul_interleaved_as<Q8_0, T>(q, src, rows, bpr, batch, bias, dst, isa); break;
    default: TORCH_CHECK(false, "no interleaved layout for ggml type ", qtype);
  }
#else
  TORCH_CHECK(false, "the interleaved layout needs an x86-64 CPU");
#endif
}

// isa: kIsaVnni or kIsaAvx2; interleaved: the weight in the interleaved layout.
template <typename T>
torch::Tensor matmul_q8_typed(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype,
                              const c10::optional<torch::Tensor>& bias, int64_t isa, bool interleaved) {
  const int64_t batch = x.size(0), cols = x.size(1), rows = w.size(0), bpr = w.size(1);
  QuantizedX q;
  quantize_rows<T>(x.data_ptr<T>(), batch, cols, q);
  auto out = torch::empty({batch, rows}, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  T* dst = out.data_ptr<T>();
  const uint8_t* src = w.data_ptr<uint8_t>();
  if (interleaved) {
    matmul_interleaved<T>(qtype, q, src, rows, bpr, batch, b, dst, isa);
    return out;
  }
  switch (qtype) {
    case Q4_0: matmul_q8_as<Q4_0, T>(q, src, rows, bpr, batch, b, dst, isa); break;
    case Q4_1: matmul_q8_as<Q4_1, T>(q, src, rows, bpr, batch, b, dst, isa); break;
    case Q5_0: matmul_q8_as<Q5_0, T>(q, src, rows, bpr, batch, b, dst, isa); break;
    case Q5_1: matmul_q8_as<Q5_1, T>(q, src, rows, bpr, batch, b, dst, isa); break;
    case Q8_0: matmul_q8_as<Q8_0, T>(q, src, rows, bpr, batch, b, dst, isa); break;
    default: TORCH_CHECK(false, "no q8 path for ggml type ", qtype);
  }
  return out;
}

int64_t q8_type_size(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return Codes<Q4_0>::type_size;
    case Q4_1: return Codes<Q4_1>::type_size;
    case Q5_0: return Codes<Q5_0>::type_size;
    case Q5_1: return Codes<Q5_1>::type_size;
    case Q8_0: return Codes<Q8_0>::type_size;
    default: return 0;
  }
}

int64_t interleaved_type_size(int64_t qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 ? q8_type_size(qtype) : 0;
}

}  // namespace

torch::Tensor dequantize(torch::Tensor w, int64_t qtype, at::ScalarType dtype) {
#define KVPILOT_CALL(F) dequantize_as<F>(w, dtype)
  KVPILOT_GGUF_DISPATCH(qtype, KVPILOT_CALL)
#undef KVPILOT_CALL
}

torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t qtype) {
#define KVPILOT_CALL(F) matmul_as<F>(x, w)
  KVPILOT_GGUF_DISPATCH(qtype, KVPILOT_CALL)
#undef KVPILOT_CALL
}

// x [batch, columns] float32/bfloat16/float16 times the weight's transpose through q8
// activations (see above), plus bias (float32 [rows]) if given: [batch, rows] in x's dtype.
torch::Tensor matmul_q8(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias,
                        int64_t isa) {
  const int64_t type_size = q8_type_size(qtype);
  TORCH_CHECK(type_size, "no q8 path for ggml type ", qtype);
  const int64_t cols = check_weight(w, type_size, 32);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [batch, columns] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns; the weight has ", cols);
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == w.size(0),
                        "the bias must be float32 [rows]");
  const int64_t chosen = resolve_isa(isa);
  TORCH_CHECK(chosen > 0, "the q8 path needs AVX2 or AVX512-VNNI");
  switch (x.scalar_type()) {
    case torch::kFloat32: return matmul_q8_typed<float>(x, w, qtype, bias, chosen, false);
    case torch::kBFloat16: return matmul_q8_typed<c10::BFloat16>(x, w, qtype, bias, chosen, false);
    case torch::kHalf: return matmul_q8_typed<c10::Half>(x, w, qtype, bias, chosen, false);
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
}

// GGUF rows [rows, bytes per row] of Q4_0, Q4_1 or Q8_0 (rows a multiple of 16) in the
// interleaved layout (forward) or interleaved bytes back to rows (not forward).
torch::Tensor interleave(torch::Tensor w, int64_t qtype, bool forward) {
  const int64_t type_size = interleaved_type_size(qtype);
  TORCH_CHECK(type_size, "no interleaved layout for ggml type ", qtype);
  check_weight(w, type_size, 32);
  TORCH_CHECK(w.size(0) % kInterleave == 0, "the interleaved layout takes a multiple of ", kInterleave, " rows; got ",
              w.size(0));
  auto src = w.contiguous();
  auto out = torch::empty_like(src);
#if defined(__x86_64__) && defined(__GNUC__)
  const uint8_t* from = src.data_ptr<uint8_t>();
  uint8_t* to = out.data_ptr<uint8_t>();
  switch (qtype) {
    case Q4_0: interleave_as<Q4_0>(from, to, w.size(0), w.size(1), forward); break;
    case Q4_1: interleave_as<Q4_1>(from, to, w.size(0), w.size(1), forward); break;
    default: interleave_as<Q8_0>(from, to, w.size(0), w.size(1), forward); break;
  }
#else
  TORCH_CHECK(false, "the interleaved layout needs an x86-64 CPU");
#endif
  return out;
}

// The values of an interleaved Q4_0, Q4_1 or Q8_0 weight, [rows, columns] of dtype in the
// file's row order: dequantize(interleave(w, qtype, false), qtype, dtype) without the copy;
// with row_ids, only those rows ([len(row_ids), columns], in their order).
torch::Tensor dequantize_interleaved(torch::Tensor w, int64_t qtype, at::ScalarType dtype,
                                     c10::optional<torch::Tensor> row_ids) {
  const int64_t type_size = interleaved_type_size(qtype);
  TORCH_CHECK(type_size, "no interleaved layout for ggml type ", qtype);
  const int64_t cols = check_weight(w, type_size, 32), bpr = w.size(1);
  TORCH_CHECK(w.size(0) % kInterleave == 0, "an interleaved weight has a multiple of ", kInterleave, " rows");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "dequantize writes float32, bfloat16 or float16; got ", dtype);
  const int64_t* ids = nullptr;
  int64_t rows = w.size(0);
  if (row_ids) {
    TORCH_CHECK(row_ids->device().is_cpu() && row_ids->scalar_type() == torch::kInt64 && row_ids->dim() == 1 &&
                    row_ids->is_contiguous(),
                "row ids must be a contiguous CPU int64 vector");
    ids = row_ids->data_ptr<int64_t>();
    rows = row_ids->numel();
    for (int64_t i = 0; i < rows; ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < w.size(0), "row id ", ids[i], " is outside the weight's ", w.size(0), " rows");
  }
  auto out = torch::empty({rows, cols}, torch::TensorOptions().dtype(dtype));
#if defined(__x86_64__) && defined(__GNUC__)
  const uint8_t* src = w.data_ptr<uint8_t>();
  if (!ids && dtype == torch::kFloat32 && cpu_has_avx2()) {   // whole groups into float32: the AVX2 decoder
    float* dst = out.data_ptr<float>();
    switch (qtype) {
      case Q4_0: dequantize_groups_avx2<Q4_0>(src, dst, rows / kInterleave, bpr); break;
      case Q4_1: dequantize_groups_avx2<Q4_1>(src, dst, rows / kInterleave, bpr); break;
      default: dequantize_groups_avx2<Q8_0>(src, dst, rows / kInterleave, bpr); break;
    }
    return out;
  }
  auto typed = [&](auto* dst) {
    switch (qtype) {
      case Q4_0: return dequantize_interleaved_as<Q4_0, FQ4_0>(src, dst, rows, bpr, ids);
      case Q4_1: return dequantize_interleaved_as<Q4_1, FQ4_1>(src, dst, rows, bpr, ids);
      default: return dequantize_interleaved_as<Q8_0, FQ8_0>(src, dst, rows, bpr, ids);
    }
  };
  switch (dtype) {
    case torch::kFloat32: typed(out.data_ptr<float>()); break;
    case torch::kBFloat16: typed(out.data_ptr<c10::BFloat16>()); break;
    default: typed(out.data_ptr<c10::Half>()); break;
  }
#else
  TORCH_CHECK(false, "the interleaved layout needs an x86-64 CPU");
#endif
  return out;
}

// x [batch, columns] times an interleaved weight's transpose through q8 activations (isa as
// matmul_q8's: AVX512-VNNI or AVX2, the same bits either way).
torch::Tensor matmul_q8_interleaved(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias,
                                    int64_t isa) {
  const int64_t type_size = interleaved_type_size(qtype);
  TORCH_CHECK(type_size, "no interleaved layout for ggml type ", qtype);
  const int64_t cols = check_weight(w, type_size, 32);
  TORCH_CHECK(w.size(0) % kInterleave == 0, "an interleaved weight has a multiple of ", kInterleave, " rows");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [batch, columns] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns; the weight has ", cols);
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == w.size(0),
                        "the bias must be float32 [rows]");
  const int64_t chosen = resolve_isa(isa);
  TORCH_CHECK(chosen > 0, "the interleaved layout needs AVX2 or AVX512-VNNI");
  switch (x.scalar_type()) {
    case torch::kFloat32: return matmul_q8_typed<float>(x, w, qtype, bias, chosen, true);
    case torch::kBFloat16: return matmul_q8_typed<c10::BFloat16>(x, w, qtype, bias, chosen, true);
    case torch::kHalf: return matmul_q8_typed<c10::Half>(x, w, qtype, bias, chosen, true);
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
}

// x [batch, columns] float32 times an interleaved weight's transpose in float32 (no 8-bit
// activations; AVX2), plus bias (float32 [rows]) if given: float32 [batch, rows].
torch::Tensor matmul_interleaved_float(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                       c10::optional<torch::Tensor> bias) {
  const int64_t type_size = interleaved_type_size(qtype);
  TORCH_CHECK(type_size, "no interleaved layout for ggml type ", qtype);
  const int64_t cols = check_weight(w, type_size, 32);
  TORCH_CHECK(w.size(0) % kInterleave == 0, "an interleaved weight has a multiple of ", kInterleave, " rows");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "x must be a contiguous float32 CPU [batch, columns] tensor");
  TORCH_CHECK(x.size(1) == cols, "x has ", x.size(1), " columns; the weight has ", cols);
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == w.size(0),
                        "the bias must be float32 [rows]");
  TORCH_CHECK(cpu_has_avx2(), "the interleaved float product needs AVX2");
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
#if defined(__x86_64__) && defined(__GNUC__)
  const float* xp = x.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t rows = w.size(0), bpr = w.size(1), batch = x.size(0);
  switch (qtype) {
    case Q4_0: matmul_interleaved_float_as<Q4_0>(xp, src, rows, bpr, batch, cols, b, dst); break;
    case Q4_1: matmul_interleaved_float_as<Q4_1>(xp, src, rows, bpr, batch, cols, b, dst); break;
    default: matmul_interleaved_float_as<Q8_0>(xp, src, rows, bpr, batch, cols, b, dst); break;
  }
#endif
  return out;
}

// The q8 path's instruction set here: 1 AVX512-VNNI, 2 AVX2, 0 none.
int64_t q8_isa() {
  const int64_t isa = resolve_isa(kIsaBest);
  return isa < 0 ? 0 : isa;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "GGUF block bytes [rows, bytes per row] -> [rows, columns] of dtype",
        py::arg("w"), py::arg("qtype"), py::arg("dtype") = torch::kFloat32);
  m.def("matmul_q8", &matmul_q8, "x [batch, columns] @ weight^T through q8 activations -> [batch, rows] in x's dtype",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("isa") = 0);
  m.def("interleave", &interleave, "GGUF rows -> the interleaved layout (forward) or back",
        py::arg("w"), py::arg("qtype"), py::arg("forward") = true);
  m.def("dequantize_interleaved", &dequantize_interleaved,
        "an interleaved weight -> [rows, columns] of dtype in the file's row order (or the rows row_ids)",
        py::arg("w"), py::arg("qtype"), py::arg("dtype") = torch::kFloat32, py::arg("row_ids") = py::none());
  m.def("matmul_q8_interleaved", &matmul_q8_interleaved,
        "x [batch, columns] @ interleaved weight^T through q8 activations -> [batch, rows] in x's dtype",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("isa") = 0);
  m.def("matmul_interleaved_float", &matmul_interleaved_float,
        "x [batch, columns] float32 @ interleaved weight^T in float32 -> float32 [batch, rows]",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias") = py::none());
  m.def("q8_isa", &q8_isa, "the q8 path's instruction set on this CPU: 1 AVX512-VNNI, 2 AVX2, 0 none");
  m.def("matmul", &matmul, "x [batch, columns] float32 @ dequantize(weight)^T -> float32 [batch, rows]");
  m.def("entry_points", [] {
    py::dict d;
    d["matmul_q8"] = entry_points::wrap<entry_points::MatmulQ8>(&matmul_q8, entry_points::kMatmulQ8);
    d["matmul_q8_interleaved"] = entry_points::wrap<entry_points::MatmulQ8Interleaved>(
        &matmul_q8_interleaved, entry_points::kMatmulQ8Interleaved);
    return d;
  }, "the q8 matmuls as capsules, for another kernel module's native calls (entry_points.h)");
}
