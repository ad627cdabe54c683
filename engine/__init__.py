"""kvpilot's paged-KV inference engine.

The public offline API mirrors vLLM's: ``from kvpilot.engine import LLM, SamplingParams``.
Heavy names are imported lazily (PEP 562) so that torch-free modules such as
``kvpilot.engine.kv_budget`` can be imported by the operator, whose image has no torch.
"""

from importlib import import_module

_LAZY = {
    "LLM": "kvpilot.engine.llm",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "EngineArgs": "kvpilot.engine.engine_args",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
