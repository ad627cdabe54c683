"""kvpilot's OpenAI-compatible HTTP server (``kvpilot serve``).

``vllm_flags`` is the table of every ``kvpilot serve`` flag (vLLM's, honoured or refused,
and kvpilot's own; ``flag_table`` says what a row holds and builds the parser, the help
and the flag tables of ``docs/serving.md`` from rows); ``args`` is the parser built from it. They are
torch-free so that the operator can parse the flags it writes into a Deployment.
Everything that touches the engine is imported lazily by ``cli``. ``parsing/`` turns chat answers into reasoning, content and tool calls;
``structured`` maps a request's output constraint onto the engine's.

May import: FastAPI, uvicorn, pydantic, prometheus-client, the engine's public API and its
``core``, ``text``, ``lora``, ``kv_events``, ``structured_output`` and ``deploy``, and
``kvpilot.contract``; never ``kvpilot.engine.model`` at module level (torch), nor the operator.
"""
