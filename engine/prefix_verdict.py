"""Why a request missed the prefix cache, as ``kvpilot explain-prefix`` says it: from two
requests compared offline, or from replicas' explanations (``POST /v1/prefix_cache/explain``).

A *cause* is what a platform engineer would fix: ``evicted``, ``different_cache_salt``,
``different_lora_adapter``, ``edited_prompt``, ``whitespace_change``, ``date_in_prompt``,
``tokenization_boundary``, ``wrong_replica``, ``last_partial_block``, ``last_token``,
``too_short``, ``never_seen`` (or ``none`` when nothing but the last token misses). The
engine's miss reasons (``core.prefix_miss``) map onto them; a divergence becomes one of the
four text causes by what changed at its position (``text.prefix_diff``), and a miss on one
replica becomes ``wrong_replica`` when another replica holds a longer prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.core.prefix_miss import (
    DIFFERENT_CACHE_SALT,
    DIFFERENT_LORA_ADAPTER,
    DIVERGENCE,
    EVICTED,
    LAST_PARTIAL_BLOCK,
    LAST_TOKEN,
    TOO_SHORT,
)
from kvpilot.engine.text.prefix_diff import DATE, TOKENIZATION, WHITESPACE, describe

DIVERGENCE_CAUSES = {WHITESPACE: "whitespace_change", DATE: "date_in_prompt",
                     TOKENIZATION: "tokenization_boundary"}
CONTEXT_TOKENS = 12


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """A request as compared: its token ids, cache salt and model (an adapter's name)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    model: str | None = None


@dataclass(slots=True)
class Verdict:
    """The cause of a miss, the reason it comes from and what supports it."""

    cause: str
    reason: str | None
    prompt_tokens: int
    cached_tokens: int
    position: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "reason": self.reason, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "missed_tokens": self.prompt_tokens - self.cached_tokens,
                "position": self.position, **self.detail}


def cause_of(reason: str | None, divergence_kind: str | None = None) -> str:
    """The cause an engine miss reason (and, for a divergence, the kind of change) stands for."""
    if reason is None:
        return "none"
    if reason in EVICTED.values():
        return "evicted"
    if reason == DIVERGENCE:
        return DIVERGENCE_CAUSES.get(divergence_kind, "edited_prompt")
    return reason


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def compare(first: PromptSpec, second: PromptSpec, block_size: int,
            decode: Callable[[Sequence[int]], str]) -> Verdict:
    """Why ``second`` misses a block-granular prefix cache that holds ``first`` (and nothing
    else): what a replica that served only ``first`` would count."""
    ours, theirs = list(second.token_ids), list(first.token_ids)
    n = len(ours)
    if n <= block_size:
        return Verdict("too_short", TOO_SHORT, n, 0, 0)
    if second.cache_salt != first.cache_salt:
        return Verdict(DIFFERENT_CACHE_SALT, DIFFERENT_CACHE_SALT, n, 0, 0)
    if second.model != first.model:
        return Verdict(DIFFERENT_LORA_ADAPTER, DIFFERENT_LORA_ADAPTER, n, 0, 0,
                       {"models": [first.model, second.model]})
    shared = _common(ours, theirs)
    cacheable = (n - 1) // block_size            # full blocks a hit may serve
    cached_blocks = min(shared // block_size, cacheable, len(theirs) // block_size)
    cached = cached_blocks * block_size
    if shared >= n or (cached_blocks == cacheable and shared >= n - n % block_size):
        reason = LAST_PARTIAL_BLOCK if n % block_size else LAST_TOKEN
        return Verdict(reason, reason, n, cached, cached)
    p = shared
    found = describe(decode(ours[max(0, p - CONTEXT_TOKENS):p]), decode(ours[p:p + 4 * CONTEXT_TOKENS]),
                     decode(theirs[p:p + 4 * CONTEXT_TOKENS]))
    return Verdict(DIVERGENCE_CAUSES.get(found.kind, "edited_prompt"), DIVERGENCE, n, cached, p,
                   {"divergence": {"kind": found.kind, "text_before": found.before,
                                   "text_after": found.ours, "cached_text_after": found.theirs}})


def from_replicas(explanations: Sequence[tuple[str, dict]], block_size: int | None = None) -> Verdict:
    """The verdict from each replica's explanation of the same prompt (``(name, explanation)``,
    the replica the request went to first): ``wrong_replica`` when another replica holds at
    least a block more of its prefix than the first one, else the first one's miss."""
    name, first = explanations[0]
    bs = block_size or first.get("block_size", 1)
    prompt, cached = first["prompt_tokens"], first.get("cached_tokens", 0)
    best_name, best = max(((n, e.get("cached_tokens", 0)) for n, e in explanations[1:]),
                          key=lambda item: item[1], default=(None, 0))
    miss = first.get("miss")
    if best_name is not None and best - cached >= bs:
        return Verdict("wrong_replica", miss["reason"] if miss else None, prompt, cached,
                       miss["position"] if miss else None,
                       {"replica": name, "holder": best_name, "holder_cached_tokens": best})
    if miss is None:
        return Verdict("none", None, prompt, cached, None, {"replica": name})
    kind = (miss.get("divergence") or {}).get("kind")
    detail = {"replica": name, **{k: v for k, v in miss.items() if k not in ("reason", "tokens", "position")}}
    return Verdict(cause_of(miss["reason"], kind), miss["reason"], prompt, cached, miss["position"], detail)


def describe_verdict(verdict: Verdict) -> str:
    """One paragraph for a person."""
    v = verdict
    missed = v.prompt_tokens - v.cached_tokens
    text = f"{missed} of {v.prompt_tokens} prompt tokens miss ({v.cached_tokens} cached): cause {v.cause}"
    if v.reason is not None and v.reason != v.cause:
        text += f" (reason {v.reason})"
    if v.position is not None:
        text += f", from token {v.position}"
    d = v.detail
    if v.cause == "wrong_replica":
        text += f"; replica {d['holder']} holds {d['holder_cached_tokens']} tokens of this prefix, {d['replica']} {v.cached_tokens}"
    if "evicted_age_s" in d:
        text += f"; evicted {d['evicted_age_s']} s before"
    if "divergence" in d:
        div = d["divergence"]
        text += (f"\n  before: {div['text_before']!r}\n  this request: {div['text_after']!r}"
                 f"\n  the cache held: {div.get('cached_text_after', '?')!r}")
    if "other_adapters" in d:
        text += f"; cached under adapter(s) {d['other_adapters']}"
    if "models" in d:
        text += f"; models {d['models'][0]!r} vs {d['models'][1]!r}"
    return text
