"""Finding tool calls in a model's text, as it streams in.

Each extractor takes the answer's content in pieces (``feed``) and returns the content
that is certainly plain text plus ``CallPiece``s: a new call (with its name) or more of
a call's ``arguments`` JSON text. The same code serves a stream and a whole answer
(one ``feed`` with ``final=True``), so both report the same calls.

- ``HermesExtractor`` (``--tool-call-parser hermes``, Qwen2.5 / Qwen3 / Hermes models):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text outside
  them is content (whitespace around calls is dropped).
- ``Llama3JsonExtractor`` (``llama3_json``): an answer that opens with ``{`` or
  ``<|python_tag|>`` is a ``;``-separated list of ``{"name": ..., "parameters": {...}}``
  objects; any other answer is content.
- ``NamedFunctionExtractor`` (``tool_choice`` naming a function): the whole answer is
  that function's arguments (constrained to its parameter schema), streamed as it comes.
- ``RequiredExtractor`` (``tool_choice: "required"``): the answer is a JSON array of
  ``{"name": ..., "parameters": {...}}`` (constrained), each call sent once complete.

A block that is not a valid call is returned as content rather than dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvpilot.engine.server.parsing.reasoning import split_partial

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class CallPiece:
    """Part of tool call ``index``: its start (``name`` set) or more ``arguments`` text."""

    index: int
    name: str | None
    arguments: str


def call_from_json(obj, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class _Extractor:
    """Shared bookkeeping: the text buffer, call numbering, held-back whitespace."""

    def __init__(self) -> None:
        self._buffer = ""
        self._pending_space = ""     # whitespace not yet known to be content
        self.num_calls = 0

    def _call(self, name: str, arguments: str) -> CallPiece:
        self.num_calls += 1
        return CallPiece(self.num_calls - 1, name, arguments)

    def _content(self, text: str, final: bool) -> str:
        """Content to emit: whitespace is held until real text follows it; at the end it
        is dropped if the answer made calls."""
        text = self._pending_space + text
        if text.strip():
            self._pending_space = ""
            return text
        self._pending_space = text
        if final:
            self._pending_space = ""
            return "" if self.num_calls else text
        return ""


class HermesExtractor(_Extractor):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        content, run, pieces = "", "", []     # run: text since the last call
        while True:
            if not self._in_call:
                start = self._buffer.find(self.START)
                if start < 0:
                    safe, self._buffer = (self._buffer, "") if final else split_partial(
                        self._buffer, self.START)
                    run += safe
                    break
                run += self._buffer[:start]
                self._buffer = self._buffer[start + len(self.START):]
                self._in_call = True
            end = self._buffer.find(self.END)
            if end < 0 and not final:
                break
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(self.END):]
            self._in_call = False
            try:
                call = call_from_json(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                run += self.START + body + (self.END if end >= 0 else "")
            else:
                content += self._content(run, False)
                run, self._pending_space = "", ""   # whitespace before a call is dropped
                pieces.append(self._call(*call))
            if end < 0:
                break
        return content + self._content(run, final), pieces


class Llama3JsonExtractor(_Extractor):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None      # None (undecided), "calls" or "content"

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(self.PYTHON_TAG) or head.startswith("{"):
                self._mode = "calls"
                self._buffer = head.removeprefix(self.PYTHON_TAG)
            elif not final and (not head or self.PYTHON_TAG.startswith(head)):
                return "", []
            else:
                self._mode = "content"
        if self._mode == "content":
            content, self._buffer = self._buffer, ""
            return content, []
        pieces = []
        while True:
            rest = self._buffer.lstrip().lstrip(";").lstrip()
            if not rest:
                self._buffer = ""
                break
            try:
                obj, end = _DECODER.raw_decode(rest)
            except json.JSONDecodeError:
                self._buffer = rest
                break                           # incomplete (or, at the end, not JSON)
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                self._buffer = rest
                break
            pieces.append(self._call(*call))
            self._buffer = rest[end:]
        content = ""
        if final and self._buffer:
            content, self._buffer = self._buffer, ""
        return content, pieces


class NamedFunctionExtractor(_Extractor):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallPiece]]:
        if self.num_calls == 0:
            return "", [self._call(self._name, text)]
        return "", [CallPiece(0, None, text)] if text else []


class RequiredExtractor(_Extractor):
    def __init__(self) -> None:
        super().__init__()
        self._opened = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallPiece]]:
        self._buffer += text
        pieces = []
        while True:
            rest = self._buffer.lstrip()
            if not self._opened:
                if not rest.startswith("["):
                    break
                self._opened, rest = True, rest[1:]
            rest = rest.lstrip().lstrip(",").lstrip()
            self._buffer = rest
            if not rest or rest.startswith("]"):
                break
            try:
                obj, end = _DECODER.raw_decode(rest)
            except json.JSONDecodeError:
                break
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                break
            pieces.append(self._call(*call))
            self._buffer = rest[end:]
        content = ""
        if final:
            leftover = self._buffer.strip()
            if leftover and leftover != "]":   # cut short (max_tokens): keep what there is
                content = self._buffer
            self._buffer = ""
        return content, pieces


TOOL_CALL_EXTRACTORS = {"hermes": HermesExtractor, "llama3_json": Llama3JsonExtractor}
