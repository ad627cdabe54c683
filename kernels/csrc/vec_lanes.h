// Vector lanes of the CPU kernels: GCC vector extensions sized to the build's ISA (16 float
// lanes with AVX-512, 8 with AVX2, 4 otherwise), and their loads and stores of float32 and
// bfloat16 rows. bfloat16 is converted by bits: widening is exact, narrowing rounds to
// nearest even and keeps NaN quiet (0x7FC0), as c10::BFloat16 does, so a lane holds the
// bits the scalar conversion gives. Included by each kernel's single source file; the
// kernel builds hash this header into their flags (kvpilot.kernels.paged_decode_cpu's
// isa_variant), so a change here rebuilds them.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace vec_lanes {

#if defined(__AVX512F__)
constexpr int64_t kVecLanes = 16;
#elif defined(__AVX2__)
constexpr int64_t kVecLanes = 8;
#else
constexpr int64_t kVecLanes = 4;
#endif
typedef float VecF __attribute__((vector_size(kVecLanes * 4)));
typedef int32_t VecI __attribute__((vector_size(kVecLanes * 4)));
typedef uint32_t VecU __attribute__((vector_size(kVecLanes * 4)));
typedef uint16_t VecH __attribute__((vector_size(kVecLanes * 2)));

inline VecF load_lanes(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_lanes(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
inline VecF round_lanes(VecF v, float*) { return v; }   // float32 rows keep every bit

inline VecF load_lanes(const c10::BFloat16* p) {
  VecH h;
  std::memcpy(&h, p, sizeof(h));
  const VecU u = __builtin_convertvector(h, VecU) << 16;
  return reinterpret_cast<const VecF&>(u);
}
inline VecU bf16_bits(VecF v) {   // round to nearest even, NaN -> 0x7FC0
  const VecU u = reinterpret_cast<const VecU&>(v);
  const VecU rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? VecU{} + 0x7FC0u : rounded;
}
inline void store_lanes(c10::BFloat16* p, VecF v) {
  const VecH h = __builtin_convertvector(bf16_bits(v), VecH);
  std::memcpy(p, &h, sizeof(h));
}
inline VecF round_lanes(VecF v, c10::BFloat16*) {   // what a bfloat16 store and load give
  const VecU u = bf16_bits(v) << 16;
  return reinterpret_cast<const VecF&>(u);
}

}  // namespace vec_lanes
