"""``make_plan``: the pure function from a ``PlanRequest`` to a ``Plan``.

Shape search: GPUs per replica is the pinned ``tensor_parallel_size``; otherwise each
of 1, 2, 4, 8 that splits the model's heads and fits in one node (``gpus_per_node``, the
GPU catalogue's or the override) is planned and the feasible one with the fewest GPUs in
total (replicas x GPUs per replica) wins, ties going to fewer GPUs per replica. Tensor
parallelism stays within a node. Pipeline parallelism across nodes is considered only
when one node cannot hold the weights and the SLO's KV: no one-node shape is feasible,
or the best one's ``max_num_seqs`` is held below the per-replica target by KV capacity.
Then replicas of 2, 3, ... ``MAX_PIPELINE_STAGES`` nodes, each a stage of the largest
tensor-parallel size a node holds, are planned too, and the same rule (fewest GPUs in
total, then fewest per replica) picks among all shapes; a pinned
``pipeline_parallel_size`` is the only shape. If none is feasible, the plan for the
largest is returned, infeasible. For each shape the KV dtype candidates of
``kv_dtype.candidates`` are evaluated and the one with the most ``max_num_seqs`` wins
(ties go to 16-bit). Infeasible plans then get suggestions, each verified by planning
the patched request.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvpilot.contract.constants import MAX_TENSOR_PARALLEL_SIZE
from kvpilot.contract.kv_layout import HybridKVLayout
from kvpilot.operator.planner import kv_dtype
from kvpilot.operator.planner.evaluate import Evaluation, evaluate
from kvpilot.operator.planner.explain import derivation
from kvpilot.operator.planner.memory import host_memory_gib, offload_tiers_gib
from kvpilot.operator.planner.model_spec import ModelSpec
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.result import DEFAULT_DISK_PATH, Plan
from kvpilot.operator.planner.suggest import suggest

TENSOR_PARALLEL_CHOICES = tuple(n for n in (1, 2, 4, 8, 16) if n <= MAX_TENSOR_PARALLEL_SIZE)
# The most nodes one replica spans (pipeline stages); a LeaderWorkerSet group of this size.
MAX_PIPELINE_STAGES = 8


def gpus_per_node(req: PlanRequest) -> int:
    """GPUs in one node: the override, else the GPU catalogue's figure."""
    return req.overrides.gpus_per_node or req.gpu.gpus_per_node


def node_tp_choices(req: PlanRequest) -> list[int]:
    """Tensor-parallel sizes that split the model and fit in one node."""
    per_node = gpus_per_node(req)
    return [tp for tp in req.model.valid_tensor_parallel_sizes(TENSOR_PARALLEL_CHOICES) if tp <= per_node]


def _check_tp(model: ModelSpec, tp: int) -> None:
    why = model.tensor_parallel_error(tp)
    if why is not None:
        ok = model.valid_tensor_parallel_sizes(tuple(range(1, 65)))
        raise ValueError(f"tensor_parallel_size {tp} does not split {model.name}: {why}; "
                         f"valid: {', '.join(map(str, ok))}")


def _pick(evaluations: list[Evaluation]) -> Evaluation:
    feasible = [e for e in evaluations if e.feasible]
    if not feasible:
        return evaluations[0]
    return max(feasible, key=lambda e: (e.max_num_seqs, -evaluations.index(e)))


def _dtype_choice_note(req: PlanRequest, evs: list[Evaluation], chosen: Evaluation) -> list[str]:
    if len(evs) < 2:
        return []
    parts = [f"{kv_dtype.dtype_label(req.model, e.kv_cache_dtype)}: "
             + (f"max_num_seqs {e.max_num_seqs:,}" if e.feasible else f"infeasible ({e.binding.name})")
             for e in evs]
    return [f"KV dtype choice at {chosen.tp} GPU(s): {'; '.join(parts)} -> "
            f"{kv_dtype.dtype_label(req.model, chosen.kv_cache_dtype)}."]


