// A decode step's decoder layers in one native call (Llama family and Gemma 3 on CPU: GGUF q8
// weights, or bfloat16 weights prepacked for oneDNN).
//
// A single-stream decode step of a small model spends more time in Python, between the
// kernels, than in them: a layer is about ten calls (norm, q/k/v, rotary, KV store,
// attention, o, norm, gate/up, SiLU * up, down), each through a module, a launcher and
// pybind. `DecodeLayers` holds every layer's weights and runs them all in one call, calling
// the same kernels the Python path calls (taken from their modules as entry points,
// entry_points.h, so each keeps its own compiler flags): the result is bit for bit the
// Python path's. The GIL is released while it runs.
//
// Each layer has its options, as the model's layer has them: the norm form (Llama's, or
// Gemma's `(1 + w)` gain in float32: each its compiled op, as the layers' norms call them),
// Gemma 3's sandwich norms (after attention and after the MLP, before the residual add),
// the activation (SiLU * up through the compiled op; GELU through ATen's, as the layer
// calls it), its sliding window, its rotary tables and its KV cache group (a hybrid model's
// windowed layers have block tables of their own).
//
// What it takes (the caller, engine/model/fused_decode.py, checks the step is one): at most
// a few tokens, each attended as a decode row (its sequence's block table, the length up to
// and including it), 16-bit activations (float32 ones where the GGUF layers take 8-bit
// activations in float32), a KV cache of their dtype.

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

// A norm's form: Llama's (cpu_layer_ops' add_rms_norm, rounded before the weight), or Gemma's
// (its gemma_rms_norm: float32 times `1 + weight`, rounded once).
enum class NormForm { kLlama, kGemma };
// The MLP's activation of [gate | up]: SiLU * up (cpu_layer_ops' silu_mul), or GELU (tanh or
// exact) * up as torch computes it (layers/activation.py's ACTIVATIONS).
enum class Activation { kSiluMul, kGeluTanh, kGelu };

struct Layer {
  NormForm norm_form = NormForm::kLlama;
  // Gemma: each norm's `1 + weight` in float32 (the weight as the layer holds it: zero-centred)
  torch::Tensor input_norm, mlp_norm;                  // before attention; before the MLP (+ residual)
  c10::optional<torch::Tensor> post_attn_norm, post_mlp_norm;   // Gemma 3's sandwich norms
  c10::optional<torch::Tensor> q_norm, k_norm;         // Qwen3's and Gemma 3's per-head norms
  double eps = 0;
  torch::Tensor cos, sin;                        // the rotary tables (float32 [positions, rotary_dim])
  int64_t rotary_dim = 0;
  int64_t sliding_window = 0;                    // 0: full attention
  Activation activation = Activation::kSiluMul;
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

NormForm parse_norm_form(const std::string& name) {
  if (name == "llama") return NormForm::kLlama;
  if (name == "gemma") return NormForm::kGemma;
  TORCH_CHECK(false, "a norm form is \"llama\" or \"gemma\"; got \"", name, "\"");
}

Activation parse_activation(const std::string& name) {
  if (name == "silu") return Activation::kSiluMul;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "gelu") return Activation::kGelu;
  TORCH_CHECK(false, "an activation is \"silu\", \"gelu_tanh\" or \"gelu\"; got \"", name, "\"");
}

}  // namespace

