// A decode step's decoder layers in one native call (Llama family on CPU: GGUF q8 weights, or
// bfloat16 weights prepacked for oneDNN).
//
// A single-stream decode step of a small model spends more time in Python, between the
// kernels, than in them: a layer is about ten calls (norm, q/k/v, rotary, KV store,
// attention, o, norm, gate/up, SiLU * up, down), each through a module, a launcher and
// pybind. `DecodeLayers` holds every layer's weights and runs them all in one call, calling
// the same kernels the Python path calls (taken from their modules as entry points,
// entry_points.h, so each keeps its own compiler flags): the result is bit for bit the
// Python path's. The GIL is released while it runs.
//
// What it takes (the caller, engine/model/fused_decode.py, checks the step is one): at most
// a few tokens, each attended as a decode row (its sequence's block table, the length up to
// and including it), 16-bit activations, a KV cache of their dtype, no sliding window.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "entry_points.h"

namespace {

// How a linear's weight is held and multiplied (the Python path's layer does the same).
constexpr int64_t kInterleaved = -1;   // GGUF, interleaved: matmul_q8_interleaved
constexpr int64_t kPacked = -2;        // bfloat16 prepacked for oneDNN: mkldnn::_linear_pointwise
                                       // (layers/packed_linear.py); >= 0: GGUF rows, matmul_q8 on that ISA

struct Linear {
  torch::Tensor weight;                // GGUF bytes [rows, bytes per row], or the oneDNN packing
  int64_t qtype = 0;
  c10::optional<torch::Tensor> bias;   // GGUF: float32 [rows]; packed: the model dtype
  int64_t kind = kInterleaved;
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;   // Qwen3's per-head norms
  double eps = 0;
  torch::Tensor cos, sin;                        // the rotary tables (float32 [positions, rotary_dim])
  int64_t rotary_dim = 0;
  Linear qkv, o, gate_up, down;
};

Linear make_linear(torch::Tensor weight, int64_t qtype, c10::optional<torch::Tensor> bias, int64_t kind) {
  TORCH_CHECK(weight.dim() == 2, "a weight must be 2-D; got ", weight.sizes());
  if (kind == kPacked) {
    TORCH_CHECK(weight.is_mkldnn(), "a packed weight must be oneDNN's packing (layers/packed_linear.py)");
    if (bias) TORCH_CHECK(bias->numel() == weight.size(0), "a bias must have ", weight.size(0), " values");
  } else {
    TORCH_CHECK(kind >= kInterleaved && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(),
                "a GGUF weight must be contiguous uint8 [rows, bytes per row]; got ", weight.sizes());
    if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                              bias->numel() == weight.size(0),
                          "a bias must be float32 [", weight.size(0), "]");
  }
  return Linear{std::move(weight), qtype, std::move(bias), kind};
}

