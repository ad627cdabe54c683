"""What the engine and the planner share: one source for each fact both sides compute.

The operator's planner promises "an engine given these bytes gets exactly this many
blocks", "these layers on this stage", "this step costs this much"; those promises hold
only if both sides compute them with the same code. That code lives here:

- ``arch_config``: the one ``config.json`` reader: ``ArchConfig``, the architecture facts
  (sizes, heads, rope, sliding-window layers, tied embeddings, quantization, dtype, EOS
  ids), read by the same rules for the engine and the planner; ``kv_release_window`` and
  ``hybrid_kv`` (which KV blocks a sequence may drop).
- ``rope``: ``RopeConfig`` and the reading of a config's rope (both transformers layouts,
  Gemma 3's two ropes).
- ``weight_quant``: a checkpoint's FP8 weight format from ``quantization_config``.
- ``kv_layout``: the KV-cache memory formula (``KVLayout``, ``HybridKVLayout``) and the
  tensor-parallel split rule.
- ``gguf``: what a GGUF header means (its ``config.json``-style dict, which tensors stay
  quantized and what each costs in memory).
- ``pipeline_stages``: which layers each pipeline stage holds, and where a rank sits.
- ``step_cost``: FLOPs and memory traffic of a step (the MFU metrics, the planner's latency).
- ``lora_slots``: the projections an adapter targets and the bytes of the LoRA slots.
- ``speculative``: ``SpeculativeConfig``, vLLM's ``--speculative-config`` fields (the flag, the
  engine, and the planner that counts a drafter's memory).
- ``constants``: names and limits shared by the CLI, the engine, the planner and the CRD.
- ``json_object``: vLLM's JSON-valued flags read into frozen dataclasses (one rule for all).

May import: the standard library and ``kvpilot.contract`` itself. Never torch, numpy,
the engine, the kernels or the operator (``tests/structure/test_layering.py`` checks it),
so the operator image (no torch) and the engine both import it freely. Not to be confused
with ``kvpilot.operator.contract``, the InferenceService CRD's schema.
"""