def multi_node_note(req: PlanRequest, ev: Evaluation) -> str | None:
    """Why not even the largest shape has room for the model (its weights and one
    max_context sequence), when that is the failure; else None."""
    if ev.feasible or ev.binding.name not in ("gpu_memory", "kv_capacity"):
        return None
    if ev.tp < max(node_tp_choices(req), default=1):
        return None
    if ev.pp == 1 and req.model.hybrid_kv(req.slo.max_context):
        return (f"{req.model.name}'s weights and one max_context sequence do not fit one node "
                f"({ev.tp} x {req.gpu.name}), and a model with a sliding-window KV pool is not split "
                "across nodes (pipeline parallelism plans full-attention layers only)")
    if ev.pp < MAX_PIPELINE_STAGES and req.overrides.pipeline_parallel_size is None:
        return None
    return (f"{req.model.name}'s weights and one max_context sequence do not fit {ev.pp} node(s) of "
            f"{ev.tp} x {req.gpu.name}" + (f", the most one replica spans ({MAX_PIPELINE_STAGES})"
                                           if ev.pp >= MAX_PIPELINE_STAGES else ""))


def _warnings(req: PlanRequest, ev: Evaluation) -> list[str]:
    m, ov, slo = req.model, req.overrides, req.slo
    out = kv_dtype.warnings_for(m, slo, ev.kv_cache_dtype, ov.kv_cache_dtype is not None)

    if m.weight_bytes is None and not m.weight_source.startswith("catalogue") and not ov.weight_quantization:
        out.append("weights estimated from the parameter count of the architecture; point --model at the "
                   "checkpoint directory for exact safetensors sizes")
    if ov.weight_quantization:
        out.append(f"assumes a pre-quantised {ov.weight_quantization} checkpoint: kvpilot serve does not "
                   "quantise weights itself")
    if (ov.cpu_offload_gib or ov.disk_offload_gib) and m.releases_kv_blocks(slo.max_context):
        out.append("the engine does not offload KV for a sliding-window model whose blocks it "
                   "releases outside the window: the pinned offload tiers are left out")
    if ev.tp > 1:
        out.append("latency estimates leave out tensor-parallel all-reduce time")
    if ev.pp > 1:
        out.append(f"{ev.pp} pipeline stages: latency estimates pass one batch through the stages in turn "
                   "and leave out the inter-node activation transfers; throughput counts one batch in "
                   "flight (the engine's microbatches can only raise it)")
        if ov.cpu_offload_gib or ov.disk_offload_gib:
            out.append("the engine does not offload KV under tensor parallelism: the pinned offload "
                       "tiers are left out")
    if slo.shared_prefix_tokens and not ev.enable_prefix_caching:
        out.append("shared prefixes given but prefix caching is off: every request prefills its prefix")
    if ev.prefixes is not None and ev.prefixes.uncached:
        out.append(f"{ev.prefixes.uncached:,} of {ev.prefixes.distinct:,} shared prefixes fit in no tier "
                   "and will be recomputed")
    if ev.prefixes is not None and ev.prefixes.blocks_each == 0:
        out.append(f"shared prefix ({slo.shared_prefix_tokens} tokens) is shorter than one block "
                   f"({ev.layout.block_size} tokens): nothing of it can be cached")
    return out


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: an unreachable estimate is reported as None."""
    return value if value is None or math.isfinite(value) else None


def _to_plan(req: PlanRequest, ev: Evaluation, dtype_notes: list[str], shape_notes: list[str]) -> Plan:
    ov, p, b = req.overrides, ev.prefixes, ev.budget
    cpu, disk = offload_tiers_gib(p, ov.cpu_offload_gib, ov.disk_offload_gib, ev.tp,
                                  req.model.releases_kv_blocks(req.slo.max_context))
    offload = cpu > 0 or disk > 0
    backend = (ov.offload_backend or "native") if offload else None
    pod, shm = host_memory_gib(ev.tp, cpu)
    binding = ev.binding
    msq = ev.max_num_seqs
    tput = ev.throughput
    return Plan(
        feasible=ev.feasible, binding_constraint=binding.name,
        binding_detail="; ".join(filter(None, (binding.detail, multi_node_note(req, ev)))),
        model=req.model.name, gpu=req.gpu.name, tensor_parallel_size=ev.tp, replicas=ev.replicas,
        pipeline_parallel_size=ev.pp, gpus_per_node=gpus_per_node(req),
        stages=tuple(_stage_dict(s, ev) for s in ev.stages) if ev.pp > 1 else (),
        kv_cache_dtype=ev.kv_cache_dtype, kv_dtype_name=kv_dtype.resolved_name(req.model, ev.kv_cache_dtype),
        kv_dtype_bytes=ev.layout.dtype_bytes,
        kv_bytes_per_token=ev.layout.bytes_per_token, gpu_memory_utilization=b.gpu_memory_utilization,
        kv_cache_memory_bytes=ev.layout.memory_for_blocks(ev.num_blocks), num_gpu_blocks=ev.num_blocks,
        block_size=ev.layout.block_size, kv_token_capacity=ev.layout.token_capacity(ev.num_blocks),
        max_model_len=req.slo.max_context, max_num_seqs=msq, max_num_batched_tokens=ev.max_num_batched_tokens,
        enable_prefix_caching=ev.enable_prefix_caching,
        resident_prefix_tokens=p.gpu_blocks * ev.layout.block_size if p is not None else 0,
        cpu_offload_gib=cpu, disk_offload_gib=disk, offload_backend=backend,
        offload_disk_path=DEFAULT_DISK_PATH if disk > 0 else None, pod_memory_gib=pod, shm_gib=shm,
        num_layers=ev.layout.num_layers, num_kv_heads_per_gpu=ev.layout.num_kv_heads,
        head_dim=ev.layout.head_dim,
        **(dict(num_sliding_pool_layers=ev.layout.sliding.num_layers, sliding_window=ev.layout.sliding_window,
                sliding_pool_blocks=ev.layout.max_sliding_blocks)
           if isinstance(ev.layout, HybridKVLayout) else {}),
        memory={"gpu_memory_bytes": b.gpu_memory_bytes, "budget_bytes": b.budget_bytes,
                "weight_bytes_total": ev.weight_bytes_total, "weight_bytes_per_gpu": b.weight_bytes,
                "reserve_bytes": b.reserve.total_bytes, **b.reserve.to_bytes(),
                "reserve_activation_bytes": b.reserve.activation_bytes, "lora_bytes": b.lora_bytes,
                "kv_estimate_bytes": b.kv_estimate_bytes, "kv_available_bytes": b.kv_available_bytes,
                "bytes_per_block": ev.layout.bytes_per_block, "p95_sequence_blocks": ev.seq_blocks,
                "max_context_blocks": ev.max_context_blocks},
        estimates={k: _finite(v) for k, v in {
            "itl_p95_ms": ev.itl_s * 1000 if msq >= 1 else None,
            "ttft_p95_ms": ev.ttft_s * 1000 if msq >= 1 else None,
            "itl_single_sequence_ms": ev.roofline.step_s(1, 1 + ev.layout.block_size) * 1000,
            "ttft_single_sequence_ms": ev.roofline.ttft_s(1, ev.max_num_batched_tokens, ev.prompt_uncached)
            * ev.ttft_factor * 1000,
            "requests_per_second_per_replica": tput.rps if tput else None,
            "request_latency_p50_s": tput.request_s if tput else None,
            "replicas_needed": ev.replicas_needed}.items()},
        speculative_config=ov.speculative,
        draft_kv_bytes_per_token=getattr(ev.layout, "extra_bytes_per_token", 0),
        limits=dict(ev.limits), checks=ev.checks,
        derivation=tuple(derivation(req, ev, dtype_notes, shape_notes)),
        warnings=tuple(_warnings(req, ev)))


def _stage_dict(stage, ev: Evaluation) -> dict:
    """One stage of the plan: its layers, what else it holds, and its GPUs' bytes."""
    shape, b = stage.shape, stage.budget
    return {"stage": shape.index, "first_layer": shape.first_layer, "num_layers": shape.num_layers,
            "holds": shape.role, "weight_bytes_per_gpu": shape.weight_bytes,
            "reserve_bytes_per_gpu": b.reserve.total_bytes, "kv_available_bytes_per_gpu": b.kv_available_bytes,
            "kv_cache_bytes_per_gpu": ev.layout.memory_for_blocks(ev.num_blocks),
            "kv_bytes_per_token_per_gpu": ev.layout.bytes_per_token * shape.num_layers // ev.layout.num_layers,
            "blocks_alone": stage.num_blocks}


