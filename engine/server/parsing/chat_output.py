"""One chat choice's text, split into reasoning, content and tool calls as it arrives.

``ChoiceOutput.feed`` takes the next piece of the generated text (the whole text at
once for a plain response) and returns the ``ChoiceDelta`` fields OpenAI's streaming
format sends: ``reasoning_content``, ``content`` and ``tool_calls`` deltas (a call's
first delta carries its id, type and name; later ones more ``arguments`` text). The
reasoning parser runs first; what it calls content goes to the tool-call extractor.
The accumulated ``reasoning``, ``content`` and ``tool_calls`` are the plain response.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.server.parsing.reasoning import Qwen3ReasoningParser
from kvpilot.engine.server.parsing.tool_parsers import CallPiece

REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}


def tool_call_id() -> str:
    """A fresh tool call id (vLLM's shape)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCallState:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class DeltaParts:
    """What one ``feed`` added."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI tool-call deltas

    def as_delta(self) -> dict:
        delta: dict = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ChoiceOutput:
    """Args:
        reasoning_parser: ``qwen3`` or None.
        make_extractor: builds the tool-call extractor (see ``tool_parsers``), or None
            when the text is all content.
    """

    def __init__(self, reasoning_parser: str | None = None,
                 make_extractor: Callable[[], object] | None = None) -> None:
        self._reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        self._extractor = make_extractor() if make_extractor else None
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCallState] = []

    def feed(self, text: str, final: bool = False) -> DeltaParts:
        reasoning, content = (self._reasoning.feed(text, final) if self._reasoning is not None
                              else ("", text))
        pieces: list[CallPiece] = []
        if self._extractor is not None:
            content, pieces = self._extractor.feed(content, final)
        parts = DeltaParts(reasoning, content, [self._apply(p) for p in pieces])
        self.reasoning += reasoning
        self.content += content
        return parts

    def _apply(self, piece: CallPiece) -> dict:
        if piece.name is not None:
            call = ToolCallState(tool_call_id(), piece.name, piece.arguments)
            self.tool_calls.append(call)
            return {"index": piece.index, **call.as_openai()}
        self.tool_calls[piece.index].arguments += piece.arguments
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
