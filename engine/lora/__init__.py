"""LoRA adapters on one base model (vLLM's ``--enable-lora``), the punica / S-LoRA idea.

- ``config``: ``LoRAConfig`` (``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``,
  ``--lora-dtype``, ``--lora-modules``) (torch-free).
- ``memory``: the device memory the adapter slots take from the KV budget, by the formula
  the planner shares (``kvpilot.contract.lora_slots``: the targeted projections, their
  shapes, the slots' bytes) (torch-free).
- ``request``: ``LoRARequest``, what a request carries of its adapter (torch-free).
- ``checkpoint``: reading and validating a PEFT checkpoint (``adapter_config.json`` +
  ``adapter_model.safetensors``) into host tensors.
- ``registry``: the adapters by name, the host LRU (``--max-cpu-loras``) and the device
  slot LRU (``--max-loras``); reference counts keep an adapter alive while requests use it.
- ``layers``: the stacked device slots and the wrapper adding a gathered low-rank delta to
  each targeted projection, per token row, in the same forward as the base rows.

May import: torch, safetensors, ``kvpilot.contract``, ``kvpilot.engine.core``, the
engine's config and ``kvpilot.engine.model`` (the wrapped projections; the torch-free
modules above import neither torch nor numpy).
"""
