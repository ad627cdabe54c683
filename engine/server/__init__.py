"""kvpilot's OpenAI-compatible HTTP server (``kvpilot serve``).

``args`` (the command-line parser) is torch-free so that the operator can parse the
flags it writes into a Deployment; everything that touches the engine is imported
lazily by ``cli``.
"""
