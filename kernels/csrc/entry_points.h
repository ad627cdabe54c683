// Entry points one CPU kernel module hands another in the same process.
//
// Each kernel module keeps its own compiler flags (the layer ops round like torch, the
// matmul and attention kernels use -ffast-math), so a caller that wants several of them in
// one native call (the fused decode step, fused_decode_cpu.cpp) takes their functions from
// the loaded modules instead of compiling their sources again with other flags. A module's
// `entry_points()` returns a dict of PyCapsules, each named after its signature below, so
// a capsule handed to the wrong slot is refused by name instead of called.

#pragma once

#include <torch/extension.h>

#include <vector>

namespace entry_points {

using MatmulQ8 = torch::Tensor (*)(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                   c10::optional<torch::Tensor> bias, int64_t isa);
using MatmulQ8Interleaved = torch::Tensor (*)(torch::Tensor x, torch::Tensor w, int64_t qtype,
                                              c10::optional<torch::Tensor> bias, int64_t isa);
using AddRmsNorm = std::vector<torch::Tensor> (*)(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                  torch::Tensor weight, double eps);
using RotaryInplace = void (*)(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                               torch::Tensor sin, int64_t rotary_dim);
using SiluMul = torch::Tensor (*)(torch::Tensor gate_up);
using StoreKv = void (*)(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                         torch::Tensor slot_mapping, int64_t num_tokens);
using PagedDecode = torch::Tensor (*)(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, int64_t sliding_window,
                                      double scale);

// The capsule names: the entry point's name and its signature's version.
constexpr const char* kMatmulQ8 = "kvpilot.matmul_q8/1";
constexpr const char* kMatmulQ8Interleaved = "kvpilot.matmul_q8_interleaved/2";
constexpr const char* kAddRmsNorm = "kvpilot.add_rms_norm/1";
constexpr const char* kGemmaRmsNorm = "kvpilot.gemma_rms_norm/1";   // an AddRmsNorm: the weight is `1 + w` in float32
constexpr const char* kRotaryInplace = "kvpilot.rotary_inplace/1";
constexpr const char* kSiluMul = "kvpilot.silu_mul/1";
constexpr const char* kStoreKv = "kvpilot.store_kv/1";
constexpr const char* kPagedDecode = "kvpilot.paged_decode/1";

template <typename Fn>
py::capsule wrap(Fn fn, const char* name) {
  return py::capsule(reinterpret_cast<void*>(fn), name);
}

// The function in `capsule`, which must carry `name` (a TypeError otherwise).
template <typename Fn>
Fn unwrap(const py::handle& capsule, const char* name) {
  void* ptr = PyCapsule_GetPointer(capsule.ptr(), name);
  if (ptr == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string("expected a capsule named ") + name);
  }
  return reinterpret_cast<Fn>(ptr);
}

}  // namespace entry_points
