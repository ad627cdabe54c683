"""Turning a chat answer's text into OpenAI's message fields, and tools into constraints.

- ``reasoning``: ``--reasoning-parser qwen3`` (``<think>`` text -> ``reasoning_content``).
- ``tool_parsers``: tool calls in text (``hermes``, ``llama3_json``) and in constrained
  answers (``required``, a named function).
- ``tool_choice``: ``tools`` + ``tool_choice`` -> template tools, a constraint, a parser.
- ``chat_output``: one choice's text, as it streams, -> reasoning, content, tool calls.

Torch-free; used by ``routes_chat``. May import: ``kvpilot.engine.server.config`` and the
engine's sampling parameters; nothing that touches the engine.
"""
