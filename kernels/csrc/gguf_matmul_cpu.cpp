// GGUF (ggml) block-quantized weights on CPU: decode and multiply without a dequantized copy.
//
// A weight is its GGUF bytes as the file holds them, one row per output feature:
// uint8 [rows, blocks_per_row * type_size], the blocks running along the input dimension.
// `matmul` decodes one block of one row at a time into a float buffer (at most 256 values,
// in L1) and accumulates its dot product with every activation row, so each weight byte is
// read once per call whatever the batch; `dequantize` writes float32 rows (the reference
// and the large-batch path, which multiplies a few rows at a time). Block layouts follow
// ggml-quants.c (dequantize_row_*); the type ids are ggml's (GGMLQuantizationType).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
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

template <typename F>
torch::Tensor dequantize_as(const torch::Tensor& w) {
  const int64_t cols = check_weight(w, F::type_size, F::block), rows = w.size(0), bpr = w.size(1);
  auto out = torch::empty({rows, cols}, torch::kFloat32);
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(bpr), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < cols / F::block; ++b)
        F::decode(src + r * bpr + b * F::type_size, dst + r * cols + b * F::block);
  });
  return out;
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
  at::parallel_for(0, rows, grain_rows(bpr), [&](int64_t r0, int64_t r1) {
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

}  // namespace

torch::Tensor dequantize(torch::Tensor w, int64_t qtype) {
#define KVPILOT_CALL(F) dequantize_as<F>(w)
  KVPILOT_GGUF_DISPATCH(qtype, KVPILOT_CALL)
#undef KVPILOT_CALL
}

torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t qtype) {
#define KVPILOT_CALL(F) matmul_as<F>(x, w)
  KVPILOT_GGUF_DISPATCH(qtype, KVPILOT_CALL)
#undef KVPILOT_CALL
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "GGUF block bytes [rows, bytes per row] -> float32 [rows, columns]");
  m.def("matmul", &matmul, "x [batch, columns] float32 @ dequantize(weight)^T -> float32 [batch, rows]");
}
