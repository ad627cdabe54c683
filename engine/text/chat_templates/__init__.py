"""Chat templates: rendering a checkpoint's Jinja template, and kvpilot's own templates.

Checkpoints ship their chat template as untrusted Jinja source, so it is rendered in
jinja2's ``ImmutableSandboxedEnvironment`` with the set-up HF transformers gives
templates (so a template renders the same text here and there): ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, a ``{% generation %}`` block (which only
marks assistant text for training masks and here just renders its body), the
``tojson`` filter (no HTML escaping, ``indent``/``separators``/``sort_keys`` options)
and the globals ``raise_exception`` and ``strftime_now``. The caller adds the special
tokens (``bos_token``, ``eos_token``, ...) as variables.

The ``*.jinja`` files beside this module are kvpilot's own templates
(:func:`builtin_template`). May import: jinja2 only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template could not be compiled, or refused the conversation."""


def builtin_template(name: str) -> str:
    """Source of one of kvpilot's templates, e.g. ``"chatml"`` (file ``chatml.jinja``)."""
    path = resources.files(__name__) / f"{name}.jinja"
    if not path.is_file():
        raise ValueError(f"no built-in chat template named {name!r}")
    return path.read_text(encoding="utf-8")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile template ``source`` in the sandbox described in the module docstring.

    Raises:
        ChatTemplateError: the source is not valid Jinja.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile: {exc} (line {exc.lineno})"
        ) from exc


def _plain(value: Any) -> Any:
    """Copy ``value`` into plain JSON-like data (dict / list / scalars) for the template.

    Objects with ``model_dump`` (pydantic, e.g. OpenAI SDK messages) are dumped first.
    """
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    raise TypeError(
        f"chat data must be JSON-like (dict, list, str, number, bool, None), got {type(value).__name__}"
    )


def normalize_messages(messages) -> list[dict]:
    """Validate ``messages`` and copy them for rendering.

    Each message must be a mapping (or a pydantic model) with a ``role``; keys whose
    value is ``None`` are dropped, as many templates test for a key's presence
    (``content=None`` next to ``tool_calls`` is what OpenAI clients send).

    Raises:
        ValueError: an empty conversation or a message without a role.
        TypeError: a message that is not a mapping.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    normalized = []
    for index, message in enumerate(messages):
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise TypeError(
                f"message {index} must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {index} has no 'role' string: {dict(message)!r}")
        normalized.append({k: _plain(v) for k, v in message.items() if v is not None})
    return normalized


def render_chat_template(
    template: jinja2.Template,
    messages,
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render a compiled chat template.

    Args:
        template: from :func:`compile_chat_template`.
        messages: the conversation (see :func:`normalize_messages`).
        add_generation_prompt: end with the header that opens an assistant turn.
        tools: tool JSON schemas (dicts), or None.
        documents: retrieval documents for templates that take them, or None.
        variables: further template variables: the special tokens and any
            template-specific switches (e.g. ``enable_thinking``).

    Raises:
        ChatTemplateError: the template raised (``raise_exception``) or failed.
    """
    if tools is not None:
        if not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be JSON schema dicts")
        tools = _plain(tools)
    context = {k: _plain(v) for k, v in (variables or {}).items()}
    context.update(
        messages=normalize_messages(messages),
        tools=tools,
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return template.render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
