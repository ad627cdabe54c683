"""Attention over the paged KV cache: metadata, backend interface and the torch path.

May import: torch, ``kvpilot.kernels`` and ``kvpilot.contract``; nothing else of the engine.
"""

from kvpilot.engine.model.attention.backend import AttentionBackend, select_attention_backend
from kvpilot.kernels.attention_metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "select_attention_backend"]