// mkldnn::_linear_pointwise(X, W, B, "none", [], ""), as packed_linear calls it from Python.
torch::Tensor packed_linear(const torch::Tensor& x, const Linear& l) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, l.weight, l.bias, c10::IValue(std::string("none")),
                          c10::IValue(c10::List<c10::optional<c10::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

class DecodeLayers {
 public:
  DecodeLayers(const py::dict& ops, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "heads must be positive, the query heads a multiple of the KV heads");
    matmul_q8_ = entry_points::unwrap<entry_points::MatmulQ8>(ops["matmul_q8"], entry_points::kMatmulQ8);
    matmul_q8i_ = entry_points::unwrap<entry_points::MatmulQ8Interleaved>(ops["matmul_q8_interleaved"],
                                                                           entry_points::kMatmulQ8Interleaved);
    add_rms_norm_ = entry_points::unwrap<entry_points::AddRmsNorm>(ops["add_rms_norm"], entry_points::kAddRmsNorm);
    rotary_ = entry_points::unwrap<entry_points::RotaryInplace>(ops["rotary_inplace"], entry_points::kRotaryInplace);
    silu_mul_ = entry_points::unwrap<entry_points::SiluMul>(ops["silu_mul"], entry_points::kSiluMul);
    store_kv_ = entry_points::unwrap<entry_points::StoreKv>(ops["store_kv"], entry_points::kStoreKv);
    paged_decode_ = entry_points::unwrap<entry_points::PagedDecode>(ops["paged_decode"], entry_points::kPagedDecode);
  }

  // One layer, in order. A linear's kind: the q8 path's ISA id, kInterleaved or kPacked.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos, torch::Tensor sin,
                 int64_t rotary_dim, std::vector<torch::Tensor> weights, std::vector<int64_t> qtypes,
                 std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> kinds) {
    TORCH_CHECK(weights.size() == 4 && qtypes.size() == 4 && biases.size() == 4 && kinds.size() == 4,
                "a layer has four linears: qkv, o, gate_up, down");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    const int64_t hidden = input_norm.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(weights[0].size(0) == q_size + 2 * kv_size, "qkv has ", weights[0].size(0), " rows; the heads need ",
                q_size + 2 * kv_size);
    TORCH_CHECK(weights[1].size(0) == hidden && weights[3].size(0) == hidden && weights[2].size(0) % 2 == 0,
                "o and down must have ", hidden, " rows and gate_up an even number");
    Layer layer;
    layer.input_norm = std::move(input_norm);
    layer.post_norm = std::move(post_norm);
    layer.q_norm = std::move(q_norm);
    layer.k_norm = std::move(k_norm);
    layer.eps = eps;
    layer.cos = std::move(cos);
    layer.sin = std::move(sin);
    layer.rotary_dim = rotary_dim;
    Linear* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (size_t i = 0; i < 4; ++i) *linears[i] = make_linear(weights[i], qtypes[i], biases[i], kinds[i]);
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [tokens, hidden] (the embeddings, or the previous stage's), residual (None before the
  // first layer); kv_caches[i] layer i's [2, blocks, block_size, kv_heads, head_dim]; the first
  // num_tokens slots of slot_mapping are the tokens' (-1: skip); block_tables [tokens, max_blocks]
  // and seq_lens [tokens] int32 are each token's decode row. Returns (hidden, residual) after the
  // last layer, the residual not yet added (as DecoderLayer.forward returns them).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                     torch::Tensor positions, std::vector<torch::Tensor> kv_caches,
                                     torch::Tensor slot_mapping, int64_t num_tokens, torch::Tensor block_tables,
                                     torch::Tensor seq_lens) {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one KV cache per layer: ",
                num_layers(), " layers, ", kv_caches.size(), " caches");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == num_tokens && block_tables.size(0) == num_tokens &&
                    seq_lens.size(0) == num_tokens,
                "hidden, block_tables and seq_lens must have one row per token (", num_tokens, ")");
    py::gil_scoped_release released;
    const int64_t tokens = hidden.size(0);
    block_tables = block_tables.contiguous();   // the step's tables may be a view of wider ones
    seq_lens = seq_lens.contiguous();
    torch::Tensor h = std::move(hidden), res;
    bool has_res = residual.has_value();
    if (has_res) res = *residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      auto normed = add_rms_norm_(h, has_res ? c10::optional<torch::Tensor>(res) : c10::nullopt, L.input_norm, L.eps);
      res = has_res ? normed[1] : h;
      has_res = true;
      auto heads = matmul(L.qkv, normed[0]).view({tokens, num_heads_ + 2 * num_kv_heads_, head_dim_});
      auto q = heads.narrow(1, 0, num_heads_);
      auto k = heads.narrow(1, num_heads_, num_kv_heads_);
      auto v = heads.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_);
      if (L.q_norm) {   // RMSNorm.forward on a 3-D input: a flat copy, normed, viewed back
        q = add_rms_norm_(q.reshape({-1, head_dim_}), c10::nullopt, *L.q_norm, L.eps)[0].view(q.sizes());
        k = add_rms_norm_(k.reshape({-1, head_dim_}), c10::nullopt, *L.k_norm, L.eps)[0].view(k.sizes());
      }
      rotary_(positions, q, k, L.cos, L.sin, L.rotary_dim);
      const torch::Tensor& cache = kv_caches[i];
      store_kv_(k, v, cache, slot_mapping, num_tokens);
      auto attn = paged_decode_(q.contiguous(), cache[0], cache[1], block_tables, seq_lens, 0, scale_);
      auto summed = add_rms_norm_(matmul(L.o, attn.view({tokens, num_heads_ * head_dim_})), res, L.post_norm, L.eps);
      res = summed[1];
      h = matmul(L.down, silu_mul_(matmul(L.gate_up, summed[0])));
    }
    return {h, res};
  }

 private:
  torch::Tensor matmul(const Linear& l, const torch::Tensor& x) const {
    if (l.kind == kPacked) return packed_linear(x, l);
    if (l.kind == kInterleaved) return matmul_q8i_(x, l.weight, l.qtype, l.bias);
    return matmul_q8_(x, l.weight, l.qtype, l.bias, l.kind);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::vector<Layer> layers_;
  entry_points::MatmulQ8 matmul_q8_;
  entry_points::MatmulQ8Interleaved matmul_q8i_;
  entry_points::AddRmsNorm add_rms_norm_;
  entry_points::RotaryInplace rotary_;
  entry_points::SiluMul silu_mul_;
  entry_points::StoreKv store_kv_;
  entry_points::PagedDecode paged_decode_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", "a decode step's decoder layers in one native call")
      .def(py::init<const py::dict&, int64_t, int64_t, int64_t, double>(), py::arg("ops"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"))
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward);
}
