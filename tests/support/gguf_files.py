"""Tiny GGUF files written with the ``gguf`` package, from tiny seeded HF models.

``write_gguf`` converts a transformers model as llama.cpp's ``convert_hf_to_gguf.py``
does (names, the Llama q/k row permutation, Gemma's ``1 + weight`` norms, metadata) and
stores every 2-D weight but the LM head in one GGML type:

- F32 / F16, and Q8_0 / Q4_0 / Q4_1 quantized from the model's weights with
  ``gguf.quants.quantize``;
- Q4_K / Q5_K / Q6_K as random blocks of the type's byte layout with finite fp16 scales
  (``gguf.quants`` cannot quantize to k-quants; both the engine and transformers decode
  the same bytes, so the model's own weights do not matter).

The LM head (untied models) stays float32, sharpened, so that greedy ties are unlikely.
The vocabulary is a small byte-level BPE trained on a fixed corpus (``gpt2`` tokenizer
model) or a SentencePiece-style BPE with byte fallback (``llama`` tokenizer model).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from support.tiny_checkpoints import CHAT_TEMPLATE, CORPUS, SPECIAL  # noqa: F401 (one tokenizer corpus)

VOCAB = 512
# hidden, intermediate and heads x head_dim are multiples of 256: the k-quants' block
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)
KINDS = {   # kind -> (GGUF architecture, config overrides)
    "llama": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "mistral": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(num_hidden_layers=2, tie_word_embeddings=False, head_dim=128)),
    "gemma3": ("gemma3", dict(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=256, query_pre_attn_scalar=256, sliding_window=16,
                              tie_word_embeddings=True)),
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA3_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# k-quant -> (block bytes, offset of d, offset of dmin or None, d): values come out ~N(0, 0.05)
K_QUANTS = {"Q4_K": (144, 0, 2, 3e-4, 7.5), "Q5_K": (176, 0, 2, 1.5e-4, 15.5), "Q6_K": (210, 208, None, 4e-5, 0)}


def hf_model(kind: str, seed: int = 0, overrides: dict | None = None):
    """A seeded random transformers model of ``kind`` (float32), its config changed by
    ``overrides`` (say a wider ``intermediate_size``)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    cfg_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**COMMON, **KINDS[kind][1], **(overrides or {})})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if kind == "gemma3" and name.endswith("norm.weight"):   # random: 1 + w would hide w
                param.normal_(2.0 if ".post_" in name else 0.0, 0.5)
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _hf_to_gguf_name(name: str, arch: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    table = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    return f"blk.{layer}.{table[module]}.{suffix}"


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
    """``[rows, bytes]`` of random ``qtype`` blocks whose fp16 scales are finite."""
    size, d_at, dmin_at, d, centre = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = (d * gain * rng.uniform(0.5, 1.5, size=(rows, cols // 256))).astype(np.float16)
    blocks[..., d_at:d_at + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
    if dmin_at is not None:
        dmin = (scale.astype(np.float32) * centre).astype(np.float16)
        blocks[..., dmin_at:dmin_at + 2] = dmin.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator, gain: float):
    """(data, raw_dtype) for ``gguf.GGUFWriter.add_tensor``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    kind = GGMLQuantizationType[qtype]
    if qtype in K_QUANTS:
        return random_k_blocks(*w.shape, qtype, rng, gain), kind
    return quantize(w.astype(np.float32), kind), kind


@functools.cache
def train_vocab(sentencepiece: bool) -> tuple[list[str], list[str], list[float], list[int]]:
    """(tokens, merges, scores, token types) of a ``VOCAB``-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if sentencepiece:
        specials = ["<unk>", "<s>", "</s>"]
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials + byte_tokens,
                                      show_progress=False)
    else:
        specials = SPECIAL
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [3 if t in specials else 6 if t.startswith("<0x") and sentencepiece else
             5 if t.startswith("<unused") else 1 for t in tokens]
    scores = [0.0 if k != 1 else -float(i) for i, k in enumerate(types)]
    return tokens, merges, scores, types


def add_vocab(writer, sentencepiece: bool, with_merges: bool = True, **flags) -> None:
    tokens, merges, scores, types = train_vocab(sentencepiece)
    writer.add_tokenizer_model("llama" if sentencepiece else "gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    if with_merges and not sentencepiece:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in flags.items():   # add_bos_token=..., add_space_prefix=...
        getattr(writer, f"add_{name}")(value)


def write_gguf(path: Path, kind: str, qtype: str, seed: int = 0, sentencepiece: bool = False,
               name: str | None = None, overrides: dict | None = None) -> Path:
    """A GGUF file of ``hf_model(kind, seed, overrides)`` with its 2-D weights in ``qtype``."""
    import gguf

    arch, _ = KINDS[kind]
    model = hf_model(kind, seed, overrides)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or f"tiny-{kind}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (cfg.rope_parameters["full_attention"] if kind == "gemma3" else cfg.rope_parameters)["rope_theta"]
    writer.add_rope_freq_base(theta)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(cfg.vocab_size)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if kind == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    add_vocab(writer, sentencepiece)
    writer.add_file_type(1)
    rng = np.random.default_rng(seed)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().numpy()
        gguf_name = _hf_to_gguf_name(hf_name, arch)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            w = _llama_permute(w, heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w + 1.0
        one_d = w.ndim == 1 or gguf_name == "output.weight"
        gain = 16.0 if gguf_name == "token_embd.weight" and cfg.tie_word_embeddings else 1.0
        data, raw = _encode(w, "F32" if one_d else qtype, rng, gain)
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
