"""Model building blocks: norms, rotary embeddings, FP8 and GGUF linear layers.

May import: torch, ``kvpilot.kernels`` and ``kvpilot.contract``; nothing else of the engine.
"""
