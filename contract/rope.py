"""A model's rotary position embedding, read from its ``config.json`` (torch-free).

Both layouts are read: transformers 4.x (top-level ``rope_theta``, ``rope_scaling``
with ``type`` or ``rope_type``) and 5.x (``rope_parameters``, which wins where both
give a value). Gemma 3 has two ropes: its global layers use ``rope_theta`` (default
1e6) with ``rope_scaling``, its local layers ``rope_local_base_freq`` (default 1e4)
unscaled; transformers 5 nests both under ``rope_parameters`` by layer type.

Any rope type is read; which ones the engine computes is ``ROPE_TYPES`` (the engine
refuses the others, the planner sizes them all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The rope types the engine's rotary embedding computes.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Rope types whose factor stretches the usable context beyond the trained length.
STRETCHING_ROPE = ("yarn", "dynamic", "linear")
_FIELDS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
           "beta_fast", "beta_slow", "attention_factor", "partial_rotary_factor")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0     # llama3
    high_freq_factor: float = 4.0    # llama3
    beta_fast: float = 32.0          # yarn
    beta_slow: float = 1.0           # yarn
    attention_factor: float | None = None   # yarn (mscale); None = derived from factor
    partial_rotary_factor: float = 1.0

    def stretched_positions(self, max_position_embeddings: int) -> int:
        """The longest context this rope reaches: ``original x factor`` for the types that
        stretch (yarn, dynamic, linear), else ``max_position_embeddings``."""
        if self.rope_type in STRETCHING_ROPE and self.factor:
            original = self.original_max_position_embeddings or max_position_embeddings
            return max(max_position_embeddings, int(original * float(self.factor)))
        return max_position_embeddings


def read_rope(cfg: dict[str, Any]) -> RopeConfig:
    """The rope of a config.json dict (either layout; theta 10,000 when it names none)."""
    params = {**(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    kwargs = {k: params[k] for k in _FIELDS if params.get(k) is not None}
    if "partial_rotary_factor" not in kwargs and cfg.get("partial_rotary_factor") is not None:
        kwargs["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return RopeConfig(theta=float(theta), rope_type=rope_type, **kwargs)


def read_gemma3_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope of a Gemma 3 config, in either layout."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict) and ("full_attention" in nested or "sliding_attention" in nested):
        full = {"rope_theta": 1_000_000.0, **(nested.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(nested.get("sliding_attention") or {})}
        return read_rope({"rope_parameters": full}), read_rope({"rope_parameters": local})
    full = {"rope_theta": cfg.get("rope_theta") or 1_000_000.0, "rope_scaling": cfg.get("rope_scaling"),
            "rope_parameters": nested}
    local = {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}
    return read_rope(full), read_rope(local)
