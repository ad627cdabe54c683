"""The operator's use of the planner: spec -> ``PlanRequest`` -> ``Plan`` -> sizing + status.

Typed all the way: the parsed spec's ``ServiceLevel`` is the request's, its pinned engine
settings become ``Overrides``, and a feasible plan becomes the builders' ``EngineSizing``
(``PlanOutcome.sizing``, present exactly when the plan is feasible).

Mapping rules (the planner's own rules decide everything else):

- the model is a catalogue preset: ``spec.model.architecture``, else the hf:// repo id
  (a ``-GGUF`` suffix dropped), else the last one or two path parts of a pvc:// / s3:// /
  image path URI. The operator never reads a path the spec names (``{"preset": ...}`` only);
- a GGUF file (``hf://org/name/file.gguf``, a pvc:// path ending in ``.gguf``) is sized as the
  unquantized preset: on a GPU the engine dequantizes every GGUF tensor at load (its block
  kernel is CPU-only), so the file's smaller size is not what the GPU holds;
- ``gpu.count`` pins ``tensor_parallel_size`` (GPUs per pod); ``gpu.perNode`` is the
  planner's ``gpus_per_node`` and ``gpu.nodes`` pins ``pipeline_parallel_size`` (pods per
  replica, one a node; unset, the planner adds nodes only when one cannot hold the weights
  and the SLO's KV);
  a count the engine cannot split the model over (heads, MLP), or combined with KV
  offloading (not implemented under tensor parallelism), is ``Unsupported``, with the
  reason; ``spec.replicas`` pins replicas while
  autoscaling is off (0, scaled to zero, is passed to the Deployment only);
  ``spec.engine`` fields pin the engine settings;
- ``spec.disaggregation``: each pool is planned on its own (``planner.pools``; a pool's
  ``engine`` settings over the service's) and the prefill:decode ratio sized from the SLO;
  the sizing is the decode pool's, carrying the prefill pool's (``EngineSizing.prefill``),
  each with its ``--kv-transfer-config`` role, and ``status.plan.disaggregation`` both pools;
- offload is opt-in: with ``offload.enabled`` false both tiers are pinned to 0; when
  enabled, ``cpuGiB`` / ``disk.sizeGiB`` pin the tiers and an unset size is the planner's
  (a disk tier exists only when ``offload.disk`` is given); ``offload.backend`` is passed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.contract.constants import MAX_TENSOR_PARALLEL_SIZE
from kvpilot.contract.kv_transfer import KV_CONSUMER, KV_PRODUCER
from kvpilot.operator.planner.catalog import model_presets, preset_key, preset_model
from kvpilot.operator.planner.explain_pools import pool_derivation
from kvpilot.operator.planner.gpu import get_gpu
from kvpilot.operator.planner.model_spec import ModelSpec
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.pools import DECODE, PREFILL, PoolPlan, plan_pools
from kvpilot.operator.planner.result import Plan
from kvpilot.operator.planner.slo import Overrides
from kvpilot.operator.resources.sizing import EngineSizing
from kvpilot.operator.spec import DisaggregationSpec, InferenceServiceSpec

# GPUs per replica the engine can use: MAX_TENSOR_PARALLEL_SIZE (one node), the CRD's
# gpu.count maximum too.

# Plan fields copied into status.plan (camelCase there); the CRD's status schema lists them.
STATUS_FIELDS = (
    "model", "gpu", "tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node", "replicas", "kv_cache_dtype", "kv_dtype_bytes",
    "kv_bytes_per_token", "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks",
    "block_size", "kv_token_capacity", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "enable_prefix_caching", "resident_prefix_tokens", "cpu_offload_gib", "disk_offload_gib",
    "offload_backend", "pod_memory_gib", "shm_gib", "binding_constraint", "binding_detail",
    "estimates", "limits", "derivation", "warnings",
)
_CAMEL = re.compile(r"_([a-z0-9])")
_GGUF_REPO_SUFFIX = re.compile(r"[-_.]gguf$", re.IGNORECASE)


def camel(name: str) -> str:
    """snake_case -> camelCase (``cpu_offload_gib`` -> ``cpuOffloadGib``)."""
    return _CAMEL.sub(lambda m: m[1].upper(), name)


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    """The planner's verdict in the operator's terms.

    Args:
        reason: condition reason: ``Planned``, ``Infeasible``, ``Unsupported`` or ``InvalidSpec``.
        message: one paragraph for the condition and the Event.
        binding_constraint: the planner's binding constraint (None for an invalid spec).
        suggestions: the planner's verified suggestions, as sentences.
        sizing: what the builders need; present exactly when the plan is feasible.
    """

    reason: str
    message: str
    binding_constraint: str | None = None
    suggestions: tuple[str, ...] = ()
    sizing: EngineSizing | None = None

    @property
    def feasible(self) -> bool:
        """A plan the children can be built from exists."""
        return self.sizing is not None

    @classmethod
    def rejected(cls, reason: str, message: str) -> PlanOutcome:
        return cls(reason, message)


def model_preset(spec: InferenceServiceSpec) -> str:
    """The catalogue name the planner should size ``spec.model`` as; ValueError if none fits."""
    if spec.model.architecture:
        return spec.model.architecture
    candidates = []
    if spec.model.repo_id:
        candidates.append(spec.model.repo_id)
        candidates.append(_GGUF_REPO_SUFFIX.sub("", spec.model.repo_id))   # Qwen/Qwen3-8B-GGUF
    parts = (spec.model.sub_path or spec.model.image_path or "").strip("/").split("/")
    if parts and parts[-1]:
        candidates += ["/".join(parts[-2:]), parts[-1]]
    for name in candidates:
        if preset_key(name) is not None:
            return name
    raise ValueError(f"cannot tell the architecture of {spec.model.uri!r}: set spec.model.architecture "
                     f"to one of: {', '.join(model_presets())}")


def plan_overrides(spec: InferenceServiceSpec) -> Overrides:
    """What ``spec`` pins for the planner (see the module docstring for the rules)."""
    offload = spec.offload
    overrides = {
        "tensor_parallel_size": spec.gpu.count,
        "gpus_per_node": spec.gpu.per_node,
        "pipeline_parallel_size": spec.gpu.nodes,
        # 0 (scaled to zero) is not a size to plan for: plan one replica's worth
        "replicas": spec.replicas if spec.replicas and not spec.autoscaling.enabled else None,
        **spec.engine.pinned,
    }
    if spec.lora is not None:   # the adapter slots come out of the KV budget
        overrides["max_loras"] = spec.lora.max_loras
        overrides["max_lora_rank"] = spec.lora.max_lora_rank
    if offload.enabled:
        overrides["cpu_offload_gib"] = offload.cpu_gib
        overrides["disk_offload_gib"] = (offload.disk_gib if offload.disk else 0)
        overrides["offload_backend"] = offload.backend
    else:
        overrides["cpu_offload_gib"] = overrides["disk_offload_gib"] = 0
    return Overrides(**{k: v for k, v in overrides.items() if v is not None})


def gguf_file(spec: InferenceServiceSpec) -> str | None:
    """The GGUF file ``spec.model`` names, if it names one."""
    name = spec.model.file or spec.model.sub_path or spec.model.image_path or ""
    return name if name.lower().endswith(".gguf") else None


def planned_model(spec: InferenceServiceSpec) -> ModelSpec:
    """The catalogue model for ``spec`` (a GGUF file: dequantized at load on the GPU, so the
    preset's unquantized bytes, and the derivation says so)."""
    model = preset_model(model_preset(spec))
    file = gguf_file(spec)
    if file is None:
        return model
    return replace(model, weight_source=f"{model.weight_source}; the GGUF file {file.rsplit('/', 1)[-1]} "
                                        f"is dequantized to {model.dtype} at load on a GPU")


def plan_request(spec: InferenceServiceSpec) -> PlanRequest:
    """The ``PlanRequest`` for ``spec``; ValueError when the model is not one the planner
    knows or a pinned value is out of the planner's range."""
    return PlanRequest(model=planned_model(spec), gpu=get_gpu(spec.gpu.type), slo=spec.slo,
                       overrides=plan_overrides(spec))


def plan_status(plan: Plan) -> dict[str, Any]:
    """``status.plan``: the plan's main outputs, its derivation and the exact serve flags."""
    data = plan.to_dict()
    status = {camel(name): data[name] for name in STATUS_FIELDS}
    status["estimates"] = {camel(k): v for k, v in data["estimates"].items() if v is not None}
    status["limits"] = {camel(k): v for k, v in data["limits"].items()}
    status["serveArgs"] = data["serve_args"]
    # what the planner expects profiling to leave for the KV cache: the closed loop compares
    # the engines' profiled figure with it (sizing_drift)
    status["kvEstimateBytes"] = data["memory"]["kv_estimate_bytes"]
    return {k: v for k, v in status.items() if v is not None}


def sizing_of(plan: Plan, extra_args: tuple[str, ...] = (), replicas: int | None = None) -> EngineSizing:
    """The builders' sizing of ``plan``; ``extra_args`` join its serve flags (a pool's KV
    transfer role), ``replicas`` replaces the plan's count (a pool's, from the ratio)."""
    status = plan_status(plan)
    status["serveArgs"] = [*status["serveArgs"], *extra_args]
    if replicas is not None:
        status["replicas"] = replicas
    return EngineSizing(
        serve_args=tuple(status["serveArgs"]), replicas=plan.replicas if replicas is None else replicas,
        cpu_offload_gib=float(plan.cpu_offload_gib), disk_offload_gib=float(plan.disk_offload_gib),
        offload_backend=plan.offload_backend, disk_path=plan.offload_disk_path,
        shm_gib=float(plan.shm_gib), memory_gib=float(plan.pod_memory_gib), gpu=plan.gpu,
        weight_bytes=plan.memory.get("weight_bytes_total"), nodes=plan.pipeline_parallel_size, status=status)


def _unsupported(spec: InferenceServiceSpec, request: PlanRequest) -> str | None:
    """Why the engine cannot serve ``spec``'s GPU count, or None."""
    count = spec.gpu.count
    if count > MAX_TENSOR_PARALLEL_SIZE:
        return (f"gpu.count {count}: one pod uses at most {MAX_TENSOR_PARALLEL_SIZE} GPUs of one node "
                f"(tensor parallelism); a replica spans nodes with gpu.nodes (pipeline stages) instead")
    why = request.model.tensor_parallel_error(count)
    if why is not None:
        valid = request.model.valid_tensor_parallel_sizes(tuple(range(1, MAX_TENSOR_PARALLEL_SIZE + 1)))
        return (f"gpu.count {count} cannot split {request.model.name} for tensor parallelism: {why}; "
                f"counts that work: {', '.join(map(str, valid))}")
    if spec.gpu.per_node is not None and count > spec.gpu.per_node:
        return (f"gpu.count {count} is more than gpu.perNode {spec.gpu.per_node}: one pod's GPUs are in one "
                "node (tensor parallelism); use more gpu.nodes instead")
    if count > 1 and spec.offload.enabled:
        return (f"gpu.count {count} with KV offloading: the engine does not offload KV under tensor "
                f"parallelism yet; disable offload or use gpu.count 1")
    return None


def kv_transfer_args(d: DisaggregationSpec, role: str) -> tuple[str, ...]:
    """A pool's ``--kv-transfer-config``: the connector, producer on prefill, consumer on decode."""
    config = {"kv_connector": d.kv_connector, "kv_role": KV_PRODUCER if role == PREFILL else KV_CONSUMER}
    return ("--kv-transfer-config", json.dumps(config, separators=(",", ":")))


def pool_status(pools: PoolPlan, sizings: dict[str, EngineSizing], connector: str) -> dict[str, Any]:
    """``status.plan.disaggregation``: each pool's plan and the ratio with its derivation."""
    figures = pools.figures
    estimates = {} if figures is None else {
        "prefillTokensPerSecondPerReplica": figures.tokens_per_s, "prefillP95Ms": figures.prefill_s * 1000,
        "kvTransferP95Ms": figures.transfer_s * 1000, "decodeStepMs": figures.decode_step_s * 1000,
        "ttftP95NoQueueMs": figures.ttft_s * 1000, "prefillUtilization": figures.utilization,
        "requestsPerSecond": figures.arrival_rps, "decodeSequencesInFlight": figures.in_flight}

    def pool(role: str, plan: Plan, planned: int) -> dict[str, Any]:
        return {"replicas": sizings[role].replicas, "plannedReplicas": planned, "maxNumSeqs": plan.max_num_seqs,
                "maxNumBatchedTokens": plan.max_num_batched_tokens, "kvTokenCapacity": plan.kv_token_capacity,
                "numGpuBlocks": plan.num_gpu_blocks, "kvCacheMemoryBytes": plan.kv_cache_memory_bytes,
                "bindingConstraint": plan.binding_constraint, "serveArgs": list(sizings[role].serve_args)}

    return {"ratio": pools.ratio, "kvConnector": connector, "bindingConstraint": pools.binding_constraint,
            "prefill": pool(PREFILL, pools.prefill, pools.prefill_replicas),
            "decode": pool(DECODE, pools.decode, pools.decode_replicas),
            "estimates": estimates, "derivation": pool_derivation(pools)}


def _pool_replicas(spec: InferenceServiceSpec, role: str, planned: int) -> int:
    """A pool's replicas: pinned, else the planner's, within its autoscaler's bounds."""
    pool = getattr(spec.disaggregation, role)
    if pool.autoscaling.enabled:
        return min(max(planned, pool.autoscaling.min_replicas), pool.autoscaling.ceiling)
    return pool.replicas if pool.replicas is not None else planned


def _plan_pools(spec: InferenceServiceSpec, request: PlanRequest) -> PlanOutcome:
    d = spec.disaggregation
    try:
        pools = plan_pools(request, d.prefill.engine.pinned, d.decode.engine.pinned)
    except ValueError as exc:
        return PlanOutcome.rejected("InvalidSpec", str(exc))
    if not pools.feasible:
        failed = pools.prefill if not pools.prefill.feasible else pools.decode if not pools.decode.feasible else None
        suggestions = tuple(s.description for s in failed.suggestions) if failed is not None else ()
        hint = (" Suggestions: " + " | ".join(suggestions)) if suggestions else ""
        return PlanOutcome("Infeasible", f"no feasible plan: {pools.binding_constraint}: {pools.binding_detail}.{hint}",
                           pools.binding_constraint, suggestions)
    planned = {PREFILL: pools.prefill_replicas, DECODE: pools.decode_replicas}
    sizings = {role: sizing_of(plan, kv_transfer_args(d, role), _pool_replicas(spec, role, planned[role]))
               for role, plan in ((PREFILL, pools.prefill), (DECODE, pools.decode))}
    status = {**sizings[DECODE].status, "disaggregation": pool_status(pools, sizings, d.kv_connector)}
    sizing = replace(sizings[DECODE], status=status, prefill=sizings[PREFILL])
    p, dec = pools.prefill, pools.decode
    summary = (f"{dec.model} on {dec.tensor_parallel_size}x {dec.gpu}, disaggregated: prefill:decode {pools.ratio} "
               f"(prefill max_num_batched_tokens {p.max_num_batched_tokens:,}; decode KV {dec.kv_cache_dtype}, "
               f"{dec.kv_token_capacity:,} tokens, max_num_seqs {dec.max_num_seqs}); {pools.binding_detail}")
    return PlanOutcome("Planned", summary, pools.binding_constraint, sizing=sizing)


def plan_service(spec: InferenceServiceSpec) -> PlanOutcome:
    """Plan ``spec``; an invalid request or an infeasible plan is an outcome, not an error."""
    try:
        request = plan_request(spec)
    except ValueError as exc:
        return PlanOutcome.rejected("InvalidSpec", str(exc))
    unsupported = _unsupported(spec, request)
    if unsupported is not None:
        return PlanOutcome.rejected("Unsupported", unsupported)
    if spec.disaggregation is not None:
        return _plan_pools(spec, request)
    try:
        plan = make_plan(request)
    except ValueError as exc:
        return PlanOutcome.rejected("InvalidSpec", str(exc))
    if not plan.feasible:
        suggestions = tuple(s.description for s in plan.suggestions)
        hint = (" Suggestions: " + " | ".join(suggestions)) if suggestions else ""
        return PlanOutcome("Infeasible",
                           f"no feasible plan: {plan.binding_constraint}: {plan.binding_detail}.{hint}",
                           plan.binding_constraint, suggestions)
    nodes = f"{plan.pipeline_parallel_size} nodes x " if plan.pipeline_parallel_size > 1 else ""
    summary = (f"{plan.model} on {nodes}{plan.tensor_parallel_size}x {plan.gpu}: KV {plan.kv_cache_dtype}, "
               f"{plan.kv_token_capacity:,} tokens, max_num_seqs {plan.max_num_seqs}, "
               f"{plan.replicas} replica(s); bound by {plan.binding_constraint}")
    return PlanOutcome("Planned", summary, plan.binding_constraint, sizing=sizing_of(plan))
