"""What a chat request's ``tools`` and ``tool_choice`` mean for its generation.

- ``none``: the tools are shown to the chat template (unless
  ``--exclude-tools-when-tool-choice-none``); the answer is plain content.
- ``auto`` (the default when tools are sent): needs ``--enable-auto-tool-choice`` and a
  ``--tool-call-parser``, which finds calls in the model's free text.
- ``required``: the answer is constrained (structured outputs) to a JSON array of
  ``{"name": <one of the tools>, "parameters": <its parameter schema>}``, at least one
  (exactly one with ``parallel_tool_calls: false``), so every call is valid JSON for its
  function.
- a named function: the answer is constrained to that function's parameter schema and
  is returned as its arguments.

This follows vLLM's handling, including the shape of the ``required`` array.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.server.config import ChatConfig
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.parsing.tool_parsers import (
    TOOL_CALL_EXTRACTORS,
    NamedFunctionExtractor,
    RequiredExtractor,
)
from kvpilot.engine.server.protocol import ChatCompletionRequest

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """Args:
        template_tools: the tool definitions for the chat template (None: no tools).
        constraint: the structured-output constraint forcing valid calls, if any.
        make_extractor: builds the tool-call extractor for each choice, if calls are parsed.
        finish_with_tool_calls: report ``finish_reason: "tool_calls"`` when calls were made
            (auto and required; a named function finishes with ``stop``, as in vLLM).
    """

    template_tools: list[dict] | None = None
    constraint: StructuredOutputsParams | None = None
    make_extractor: Callable[[], object] | None = None
    finish_with_tool_calls: bool = False


NO_TOOLS = ToolPlan()   # a request without tools (and without tool_choice)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """JSON schema of ``tool_choice: "required"``'s answer: an array of calls."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"]}
             for t in tools]
    schema = {"type": "array", "minItems": 1,
              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(body: ChatCompletionRequest, chat: ChatConfig) -> ToolPlan:
    """The ``ToolPlan`` of a request; 400 for a tool choice this server cannot serve."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(None if chat.exclude_tools_when_tool_choice_none else tools)
    if choice == "auto":
        if not chat.enable_auto_tool_choice or chat.tool_call_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set (or send tool_choice \"required\", "
                              '"none" or a named function)', param="tool_choice")
        return ToolPlan(tools, make_extractor=TOOL_CALL_EXTRACTORS[chat.tool_call_parser],
                        finish_with_tool_calls=True)
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls is not False)
        return ToolPlan(tools, StructuredOutputsParams(json=schema), RequiredExtractor,
                        finish_with_tool_calls=True)
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")
    parameters = next(t["function"].get("parameters") for t in tools
                      if t["function"]["name"] == name) or ANY_OBJECT
    return ToolPlan(tools, StructuredOutputsParams(json=parameters),
                    lambda: NamedFunctionExtractor(name))
