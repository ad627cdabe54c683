"""kvpilot's OpenAI-compatible HTTP server (``kvpilot serve``).

``args`` / ``args_frontend`` (the command-line parser) are torch-free so that the
operator can parse the flags it writes into a Deployment; ``vllm_flags`` holds the table
of vLLM's flags (honoured or refused). Everything that touches the engine is imported
lazily by ``cli``. ``parsing/`` turns chat answers into reasoning, content and tool calls;
``structured`` maps a request's output constraint onto the engine's.
"""
