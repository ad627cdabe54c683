"""Speculative decoding in a plan: the drafter's weights and KV beside the model's.

``Overrides.speculative`` is vLLM's ``--speculative-config`` (checked by the engine's own
``SpeculativeConfig``). The engine runs speculation on one GPU (no tensor or pipeline
parallelism), loads a draft model or EAGLE head beside the model, and keeps the drafter's
KV in the model's blocks, so that every block costs both (``KVLayout.extra_bytes_per_token``):

- ``ngram``: nothing (prompt lookup);
- ``draft_model``: the catalogue preset its path names (the last one or two path parts):
  its weights, and KV of its layers at the plan's KV dtype;
- ``eagle`` / ``eagle3``: one decoder layer of the model plus the ``2h x h`` fusion, in the
  model's dtype, and KV of one layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.contract.kv_layout import kv_bytes_per_token
from kvpilot.contract.speculative import SpeculativeConfig
from kvpilot.operator.planner.catalog import model_presets, preset_key, preset_model
from kvpilot.operator.planner.model_spec import ModelSpec

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Drafter:
    config: SpeculativeConfig
    weight_bytes: int
    num_layers: int          # of KV (0: none)
    num_kv_heads: int
    head_dim: int
    what: str

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if not self.num_layers:
            return 0
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)

    def derivation(self, dtype_bytes: int) -> str:
        c = self.config
        head = f"Speculative decoding ({c.method}, {c.num_speculative_tokens} draft tokens per step; one GPU)"
        if not self.num_layers:
            return f"{head}: {self.what}, no weights and no KV."
        return (f"{head}: {self.what}: {self.weight_bytes / GIB:.2f} GiB of weights counted with the "
                f"model's, and its KV, 2 x {self.num_layers} layers x {self.num_kv_heads} KV heads x "
                f"{self.head_dim} head_dim x {dtype_bytes} B = {self.kv_bytes_per_token(dtype_bytes):,} B per "
                f"token, kept in the same blocks (counted in KV bytes/token below).")


def _draft_preset(path: str) -> ModelSpec:
    parts = path.strip("/").split("/")
    for name in ("/".join(parts[-2:]), parts[-1]):
        if preset_key(name) is not None:
            return preset_model(name)
    raise ValueError(f"speculative draft model {path!r}: the planner sizes a draft model by its "
                     f"catalogue preset, named by the path's last parts; presets: {', '.join(model_presets())}")


def drafter(speculative: dict[str, Any] | None, model: ModelSpec) -> Drafter | None:
    """What ``speculative`` adds to a replica of ``model`` (None: no speculation)."""
    if speculative is None:
        return None
    config = SpeculativeConfig.from_dict(speculative)
    if config.method == "ngram":
        return Drafter(config, 0, 0, 0, 0, "n-gram prompt lookup")
    if config.is_eagle:
        h = model.hidden_size
        layer_params = (model.num_params - model.embedding_params) // model.num_layers
        return Drafter(config, (layer_params + 2 * h * h) * model.dtype_bytes, 1, model.num_kv_heads,
                       model.head_dim, f"EAGLE head: one decoder layer of {model.name} and its {2 * h} x {h} fusion")
    draft = _draft_preset(config.model)
    if draft.vocab_size != model.vocab_size:
        raise ValueError(f"speculative draft model {draft.name} has {draft.vocab_size:,} tokens, "
                         f"{model.name} {model.vocab_size:,}: a draft model needs the same vocabulary")
    return Drafter(config, draft.total_weight_bytes, draft.num_layers, draft.num_kv_heads, draft.head_dim,
                   f"draft model {draft.name}")
