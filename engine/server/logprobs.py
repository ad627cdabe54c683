"""Engine logprobs in the two OpenAI shapes.

The engine gives, per generated token, a dict ``{token_id: Logprob}`` holding the
sampled token and the top-k alternatives (``Logprob.rank``: 1 = most likely).

- Completions (legacy): parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (one ``{token text: logprob}`` dict per position) and
  ``text_offset`` (character offset of each token in the generated text).
- Chat: ``content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``.
"""

from __future__ import annotations

import math

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.server.protocol import ChatLogProb, ChatLogProbsContent, CompletionLogProbs

# JSON has no -inf; OpenAI reports very unlikely tokens with a large negative number.
MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _text(token_id: int, logprob: Logprob | None, decode) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode([token_id], skip_special_tokens=False)


def _ranked(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top ``k`` entries by rank (entries without a rank last)."""
    ranked = sorted(entries.items(), key=lambda item: item[1].rank if item[1].rank is not None
                    else math.inf)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        decode, text_offset: int = 0) -> CompletionLogProbs:
    """Legacy completions logprobs for ``token_ids`` (``entries`` aligned with them).

    ``top_logprobs`` holds the top ``k`` tokens plus the sampled one; ``text_offset``
    starts at ``text_offset`` (non-zero for a later streaming chunk).
    """
    result = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        text = _text(token_id, sampled, decode)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
        top = {_text(tid, lp, decode): _finite(lp.logprob) for tid, lp in _ranked(entry, k)}
        if sampled is not None:
            top.setdefault(text, _finite(sampled.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  decode) -> list[ChatLogProbsContent]:
    """Chat-completions ``logprobs.content`` for ``token_ids`` with ``k`` top alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        text = _text(token_id, sampled, decode)
        top = [ChatLogProb(token=(t := _text(tid, lp, decode)), logprob=_finite(lp.logprob),
                           bytes=list(t.encode("utf-8")))
               for tid, lp in _ranked(entry, k)]
        content.append(ChatLogProbsContent(
            token=text, logprob=_finite(sampled.logprob) if sampled is not None else MIN_LOGPROB,
            bytes=list(text.encode("utf-8")), top_logprobs=top))
    return content
