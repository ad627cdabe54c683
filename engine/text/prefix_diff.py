"""What changed where two prompts part: the text around the first differing token and a
guess at the kind of change (pure string work, no tokenizer of its own).

A prompt that misses the prefix cache by divergence usually differs from the cached one
in a way a person would name: an edited system prompt, a whitespace change in a chat
template, a date or time stamped into the prompt, or the same text cut into different
tokens at a boundary. ``divergence_kind`` names it from the decoded texts after the
shared prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WHITESPACE, DATE, TOKENIZATION, EDIT = "whitespace", "date", "tokenization", "edit"
KINDS = (WHITESPACE, DATE, TOKENIZATION, EDIT)

# Dates and times as prompts carry them: ISO dates, d/m/y, month names, clock times, weekdays.
_DATE = re.compile(
    r"\d{4}-\d{1,2}-\d{1,2}|\d{1,2}[/.]\d{1,2}[/.]\d{2,4}|\d{1,2}:\d{2}(?::\d{2})?|"
    r"\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+\d{1,2}\b|"
    r"\b\d{1,2}\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\b|"
    r"\b(?:mon|tues|wednes|thurs|fri|satur|sun)day\b", re.IGNORECASE)
CONTEXT_CHARS = 40


@dataclass(frozen=True, slots=True)
class Divergence:
    """Two texts after their shared prefix: ``before`` (the shared text just before the
    split), ``ours`` / ``theirs`` (each one's text from the split on) and the ``kind``."""

    kind: str
    before: str
    ours: str
    theirs: str


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _dates(text: str) -> list[str]:
    return [m.group(0) for m in _DATE.finditer(text)]


def divergence_kind(before: str, ours: str, theirs: str) -> str:
    """The kind of change between two texts that agree up to ``before``.

    ``ours`` and ``theirs`` are each text's continuation (``theirs`` may be cut short:
    a cache only knows the block it held). Returns ``tokenization`` when the texts agree
    as far as both are known (only the tokens differ), ``whitespace`` when they agree once
    whitespace is dropped, ``date`` when a date or time around the split differs, else
    ``edit``.
    """
    shared = _common_prefix(ours, theirs)
    if shared >= min(len(ours), len(theirs)) and theirs:
        return TOKENIZATION
    a, b = _squeezed(ours), _squeezed(theirs)
    known = min(len(a), len(b))
    if known and a[:known] == b[:known] and (ours[shared:shared + 1].isspace()
                                           or theirs[shared:shared + 1].isspace()):
        return WHITESPACE
    # a date spanning the split: look at the shared text's tail with each continuation
    tail = before[-24:] + ours[:shared]
    around_ours, around_theirs = tail + ours[shared:shared + 24], tail + theirs[shared:shared + 24]
    if _dates(around_ours) != _dates(around_theirs) and (_dates(around_ours) or _dates(around_theirs)):
        return DATE
    return EDIT


def describe(before: str, ours: str, theirs: str, context: int = CONTEXT_CHARS) -> Divergence:
    """``divergence_kind`` with the texts cut to ``context`` characters each side."""
    return Divergence(divergence_kind(before, ours, theirs), before[-context:], ours[:context],
                      theirs[:context])
