"""Suggestions for an infeasible plan, each verified by planning the patched request.

Remedies are tried one at a time (the smallest change that works for each kind:
the fewest extra GPUs, the longest max context, ...); only those whose patched
request plans feasible are returned. If no single change works, pairs of the
strongest changes are tried and returned as ``combined``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from kvpilot.operator.planner import kv_dtype
from kvpilot.operator.planner.gpu import GPU_CATALOG
from kvpilot.operator.planner.latency import largest_int
from kvpilot.operator.planner.plan_request import PlanRequest, merge
from kvpilot.operator.planner.result import Plan, Suggestion
from kvpilot.operator.planner.weights import WEIGHT_QUANT_BYTES

# Every kind of suggestion this module makes (each is servable: tests/engine/
# test_suggestion_contract.py starts the engine with the flags of each).
SUGGESTION_KINDS = ("fewer_sequences", "replicas", "drop_override", "gpu_memory_utilization", "fp8_kv",
                    "max_context", "itl_target", "ttft_target", "tensor_parallel", "gpu",
                    "weight_quantization", "combined")
Solve = Callable[[PlanRequest], Plan]
Candidate = tuple[str, dict[str, Any], str]
MAX_SUGGESTIONS = 8


def _try(req: PlanRequest, patch: dict[str, Any], solve: Solve) -> Plan | None:
    try:
        plan = solve(req.apply(patch))
    except ValueError:
        return None
    return plan if plan.feasible else None


def _overrides(req: PlanRequest, plan: Plan) -> Iterator[Candidate]:
    ov = req.overrides
    if ov.max_num_seqs is not None:
        limit = min(v for n, v in plan.limits.items() if n != "target")
        if limit >= 1:
            yield "fewer_sequences", {"overrides": {"max_num_seqs": limit}}, f"lower max_num_seqs to {limit:,}"
    if ov.replicas is not None:
        need = plan.estimates.get("replicas_needed") or ov.replicas
        if req.slo.concurrency is not None and plan.max_num_seqs >= 1:
            need = max(need, math.ceil(req.slo.concurrency / plan.max_num_seqs))
        if need > ov.replicas:
            yield "replicas", {"overrides": {"replicas": need}}, f"run {need} replicas"
        yield "drop_override", {"overrides": {"replicas": None}}, "let the planner size the replicas"
    for name in ("max_num_batched_tokens", "block_size", "gpu_memory_utilization"):
        if getattr(ov, name) is not None:
            yield "drop_override", {"overrides": {name: None}}, f"drop the pinned {name}"
    if (ov.gpu_memory_utilization or 0.90) < 0.95:
        yield "gpu_memory_utilization", {"overrides": {"gpu_memory_utilization": 0.95}}, \
            "raise gpu_memory_utilization to 0.95"


def _workload(req: PlanRequest, plan: Plan, solve: Solve) -> Iterator[Candidate]:
    slo, model = req.slo, req.model
    if not kv_dtype.is_fp8(plan.kv_cache_dtype):
        yield "fp8_kv", {"overrides": {"kv_cache_dtype": "fp8"}}, "use an FP8 KV cache (kv_cache_dtype fp8)"
    hi = min(slo.max_context - 1, model.max_position_embeddings)
    best = largest_int(slo.seq_tokens_p95, hi,
                        lambda v: _try(req, {"slo": {"max_context": v}}, solve) is not None)
    if best is not None:
        rounded = best // 1024 * 1024
        best = rounded if rounded >= slo.seq_tokens_p95 else best
    elif hi >= slo.seq_tokens_p95:
        best = hi if slo.max_context > model.max_position_embeddings else slo.seq_tokens_p95
    if best is not None:          # when nothing works alone, still a candidate for a combination
        yield "max_context", {"slo": {"max_context": best}}, f"shorten max_context to {best:,} tokens"
    if slo.concurrency is not None and req.overrides.replicas is not None:
        fewer = largest_int(1, slo.concurrency - 1,
                             lambda v: _try(req, {"slo": {"concurrency": v}}, solve) is not None)
        if fewer is not None:
            yield "fewer_sequences", {"slo": {"concurrency": fewer}}, f"lower concurrency to {fewer:,}"
    single_itl = plan.estimates.get("itl_single_sequence_ms")
    if slo.itl_p95_ms is not None and single_itl and single_itl > slo.itl_p95_ms:
        target = math.ceil(single_itl * 1.2)
        yield "itl_target", {"slo": {"itl_p95_ms": target}}, f"relax the ITL p95 target to {target:,} ms"
    single_ttft = plan.estimates.get("ttft_single_sequence_ms")
    if slo.ttft_p95_ms is not None and single_ttft and single_ttft > slo.ttft_p95_ms:
        target = math.ceil(single_ttft * 1.2)
        yield "ttft_target", {"slo": {"ttft_p95_ms": target}}, f"relax the TTFT p95 target to {target:,} ms"


def _hardware(req: PlanRequest, plan: Plan) -> Iterator[Candidate]:
    tp = req.overrides.tensor_parallel_size
    if tp is not None:
        for more in req.model.valid_tensor_parallel_sizes():
            if more > tp:
                yield "tensor_parallel", {"overrides": {"tensor_parallel_size": more}}, \
                    f"use {more} GPUs per replica (tensor parallel)"
    for gpu in sorted(GPU_CATALOG.values(), key=lambda g: (g.memory_bytes, g.memory_bandwidth_bytes_per_s)):
        if gpu.memory_bytes > req.gpu.memory_bytes or gpu.memory_bandwidth_bytes_per_s > \
                req.gpu.memory_bandwidth_bytes_per_s:
            yield "gpu", {"gpu": gpu.name}, f"use {gpu.description}"
    if req.overrides.weight_quantization is None and req.model.weight_quantization is None:
        for quant in WEIGHT_QUANT_BYTES:             # only what the engine serves
            yield "weight_quantization", {"overrides": {"weight_quantization": quant}}, \
                f"serve a {quant}-quantised checkpoint"


def _describe(label: str, plan: Plan) -> str:
    return (f"{label}: feasible with max_num_seqs {plan.max_num_seqs:,}, {plan.replicas} replica(s) x "
            f"{plan.tensor_parallel_size} GPU(s), kv_cache_dtype {plan.kv_cache_dtype}")


def suggest(req: PlanRequest, plan: Plan, solve: Solve) -> tuple[Suggestion, ...]:
    """Verified suggestions for the infeasible ``plan`` of ``req`` (see module docstring)."""
    out: list[Suggestion] = []
    kinds_done: set[str] = set()
    tried: list[Candidate] = []
    for kind, patch, label in [*_overrides(req, plan), *_workload(req, plan, solve), *_hardware(req, plan)]:
        if len(out) >= MAX_SUGGESTIONS:
            break
        tried.append((kind, patch, label))
        if kind in kinds_done and kind in ("tensor_parallel", "gpu", "weight_quantization"):
            continue                      # keep only the smallest step of these
        result = _try(req, patch, solve)
        if result is not None:
            out.append(Suggestion(kind, _describe(label, result), patch))
            kinds_done.add(kind)
    if out:
        return tuple(out)
    strongest = {}
    for kind, patch, label in tried:
        strongest[kind] = (patch, label)          # later entries are the bigger steps
    items = list(strongest.values())
    for i, (patch_a, label_a) in enumerate(items):
        for patch_b, label_b in items[i + 1:]:
            patch = merge(patch_a, patch_b)
            result = _try(req, patch, solve)
            if result is not None:
                out.append(Suggestion("combined", _describe(f"{label_a} and {label_b}", result), patch))
                if len(out) >= 3:
                    return tuple(out)
    return tuple(out)
