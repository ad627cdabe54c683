"""Model implementations (decoder-only transformers) and which one runs an architecture.

``models.llama`` runs the Llama family (Llama, Mistral, Qwen2, Qwen3; switches in the
config), ``models.gemma3`` Gemma 3; ``contract.arch_config.SUPPORTED_ARCHITECTURES`` lists the
architecture names the engine accepts.

May import: torch, ``kvpilot.kernels``, ``kvpilot.contract`` and the model side's
``attention/``, ``layers/`` and ``parallel/``.
"""

from __future__ import annotations

from torch import nn

from kvpilot.contract.arch_config import GEMMA3_ARCHITECTURES, SUPPORTED_ARCHITECTURES


def model_class(architecture: str) -> type[nn.Module]:
    """The module class that runs ``architecture`` (an HF ``architectures`` name)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if architecture in GEMMA3_ARCHITECTURES:
        from kvpilot.engine.model.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from kvpilot.engine.model.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
