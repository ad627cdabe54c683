"""``--speculative-config``: vLLM's ``SpeculativeConfig`` fields, frozen and validated
(torch-free: the flag parser and the operator read it without loading anything).

Methods:
- ``ngram``: prompt lookup (``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens matched
  against the request's own prompt and output); no model.
- ``draft_model``: a small model with the target's vocabulary (``model``: a checkpoint
  directory or GGUF file) proposes greedily; its KV lives in the target's blocks.
- ``eagle`` / ``eagle3``: an EAGLE-style head (``model``: its checkpoint) reads the
  target's hidden states and the token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvpilot.contract.json_object import dataclass_from_object, parse_json

SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM's defaults when an n-gram config gives neither bound.
DEFAULT_PROMPT_LOOKUP = 5


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"speculative_config: {name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How drafts are proposed (vLLM's JSON names).

    Args:
        method: ``ngram``, ``draft_model``, ``eagle`` or ``eagle3``; None (vLLM's
            inference) = ``ngram`` when ``model`` is ``"ngram"``, else from the model's
            name (``eagle3`` / ``eagle`` in it), else ``draft_model``.
        num_speculative_tokens: drafts proposed per request and step (k): a step scores
            up to 1 + k tokens of a request.
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first
            (n-gram only; one given sets both; neither: 5 and 5, as vLLM).
        model: the draft model's or EAGLE head's checkpoint (model methods only).
        draft_tensor_parallel_size: ranks of the draft model; only 1 (or None) here.
        disable_by_batch_size: no drafts while this many requests or more run (None: always).
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            method = self._infer_method()
            object.__setattr__(self, "method", method)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPEC_METHODS}, got {method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if method == "ngram":
            self._resolve_lookup()
            if self.model not in (None, "ngram", "[ngram]"):
                raise ValueError("speculative_config: the ngram method takes no model")
            object.__setattr__(self, "model", None)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config: method {method!r} needs `model` (the "
                                 f"{'draft model' if method == 'draft_model' else 'EAGLE head'}'s checkpoint)")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name} applies to the ngram method only")
        if self.draft_tensor_parallel_size is not None:
            _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)
            if self.draft_tensor_parallel_size != 1:
                raise ValueError("speculative_config: draft_tensor_parallel_size must be 1 (the draft "
                                 "runs on the driver's device; tensor-parallel drafts are not implemented)")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)

    def _infer_method(self) -> str:
        if self.model in (None, "ngram", "[ngram]"):
            if self.model is None:
                raise ValueError("speculative_config: give `method` (one of "
                                 f"{SPEC_METHODS}) or a draft `model`")
            return "ngram"
        name = str(self.model).lower()
        return "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"

    def _resolve_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        _check_int("prompt_lookup_min", low, 1)
        _check_int("prompt_lookup_max", high, 1)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} must be <= "
                             f"prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def uses_model(self) -> bool:
        """Whether drafts come from a second model (a draft model or an EAGLE head)."""
        return self.method in MODEL_METHODS

    @property
    def is_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a step's scored tokens that a proposer writes (a model drafting
        autoregressively: its own KV for the drafts it feeds back); n-gram writes none."""
        return self.num_speculative_tokens if self.uses_model else 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, data: Any) -> SpeculativeConfig:
        """From vLLM's JSON object; ValueError names an unknown key or a bad value."""
        if isinstance(data, SpeculativeConfig):
            return data
        return dataclass_from_object(cls, data, "speculative_config: ")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        return cls.from_dict(parse_json(text, "speculative_config: "))
