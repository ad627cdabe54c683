"""``--reasoning-parser qwen3``: the ``<think>…</think>`` section becomes ``reasoning_content``.

Qwen3 opens its answer with ``<think>`` when it reasons; what lies between that and
``</think>`` is the reasoning, what follows is the content. An answer that does not
open with ``<think>`` (thinking switched off) is all content. The same parser serves
streams (text arrives in pieces; a piece that might be the start of a tag is held back
until it is decided) and whole answers (one ``feed`` with ``final=True``), so both give
the same split. Like vLLM's streaming parser, an unclosed ``<think>`` leaves the whole
rest as reasoning.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def split_partial(text: str, marker: str) -> tuple[str, str]:
    """``(safe, held)``: ``held`` is the longest end of ``text`` that begins ``marker``
    (it may become the marker once more text arrives), ``safe`` the rest."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""


class Qwen3ReasoningParser:
    """Splits one answer's text, as it arrives, into reasoning and content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "start"      # start -> reasoning -> content, or start -> content

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Adds ``text``; returns the ``(reasoning, content)`` that became certain."""
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._buffer = head[len(THINK_START):]
                self._state = "reasoning"
            elif THINK_START.startswith(head) and not final:
                return "", ""                      # still undecided
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                reasoning, self._buffer = (self._buffer, "") if final else split_partial(
                    self._buffer, THINK_END)
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_END):]
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content