class DecodeLayers {
 public:
  DecodeLayers(const py::dict& ops, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
               int64_t interleaved_isa)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale),
        interleaved_isa_(interleaved_isa) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "heads must be positive, the query heads a multiple of the KV heads");
    matmul_q8_ = entry_points::unwrap<entry_points::MatmulQ8>(ops["matmul_q8"], entry_points::kMatmulQ8);
    matmul_q8i_ = entry_points::unwrap<entry_points::MatmulQ8Interleaved>(ops["matmul_q8_interleaved"],
                                                                           entry_points::kMatmulQ8Interleaved);
    add_rms_norm_ = entry_points::unwrap<entry_points::AddRmsNorm>(ops["add_rms_norm"], entry_points::kAddRmsNorm);
    gemma_rms_norm_ = entry_points::unwrap<entry_points::AddRmsNorm>(ops["gemma_rms_norm"],
                                                                     entry_points::kGemmaRmsNorm);
    rotary_ = entry_points::unwrap<entry_points::RotaryInplace>(ops["rotary_inplace"], entry_points::kRotaryInplace);
    silu_mul_ = entry_points::unwrap<entry_points::SiluMul>(ops["silu_mul"], entry_points::kSiluMul);
    store_kv_ = entry_points::unwrap<entry_points::StoreKv>(ops["store_kv"], entry_points::kStoreKv);
    paged_decode_ = entry_points::unwrap<entry_points::PagedDecode>(ops["paged_decode"], entry_points::kPagedDecode);
  }

  // One layer, in order. A linear's kind: the q8 path's ISA id, kInterleaved or kPacked. The
  // norms' weights as the layer holds them: `mlp_norm` is the one before the MLP (Llama's
  // post_attention_layernorm, Gemma 3's pre_feedforward_layernorm), `post_attn_norm` and
  // `post_mlp_norm` Gemma 3's norms of each branch's output (both or neither).
  void add_layer(torch::Tensor input_norm, torch::Tensor mlp_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double eps, torch::Tensor cos, torch::Tensor sin,
                 int64_t rotary_dim, std::vector<torch::Tensor> weights, std::vector<int64_t> qtypes,
                 std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> kinds,
                 c10::optional<torch::Tensor> post_attn_norm, c10::optional<torch::Tensor> post_mlp_norm,
                 const std::string& norm_form, const std::string& activation, int64_t sliding_window) {
    TORCH_CHECK(weights.size() == 4 && qtypes.size() == 4 && biases.size() == 4 && kinds.size() == 4,
                "a layer has four linears: qkv, o, gate_up, down");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    TORCH_CHECK(post_attn_norm.has_value() == post_mlp_norm.has_value(),
                "post_attn_norm and post_mlp_norm come together");
    TORCH_CHECK(sliding_window >= 0, "a sliding window is positive (0: none); got ", sliding_window);
    const int64_t hidden = input_norm.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK(weights[0].size(0) == q_size + 2 * kv_size, "qkv has ", weights[0].size(0), " rows; the heads need ",
                q_size + 2 * kv_size);
    TORCH_CHECK(weights[1].size(0) == hidden && weights[3].size(0) == hidden && weights[2].size(0) % 2 == 0,
                "o and down must have ", hidden, " rows and gate_up an even number");
    Layer layer;
    layer.norm_form = parse_norm_form(norm_form);
    layer.activation = parse_activation(activation);
    // Gemma's norms multiply by `1.0 + weight.float()`: computed once (the same float32 sums)
    auto held = [&](c10::optional<torch::Tensor> w) -> c10::optional<torch::Tensor> {
      if (!w || layer.norm_form == NormForm::kLlama) return w;
      c10::InferenceMode guard;
      return w->to(torch::kFloat) + 1.0;
    };
    layer.input_norm = *held(std::move(input_norm));
    layer.mlp_norm = *held(std::move(mlp_norm));
    layer.post_attn_norm = held(std::move(post_attn_norm));
    layer.post_mlp_norm = held(std::move(post_mlp_norm));
    layer.q_norm = held(std::move(q_norm));
    layer.k_norm = held(std::move(k_norm));
    layer.eps = eps;
    layer.sliding_window = sliding_window;
    layer.cos = std::move(cos);
    layer.sin = std::move(sin);
    layer.rotary_dim = rotary_dim;
    Linear* linears[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (size_t i = 0; i < 4; ++i) *linears[i] = make_linear(weights[i], qtypes[i], biases[i], kinds[i]);
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [tokens, hidden] (the embeddings, or the previous stage's), residual (None before the
  // first layer); kv_caches[i] layer i's [2, blocks, block_size, kv_heads, head_dim]. Per KV
  // cache group g (one, or a hybrid model's full and windowed groups): the first num_tokens
  // slots of slot_mappings[g] are the tokens' (-1: skip); block_tables[g] [tokens, max_blocks]
  // and seq_lens[g] [tokens] int32 are each token's decode row. layer_groups[i]: layer i's group
  // (empty: all group 0). Returns (hidden, residual) after the last layer, the residual not yet
  // added (as the Python layers return them).
  std::vector<torch::Tensor> forward(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                     torch::Tensor positions, std::vector<torch::Tensor> kv_caches,
                                     std::vector<torch::Tensor> slot_mappings, int64_t num_tokens,
                                     std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> seq_lens,
                                     std::vector<int64_t> layer_groups) {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one KV cache per layer: ",
                num_layers(), " layers, ", kv_caches.size(), " caches");
    const size_t groups = slot_mappings.size();
    TORCH_CHECK(groups > 0 && block_tables.size() == groups && seq_lens.size() == groups,
                "slot mappings, block tables and lengths for each KV cache group");
    TORCH_CHECK(layer_groups.empty() || static_cast<int64_t>(layer_groups.size()) == num_layers(),
                "one KV cache group per layer (or none: all group 0)");
    for (int64_t g : layer_groups) TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(groups), "no KV cache group ", g);
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == num_tokens, "hidden must have one row per token (",
                num_tokens, ")");
    for (size_t g = 0; g < groups; ++g)
      TORCH_CHECK(block_tables[g].size(0) == num_tokens && seq_lens[g].size(0) == num_tokens,
                  "block_tables and seq_lens must have one row per token (", num_tokens, ")");
    py::gil_scoped_release released;
    const int64_t tokens = hidden.size(0);
    for (size_t g = 0; g < groups; ++g) {   // the step's tables may be a view of wider ones
      block_tables[g] = block_tables[g].contiguous();
      seq_lens[g] = seq_lens[g].contiguous();
    }
    torch::Tensor h = std::move(hidden), res;
    bool has_res = residual.has_value();
    if (has_res) res = *residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const size_t g = layer_groups.empty() ? 0 : static_cast<size_t>(layer_groups[i]);
      auto normed = norm(L, h, has_res ? c10::optional<torch::Tensor>(res) : c10::nullopt, L.input_norm);
      res = has_res ? normed[1] : h;
      has_res = true;
      auto heads = matmul(L.qkv, normed[0]).view({tokens, num_heads_ + 2 * num_kv_heads_, head_dim_});
      auto q = heads.narrow(1, 0, num_heads_);
      auto k = heads.narrow(1, num_heads_, num_kv_heads_);
      auto v = heads.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_);
      if (L.q_norm) {
        q = head_norm(L, q, *L.q_norm);
        k = head_norm(L, k, *L.k_norm);
      }
      rotary_(positions, q, k, L.cos, L.sin, L.rotary_dim);
      const torch::Tensor& cache = kv_caches[i];
      store_kv_(k, v, cache, slot_mappings[g], num_tokens);
      auto attn = paged_decode_(q.contiguous(), cache[0], cache[1], block_tables[g], seq_lens[g],
                                L.sliding_window, scale_);
      auto out = matmul(L.o, attn.view({tokens, num_heads_ * head_dim_}));
      if (L.post_attn_norm) out = norm(L, out, c10::nullopt, *L.post_attn_norm)[0];
      auto summed = norm(L, out, res, L.mlp_norm);
      res = summed[1];
      h = matmul(L.down, act_mul(L, matmul(L.gate_up, summed[0])));
      if (L.post_mlp_norm) h = norm(L, h, c10::nullopt, *L.post_mlp_norm)[0];
    }
    return {h, res};
  }

 private:
  // The layer's norm of x (+ residual first): {normed} or {normed, x + residual}.
  std::vector<torch::Tensor> norm(const Layer& L, const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                  const torch::Tensor& weight) const {
    if (L.norm_form == NormForm::kLlama) return add_rms_norm_(x, residual, weight, L.eps);
    return gemma_rms_norm_(x, residual, weight, L.eps);
  }

  // A per-head norm of q or k ([tokens, heads, head_dim], a view of the projection) as the
  // layer's norm module computes it: RMSNorm.forward's kernel on a flat copy, viewed back;
  // GemmaRMSNorm on the view itself.
  torch::Tensor head_norm(const Layer& L, const torch::Tensor& x, const torch::Tensor& weight) const {
    if (L.norm_form == NormForm::kGemma) return gemma_rms_norm_(x, c10::nullopt, weight, L.eps)[0];
    return add_rms_norm_(x.reshape({-1, head_dim_}), c10::nullopt, weight, L.eps)[0].view(x.sizes());
  }

  // act(gate) * up of [gate | up]: MLP.forward's kernel, or its torch ops.
  torch::Tensor act_mul(const Layer& L, const torch::Tensor& gate_up) const {
    if (L.activation == Activation::kSiluMul) return silu_mul_(gate_up);
    const int64_t inner = gate_up.size(-1) / 2;
    auto gate = gate_up.narrow(-1, 0, inner), up = gate_up.narrow(-1, inner, inner);
    return at::gelu(gate, L.activation == Activation::kGeluTanh ? "tanh" : "none") * up;
  }

  torch::Tensor matmul(const Linear& l, const torch::Tensor& x) const {
    if (l.kind == kPacked) return packed_linear(x, l);
    if (l.kind == kInterleaved) return matmul_q8i_(x, l.weight, l.qtype, l.bias, interleaved_isa_);
    return matmul_q8_(x, l.weight, l.qtype, l.bias, l.kind);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  int64_t interleaved_isa_;   // the interleaved linears' ISA id (matmul_q8_interleaved's isa)
  std::vector<Layer> layers_;
  entry_points::MatmulQ8 matmul_q8_;
  entry_points::MatmulQ8Interleaved matmul_q8i_;
  entry_points::AddRmsNorm add_rms_norm_, gemma_rms_norm_;
  entry_points::RotaryInplace rotary_;
  entry_points::SiluMul silu_mul_;
  entry_points::StoreKv store_kv_;
  entry_points::PagedDecode paged_decode_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLayers>(m, "DecodeLayers", "a decode step's decoder layers in one native call")
      .def(py::init<const py::dict&, int64_t, int64_t, int64_t, double, int64_t>(), py::arg("ops"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
           py::arg("interleaved_isa") = 0)
      .def("add_layer", &DecodeLayers::add_layer, py::arg("input_norm"), py::arg("mlp_norm"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("rotary_dim"),
           py::arg("weights"), py::arg("qtypes"), py::arg("biases"), py::arg("kinds"), py::kw_only(),
           py::arg("post_attn_norm") = py::none(), py::arg("post_mlp_norm") = py::none(),
           py::arg("norm_form") = "llama", py::arg("activation") = "silu", py::arg("sliding_window") = 0)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, py::arg("hidden"), py::arg("residual"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("slot_mappings"), py::arg("num_tokens"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("layer_groups") = std::vector<int64_t>());
}