def _shape_label(e: Evaluation) -> str:
    return f"{e.tp}" if e.pp == 1 else f"{e.pp} nodes x {e.tp}"


def _shape_note(req: PlanRequest, best: list[Evaluation], chosen: Evaluation) -> str:
    parts = [f"{_shape_label(e)} -> {e.replicas} replica(s) = {e.replicas * e.gpus} GPUs" if e.feasible
             else f"{_shape_label(e)} -> infeasible ({e.binding.name})" for e in best]
    if not chosen.feasible:
        return f"GPUs per replica: {'; '.join(parts)}; none is feasible, showing {_shape_label(chosen)}."
    return (f"GPUs per replica: {'; '.join(parts)} -> {_shape_label(chosen)} (fewest GPUs in total, "
            "then the fewest per replica).")


def _needs_nodes(req: PlanRequest, one_node: list[Evaluation]) -> str | None:
    """Why one node cannot hold the weights and the SLO's KV (so pipeline stages across
    nodes are planned too), or None when a one-node shape can."""
    feasible = [e for e in one_node if e.feasible]
    if not feasible:
        largest = one_node[-1]
        if largest.binding.name not in ("gpu_memory", "kv_capacity"):
            return None
        return (f"one node ({largest.tp} x {req.gpu.name}) cannot hold the weights and one max_context "
                f"sequence ({largest.binding.name}: {largest.binding.detail})")
    best = min(feasible, key=lambda e: (e.replicas * e.gpus, e.gpus))
    if best.limits["kv_capacity"] < best.target:
        return (f"one node holds the weights but KV for only {best.limits['kv_capacity']:,} of the "
                f"{best.target:,} sequences a replica should run ({best.tp} x {req.gpu.name})")
    return None


