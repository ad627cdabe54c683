"""``make_plan``: the pure function from a ``PlanRequest`` to a ``Plan``.

Shape search: GPUs per replica is the pinned ``tensor_parallel_size``; otherwise each
of 1, 2, 4, 8 that splits the model's heads is planned and the feasible one with the
fewest GPUs in total (replicas x GPUs per replica) wins, ties going to fewer GPUs per
replica; if none is feasible, the plan for the largest is returned, infeasible. A replica
spans one node at most (``MAX_TENSOR_PARALLEL_SIZE`` GPUs): when even the largest shape
has no room for the model, the plan says that it would need more than one node. For each shape
the KV dtype candidates of ``kv_dtype.candidates`` are evaluated and the one with
the most ``max_num_seqs`` wins (ties go to 16-bit). Infeasible plans then get
suggestions, each verified by planning the patched request.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvpilot.engine.core.constants import MAX_TENSOR_PARALLEL_SIZE
from kvpilot.engine.core.kv_layout import HybridKVLayout
from kvpilot.operator.planner import kv_dtype
from kvpilot.operator.planner.evaluate import Evaluation, evaluate
from kvpilot.operator.planner.explain import derivation
from kvpilot.operator.planner.memory import host_memory_gib, offload_tiers_gib
from kvpilot.operator.planner.model_spec import ModelSpec
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.result import DEFAULT_DISK_PATH, Plan
from kvpilot.operator.planner.suggest import suggest

TENSOR_PARALLEL_CHOICES = tuple(n for n in (1, 2, 4, 8, 16) if n <= MAX_TENSOR_PARALLEL_SIZE)


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
    """Why the model needs more than one node, when the largest one-node shape has no room
    for it (its weights and one max_context sequence); else None."""
    if ev.feasible or ev.binding.name not in ("gpu_memory", "kv_capacity"):
        return None
    largest = max(req.model.valid_tensor_parallel_sizes(TENSOR_PARALLEL_CHOICES), default=1)
    if ev.tp < largest:
        return None
    return (f"{req.model.name}'s weights and one max_context sequence do not fit even {ev.tp} x "
            f"{req.gpu.name}, the most GPUs one replica can use: it would need more than one node's "
            f"GPUs, and replicas spanning nodes (pipeline parallelism) are not supported")


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
                "reserve_activation_bytes": b.reserve.activation_bytes,
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
        limits=dict(ev.limits), checks=ev.checks,
        derivation=tuple(derivation(req, ev, dtype_notes, shape_notes)),
        warnings=tuple(_warnings(req, ev)))


def _shape_note(req: PlanRequest, best: list[Evaluation], chosen: Evaluation) -> str:
    parts = [f"{e.tp} -> {e.replicas} replica(s) = {e.replicas * e.tp} GPUs" if e.feasible
             else f"{e.tp} -> infeasible ({e.binding.name})" for e in best]
    if not chosen.feasible:
        return f"GPUs per replica: {'; '.join(parts)}; none is feasible, showing {chosen.tp}."
    return (f"GPUs per replica: {'; '.join(parts)} -> {chosen.tp} (fewest GPUs in total, "
            "then the fewest per replica).")


def solve(req: PlanRequest) -> Plan:
    """The plan without suggestions (used by ``make_plan`` and to verify suggestions)."""
    model, pinned = req.model, req.overrides.tensor_parallel_size
    if req.slo.seq_tokens_p95 > model.max_position_embeddings:
        raise ValueError(f"the p95 request ({req.slo.seq_tokens_p95:,} tokens) is longer than {model.name}'s "
                         f"{model.max_position_embeddings:,} positions: no deployment of this model can serve it")
    if pinned is not None:
        _check_tp(model, pinned)
    shapes = [pinned] if pinned is not None else model.valid_tensor_parallel_sizes(TENSOR_PARALLEL_CHOICES)
    kinds, dtype_notes = kv_dtype.candidates(model, req.slo, req.overrides)
    per_shape = [[evaluate(req, tp, kind) for kind in kinds] for tp in shapes]
    best = [_pick(evs) for evs in per_shape]
    feasible = [e for e in best if e.feasible]
    chosen = min(feasible, key=lambda e: (e.replicas * e.tp, e.tp)) if feasible else best[-1]
    notes = _dtype_choice_note(req, per_shape[best.index(chosen)], chosen)
    if pinned is None:
        notes.append(_shape_note(req, best, chosen))
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
