"""kvpilot's paged-KV inference engine.

The public offline API mirrors vLLM's: ``from kvpilot.engine import LLM, SamplingParams``.
Heavy names are imported lazily (PEP 562) so that importing a torch-free sub-package
(``core``, ``text``) does not import torch.

Layout, by the path a request takes (each sub-package's docstring says what it may import):

- top level: the public API: ``LLM`` (``llm.py``), ``LLMEngine`` (``llm_engine.py``: add
  requests, ``step()``; ``output_processor.py`` turns sampled tokens into text, stops and
  outputs), ``EngineArgs`` (``engine_args.py``), ``SamplingParams``,
  ``RequestOutput`` (``outputs.py``), ``EngineStats`` (``stats.py``), the frozen
  configs (``config.py``) and ``EngineDeadError`` (``exceptions.py``).
- ``core/`` (torch-free): what a step decides: block hashing, the block pool, the KV cache
  manager, requests, queues, the scheduler, the KV transfer list, the KV event log.
- ``model/`` (torch): what a step computes: the model runner, checkpoint loading, the
  engine's checks on a config.json, sampling, memory profiling, attention backends,
  layers and models (the demo model included); ``model/parallel/``: one replica over
  ranks (tensor and pipeline parallelism).
- ``text/`` (no torch): tokens <-> text: tokenizer, tiktoken conversion, detokenizer, stop
  checks, chat templates.
- ``offload/``: KV offload tiers (host memory, disk, LMCache).
- ``lora/``: LoRA adapters: PEFT checkpoints, the adapter registry (device slots, host
  LRU), the batched low-rank delta in the model's projections.
- ``deploy/``: a replica over the pods of a LeaderWorkerSet group (the environment, the
  pods' heartbeats, a worker pod's process).
- ``structured_output/``: grammars for constrained outputs; ``kv_events/``: the KV-event
  publisher.
- ``server/``: the OpenAI-compatible HTTP server; ``cli/``: the ``kvpilot`` command;
  ``bench/``: benchmarks.

What the engine shares with the planner (the config.json reader, the KV formula, the
GGUF contract, the pipeline split, a step's cost, the shared names) is
``kvpilot.contract``, outside the engine. May import: ``kvpilot.contract`` and
``kvpilot.kernels``; never ``kvpilot.operator`` (``tests/structure/test_layering.py``).
"""

from importlib import import_module

_LAZY = {
    "LLM": "kvpilot.engine.llm",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "RequestOutputKind": "kvpilot.engine.sampling_params",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "EngineArgs": "kvpilot.engine.engine_args",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
    "EngineStats": "kvpilot.engine.stats",
    "EngineDeadError": "kvpilot.engine.exceptions",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