def _pp_note(req: PlanRequest, why: str | None, chosen: Evaluation, full_node: bool) -> str:
    per_node = gpus_per_node(req)
    if why is not None and not full_node:
        return (f"Nodes per replica: 1: {why}, but the pinned {chosen.tp} GPU(s) per replica do not fill "
                f"a node of {per_node}; pipeline stages across nodes chain whole nodes only.")
    if why is None:
        return (f"Nodes per replica: 1 ({per_node} GPUs per node); one node holds the weights and the "
                "SLO's KV, so no pipeline stages across nodes.")
    if req.model.hybrid_kv(req.slo.max_context):
        return (f"Nodes per replica: 1: {why}, but a model with a sliding-window KV pool is not split "
                "across nodes.")
    stages = (f"{chosen.pp} pipeline stages of {chosen.tp} GPUs (tensor parallel within each node), "
              f"layers split {'/'.join(str(s.shape.num_layers) for s in chosen.stages)}"
              if chosen.pp > 1 else "1 (more nodes do not save GPUs)")
    return (f"Nodes per replica ({per_node} GPUs per node): {why}, so replicas of 2 to "
            f"{MAX_PIPELINE_STAGES} nodes were planned too -> {stages}.")


def _check_pp(req: PlanRequest, pp: int, tp: int) -> None:
    if pp > 1 and req.model.hybrid_kv(req.slo.max_context):
        raise ValueError(f"pipeline_parallel_size {pp}: {req.model.name} has a sliding-window KV pool, "
                         "which is not split across pipeline stages")
    if not 1 <= pp <= min(MAX_PIPELINE_STAGES, req.model.num_layers):
        raise ValueError(f"pipeline_parallel_size must be in [1, {min(MAX_PIPELINE_STAGES, req.model.num_layers)}], "
                         f"got {pp}")
    if pp > 1 and tp > gpus_per_node(req):
        raise ValueError(f"tensor_parallel_size {tp} is more than the {gpus_per_node(req)} GPUs of one node: "
                         "tensor parallelism stays within a node")


