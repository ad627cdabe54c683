"""A prefix-cache miss in words: the explanation endpoint's answer, the request log line and
the opt-in ``usage.prompt_tokens_details`` entry, built from a ``PrefixMiss``
(``core.prefix_miss``) and the prompt's token ids.

Two audiences: the operator (``explanation``, the log line) sees what the cache held where
the prompt diverged; a client (``client_details``) sees only its own prompt's text and
never learns about other tenants' prompts: a miss because the same tokens were cached
under another cache salt is reported to it as ``never_seen``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpilot.engine.core.prefix_miss import DIFFERENT_CACHE_SALT, DIVERGENCE, NEVER_SEEN, PrefixMiss
from kvpilot.engine.text.prefix_diff import describe

if TYPE_CHECKING:
    from kvpilot.engine.core.kv_cache_manager import PrefixHit
    from kvpilot.engine.text.tokenizer import Tokenizer

CONTEXT_TOKENS = 12   # tokens decoded each side of a divergence


def _decode(tokenizer: Tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def divergence_text(miss: PrefixMiss, prompt_ids: list[int], tokenizer: Tokenizer,
                    include_cached: bool) -> dict[str, Any]:
    """The text around a divergence's position: the shared text before it, the prompt's
    text after it, the kind of change and (``include_cached``) what the cache held."""
    p = miss.position
    before = _decode(tokenizer, prompt_ids[max(0, p - CONTEXT_TOKENS):p])
    ours = _decode(tokenizer, prompt_ids[p:p + CONTEXT_TOKENS])
    seen = miss.seen_token_ids[p - miss.block_start:] if miss.block_start is not None else ()
    theirs = _decode(tokenizer, seen)
    found = describe(before, ours, theirs)
    text = {"kind": found.kind, "text_before": found.before, "text_after": found.ours}
    if include_cached:
        text["cached_text_after"] = found.theirs
    return text


def miss_fields(miss: PrefixMiss, prompt_ids: list[int], tokenizer: Tokenizer,
                operator: bool) -> dict[str, Any]:
    """A miss as JSON fields; ``operator``: everything the cache knows, else the client's view."""
    reason = miss.reason
    if not operator and reason == DIFFERENT_CACHE_SALT:
        reason = NEVER_SEEN
    fields: dict[str, Any] = {"reason": reason, "tokens": miss.num_tokens, "position": miss.position}
    if miss.evicted_age_s is not None:
        fields["evicted_age_s"] = round(miss.evicted_age_s, 3)
    if miss.reason == DIVERGENCE:
        fields["divergence"] = divergence_text(miss, prompt_ids, tokenizer, include_cached=operator)
    if operator and miss.other_adapters:
        fields["other_adapters"] = list(miss.other_adapters)
    return fields


def client_details(miss: PrefixMiss | None, prompt_ids: list[int], tokenizer: Tokenizer) -> dict | None:
    """One prompt's entry of ``usage.prompt_tokens_details.prefix_cache_misses`` (None: no miss)."""
    return None if miss is None else miss_fields(miss, prompt_ids, tokenizer, operator=False)


def log_summary(miss: PrefixMiss | None, num_prompt: int, num_cached: int) -> str:
    """The prefix-cache part of a request's log line."""
    text = f"{num_cached} of {num_prompt} prompt tokens cached"
    if miss is None:
        return text
    text += f"; {miss.num_tokens} missed from token {miss.position}: {miss.reason}"
    if miss.evicted_age_s is not None:
        text += f" {miss.evicted_age_s:.1f} s ago"
    return text


def explanation(prompt_ids: list[int], hit: PrefixHit | None, miss: PrefixMiss | None,
                block_size: int, tokenizer: Tokenizer, *, caching: bool, explained: bool) -> dict:
    """The explanation endpoint's answer for one prompt (operator-facing)."""
    out: dict[str, Any] = {"prompt_tokens": len(prompt_ids), "block_size": block_size,
                           "prefix_caching": caching, "miss_reasons": explained}
    if hit is None:
        out["cached_tokens"] = 0
        return out
    out.update(cached_tokens=hit.num_tokens, cached_blocks=len(hit.blocks),
               token_granular_tokens=hit.partial[1] if hit.partial is not None else 0,
               note="the device prefix cache only; the offload tiers are not consulted")
    if miss is not None:
        out["miss"] = miss_fields(miss, prompt_ids, tokenizer, operator=True)
    return out
