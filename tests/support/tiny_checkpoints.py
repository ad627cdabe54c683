"""Tiny HF-format checkpoints built with transformers (seeded random weights), for tests.

A small byte-level BPE tokenizer is trained on a fixed corpus so the checkpoint is
complete (config.json + safetensors + tokenizer files) without any download. The HF
oracle of the parity tests is ``support.hf_oracle``.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks mapped by block tables.",
    "Kubernetes operators reconcile desired state into running workloads, again and again.",
    "Prefix caching reuses the KV cache of shared prompt prefixes across requests.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 0123456789 and punctuation: ,.;:!?()[]{}<>-_=+*/\\|@#$%^&~`'\"",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)


def save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 16, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_checkpoint(path: Path, kind: str, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Save a random ``kind`` ('llama' | 'mistral' | 'qwen2' | 'qwen3') model and tokenizer into ``path``."""
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    kwargs = dict(BASE)
    if kind == "qwen3":
        kwargs["head_dim"] = 32   # explicit and != hidden / heads, as in real Qwen3
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    # Random init leaves logits nearly flat; sharpen them so greedy ties are unlikely.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, kwargs["vocab_size"])
    return path