def solve(req: PlanRequest) -> Plan:
    """The plan without suggestions (used by ``make_plan`` and to verify suggestions)."""
    model, ov = req.model, req.overrides
    pinned, pinned_pp = ov.tensor_parallel_size, ov.pipeline_parallel_size
    if req.slo.seq_tokens_p95 > model.max_position_embeddings:
        raise ValueError(f"the p95 request ({req.slo.seq_tokens_p95:,} tokens) is longer than {model.name}'s "
                         f"{model.max_position_embeddings:,} positions: no deployment of this model can serve it")
    if pinned is not None:
        _check_tp(model, pinned)
    # speculative decoding runs on one GPU (the engine refuses it with more ranks)
    tps = [pinned] if pinned is not None else [1] if ov.speculative is not None else (node_tp_choices(req) or [1])
    if pinned_pp is not None:
        _check_pp(req, pinned_pp, tps[-1])
    kinds, dtype_notes = kv_dtype.candidates(model, req.slo, req.overrides)

    def shape(tp: int, pp: int) -> list[Evaluation]:
        return [evaluate(req, tp, kind, pp) for kind in kinds]

    per_shape = [shape(tp, pinned_pp or 1) for tp in tps]
    best = [_pick(evs) for evs in per_shape]
    why_nodes, full_node = None, True
    if pinned_pp is None:
        why_nodes = _needs_nodes(req, best)
        # only whole nodes are chained: a pinned tensor-parallel size below what a node holds
        # grows within the node first
        full_node = tps[-1] == max(node_tp_choices(req), default=1)
        if why_nodes is not None and full_node and not model.hybrid_kv(req.slo.max_context) \
                and ov.speculative is None:
            tp = tps[-1]
            for pp in range(2, min(MAX_PIPELINE_STAGES, model.num_layers) + 1):
                per_shape.append(shape(tp, pp))
                best.append(_pick(per_shape[-1]))
                if best[-1].feasible and best[-1].limits["kv_capacity"] >= best[-1].target:
                    break       # more nodes hold no more sequences than a replica runs
    feasible = [e for e in best if e.feasible]
    chosen = min(feasible, key=lambda e: (e.replicas * e.gpus, e.gpus)) if feasible else best[-1]
    notes = _dtype_choice_note(req, per_shape[best.index(chosen)], chosen)
    if pinned is None or len(best) > 1:
        notes.append(_shape_note(req, best, chosen))
    if pinned_pp is None:
        notes.append(_pp_note(req, why_nodes, chosen, full_node))
    return _to_plan(req, chosen, dtype_notes, notes)


def make_plan(request: PlanRequest) -> Plan:
    """Plan the engine parameters and deployment for ``request`` (pure; no I/O).

    Raises ValueError for inconsistent input (e.g. a tensor_parallel_size that does
    not divide the heads). An infeasible request is not an error: the plan says
    ``feasible=False`` and carries verified ``suggestions``.
    """
    plan = solve(request)
    if plan.feasible:
        return plan
    return replace(plan, suggestions=suggest(request, plan, solve))
