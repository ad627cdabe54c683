"""The planner: SLOs + the KV memory formula -> engine parameters, with the derivation.

Torch-free (the operator image has no torch). May import: the standard library, pyyaml,
safetensors (header reads), ``gguf`` (GGUF headers) and ``kvpilot.contract``, where the
engine's own rules live (the config.json reader, the KV formula, the step cost, the
pipeline split, the LoRA slots); nothing else of kvpilot. Public API, stable for the operator::

    from kvpilot.operator.planner import PlanRequest, make_plan

    request = PlanRequest.from_dict({
        "model": "qwen3-8b",                      # preset, hub id, config path, or a mapping
        "gpu": "h100-80gb",                       # or {"name": ..., "memory_gib": ...}
        "slo": {"max_context": 32768, "p95_prompt_tokens": 8192, "p95_output_tokens": 1024,
                "concurrency": 64, "ttft_p95_ms": 2000, "itl_p95_ms": 50},
        "overrides": {"tensor_parallel_size": 1},  # optional pinned engine settings
    })                                             # ValueError with a clear message on bad input
    plan = make_plan(request)                      # pure function
    plan.feasible, plan.binding_constraint, plan.suggestions   # Suggestion.apply -> request.apply(...)
    plan.serve_args()                              # ['--max-model-len', '32768', ...]
    plan.to_dict()                                 # JSON-able, snake_case keys
    plan.kv_layout.num_blocks(plan.kv_cache_memory_bytes) == plan.num_gpu_blocks

Listings for validation / UIs: ``model_presets()``, ``gpu_names()``.

Modules: ``gpu`` and ``catalog`` (catalogues), ``model_spec`` / ``weights`` (architecture
and weight bytes), ``slo`` / ``request`` (inputs), ``memory`` / ``latency`` / ``kv_dtype``
(the rules), ``evaluate`` / ``checks`` (one candidate), ``plan`` (the search),
``suggest``, ``explain`` (derivation), ``result`` (Plan), ``render`` and ``cli``;
``pools`` / ``explain_pools``: a disaggregated service's prefill and decode pools and the
ratio between them, with its derivation.
"""

from kvpilot.operator.planner.catalog import model_presets, preset_model, resolve_model
from kvpilot.operator.planner.checks import Check
from kvpilot.operator.planner.gpu import GPUSpec, custom_gpu, get_gpu, gpu_names
from kvpilot.operator.planner.model_spec import ModelSpec, model_from_config
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.result import Plan, Suggestion
from kvpilot.operator.planner.slo import Overrides, ServiceLevel

__all__ = [
    "Check", "GPUSpec", "ModelSpec", "Overrides", "Plan", "PlanRequest", "ServiceLevel", "Suggestion",
    "custom_gpu", "get_gpu", "gpu_names", "make_plan", "model_from_config", "model_presets",
    "preset_model", "resolve_model",
]
