"""Choosing the KV-cache dtype.

16-bit KV (``auto``: the model's dtype) is the default. FP8 halves KV bytes, so it
doubles token capacity and halves the KV read per decode step, but:

- below ~7k tokens per sequence the fixed per-step cost of quantising and
  dequantising outweighs the bandwidth saved, so FP8 is only a candidate when the
  p95 sequence (prompt + output) is at least FP8_MIN_SEQ_TOKENS long;
- with head_dim 256 (Gemma 2) prefill attention over FP8 KV can take up to 1.6x
  longer at long context, so the FP8 candidate's TTFT estimate is multiplied by
  FP8_HEAD_DIM_256_TTFT_FACTOR: with a tight TTFT target it loses on its own numbers;
- the engine's FP8 scales are uncalibrated (1.0), which can shift accuracy.

When allowed, the planner evaluates both and takes FP8 only if it gives strictly
more ``max_num_seqs`` than 16-bit (16-bit already at its cap never loses). An
explicit ``kv_cache_dtype`` override is used as given, with the same warnings.
"""

from __future__ import annotations

from kvpilot.contract.kv_layout import FP8_KV_DTYPES, kv_dtype_bytes
from kvpilot.operator.planner.model_spec import ModelSpec
from kvpilot.operator.planner.slo import Overrides, ServiceLevel

FP8_MIN_SEQ_TOKENS = 7168
FP8_HEAD_DIM_256_TTFT_FACTOR = 1.6
UNCALIBRATED_WARNING = ("FP8 KV cache uses uncalibrated scales (1.0): outputs can shift slightly "
                        "versus 16-bit KV; check accuracy on your own evaluation set")


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_DTYPES


def dtype_bytes(model: ModelSpec, kv_cache_dtype: str) -> int:
    """Bytes per KV element (the engine's own function: ``auto`` follows the model dtype)."""
    return kv_dtype_bytes(kv_cache_dtype, model.dtype)


def resolved_name(model: ModelSpec, kv_cache_dtype: str) -> str:
    """The cache's element type as the engine names it: ``auto`` -> model dtype, ``fp8`` -> e4m3."""
    if kv_cache_dtype == "auto":
        return model.dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def dtype_label(model: ModelSpec, kv_cache_dtype: str) -> str:
    if kv_cache_dtype == "auto":
        return f"auto ({model.dtype})"
    return "fp8 (e4m3)" if kv_cache_dtype == "fp8" else kv_cache_dtype


def ttft_factor(model: ModelSpec, kv_cache_dtype: str) -> float:
    """TTFT multiplier of FP8 KV for head_dim >= 256 models (1.0 otherwise)."""
    return FP8_HEAD_DIM_256_TTFT_FACTOR if is_fp8(kv_cache_dtype) and model.head_dim >= 256 else 1.0


def candidates(model: ModelSpec, slo: ServiceLevel, overrides: Overrides) -> tuple[list[str], list[str]]:
    """(KV dtypes to evaluate, derivation notes on why)."""
    seq = slo.seq_tokens_p95
    if overrides.kv_cache_dtype is not None:
        return [overrides.kv_cache_dtype], [f"KV dtype pinned to {overrides.kv_cache_dtype} by override"]
    if model.dtype == "float32":
        note = "model dtype float32: KV follows it (4 bytes)"
    else:
        note = f"16-bit KV ({model.dtype}) preferred"
    if not slo.allow_fp8_kv:
        return ["auto"], [f"{note}; FP8 KV not allowed"]
    if seq < FP8_MIN_SEQ_TOKENS:
        return ["auto"], [f"{note}; FP8 KV not considered: the p95 sequence ({seq:,} tokens) is "
                          f"shorter than {FP8_MIN_SEQ_TOKENS:,}, where the fixed per-step FP8 cost "
                          "outweighs the bandwidth it saves"]
    notes = [f"{note}; FP8 KV allowed and the p95 sequence ({seq:,} tokens) is long enough: "
             "evaluating both, FP8 only if it gives more max_num_seqs"]
    if model.head_dim >= 256:
        notes.append(f"head_dim {model.head_dim}: FP8 KV can make prefill up to "
                     f"{FP8_HEAD_DIM_256_TTFT_FACTOR}x slower, applied to its TTFT estimate")
    return ["auto", "fp8"], notes


def warnings_for(model: ModelSpec, slo: ServiceLevel, kv_cache_dtype: str, pinned: bool) -> list[str]:
    """Warnings for a plan that uses ``kv_cache_dtype``."""
    if not is_fp8(kv_cache_dtype):
        return []
    out = [UNCALIBRATED_WARNING]
    if pinned and slo.seq_tokens_p95 < FP8_MIN_SEQ_TOKENS:
        out.append(f"FP8 KV pinned for {slo.seq_tokens_p95:,}-token sequences: below "
                   f"{FP8_MIN_SEQ_TOKENS:,} tokens it usually costs more per step than it saves")
    if pinned and model.head_dim >= 256 and slo.ttft_p95_ms is not None:
        out.append(f"FP8 KV with head_dim {model.head_dim}: TTFT estimated at up to "
                   f"{FP8_HEAD_DIM_256_TTFT_FACTOR}x the 16-bit figure")
    return out
