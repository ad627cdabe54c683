"""Per-request sampling parameters, in vLLM's shape and with vLLM's names."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

_EPS = 1e-5
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (an EBNF grammar in the GBNF dialect xgrammar reads).
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # ``key``, computed once: the canonical text of a large constraint costs milliseconds
    # (3 ms for 20,000 choices), and the engine asks for it several times.
    _key: tuple[str, str] = field(default=("", ""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings")
        object.__setattr__(self, "_key", self._canonical())

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                    if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: equal for equal constraints (the compile cache's key)."""
        return self._key

    def _canonical(self) -> tuple[str, str]:
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value


class RequestOutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step()`` returns for a request (vLLM's names).

    ``CUMULATIVE``: every step, everything so far. ``DELTA``: every step that adds
    something, only what it adds (streaming). ``FINAL_ONLY``: one output, when the
    request finishes (``LLM.generate``); no per-step output is built at all.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 and ``top_p`` of 1 disable
    those filters. ``logprobs=None`` returns no logprobs; ``logprobs=k`` returns the
    sampled token's logprob plus the top ``k``. With ``n > 1`` child ``i`` is seeded
    with ``seed + i`` so the children differ but the request stays reproducible.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's ``kv_transfer_params`` (disaggregated prefill and decode): ``do_remote_decode``
    # asks a producer to hold the prompt's KV for a decode engine, ``do_remote_prefill``
    # with the producer's ``remote_*`` fields makes a consumer pull it. None: neither.
    kv_transfer_params: dict[str, Any] | None = None
    # Filled by the engine: the model's EOS ids, unless ignore_eos.
    all_stop_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])] or None
        self.stop_token_ids = list(self.stop_token_ids or []) or None
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}"),
            (self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be non-negative, got {self.logprobs}"),
            (all(s for s in self.stop or []), "stop strings must not be empty"),
            (all(t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                 for t, b in (self.logit_bias or {}).items()),
             f"logit_bias maps token ids (>= 0) to values in [-{MAX_LOGIT_BIAS:g}, "
             f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of child ``index`` of an ``n > 1`` request."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def with_stop_ids(self, eos_token_ids: frozenset[int]) -> SamplingParams:
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids |= set(eos_token_ids)
        return dataclasses.replace(self, all_stop_token_ids=frozenset(ids))
