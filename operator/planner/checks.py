"""The feasibility checks of one evaluated candidate, in the order they bind.

Check names form the ``binding_constraint`` vocabulary: ``max_position_embeddings``,
``gpu_memory``, ``kv_capacity``, ``itl``, ``ttft``, ``max_num_batched_tokens``,
``replicas``, ``lora`` (and, for feasible plans, ``target``: max_num_seqs is at its target).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.operator.planner.memory import gib

if TYPE_CHECKING:
    from kvpilot.operator.planner.evaluate import Evaluation
    from kvpilot.operator.planner.plan_request import PlanRequest


@dataclass(frozen=True, slots=True)
class Check:
    """One constraint: its name (the binding-constraint vocabulary), pass/fail, and the numbers."""

    name: str
    ok: bool
    detail: str


def _memory(req: PlanRequest, ev: Evaluation) -> list[Check]:
    slo, model, b = req.slo, req.model, ev.budget
    out = [Check("max_position_embeddings", slo.max_context <= model.max_position_embeddings,
                 f"max_context {slo.max_context:,} vs the model's {model.max_position_embeddings:,} positions")]
    used = b.weight_bytes + b.reserve.total_bytes
    out.append(Check("gpu_memory", ev.num_blocks >= 1,
                     f"weights {gib(b.weight_bytes):.2f} GiB + reserve {gib(b.reserve.total_bytes):.2f} GiB "
                     f"= {gib(used):.2f} GiB of a {gib(b.budget_bytes):.2f} GiB budget per GPU"))
    if b.kv_pinned_bytes is not None:
        room = max(0, b.kv_available_bytes)
        out.append(Check("gpu_memory", b.kv_pinned_bytes <= room,
                         f"the pinned KV cache of {gib(b.kv_pinned_bytes):.2f} GiB must fit in the "
                         f"{gib(room):.2f} GiB the GPU leaves for it"))
    out.append(Check("kv_capacity", ev.limits["kv_capacity"] >= 1,
                     f"one max_context sequence needs {ev.max_context_blocks:,} blocks "
                     f"({gib(ev.layout.memory_for_blocks(ev.max_context_blocks)):.2f} GiB); the KV cache "
                     f"holds {ev.num_blocks:,} blocks ({gib(ev.layout.memory_for_blocks(ev.num_blocks)):.2f} GiB)"))
    return out


def _lora(req: PlanRequest, ev: Evaluation) -> list[Check]:
    if not req.overrides.max_loras:
        return []
    return [Check("lora", ev.gpus == 1,
                  f"the engine serves LoRA adapters on one GPU per replica; this shape has {ev.gpus}")]


def _latency(req: PlanRequest, ev: Evaluation) -> list[Check]:
    slo, roof, out = req.slo, ev.roofline, []
    pinned = req.overrides.max_num_batched_tokens
    if slo.itl_p95_ms is not None:
        one = roof.step_s(1, 1 + ev.layout.block_size) * 1000
        out.append(Check("itl", ev.limits["itl"] >= 1,
                         f"a step of one p95 sequence and a one-block prefill chunk takes {one:.1f} ms "
                         f"(weights {roof.memory_s(0) * 1000:.1f} ms) vs the {slo.itl_p95_ms:g} ms ITL target"))
        if pinned is not None:
            step = roof.compute_s(pinned) * 1000
            out.append(Check("itl", step <= slo.itl_p95_ms,
                             f"pinned max_num_batched_tokens {pinned:,}: a full step computes for "
                             f"{step:.1f} ms vs the {slo.itl_p95_ms:g} ms ITL target"))
    if pinned is not None:
        out.append(Check("max_num_batched_tokens", ev.limits["max_num_batched_tokens"] >= 1,
                         f"pinned max_num_batched_tokens {pinned:,} must exceed max_num_seqs by one "
                         f"block ({ev.layout.block_size} tokens) so prompts keep prefilling"))
    if slo.ttft_p95_ms is not None:
        alone = roof.ttft_s(1, ev.max_num_batched_tokens, ev.prompt_uncached) * ev.ttft_factor * 1000
        out.append(Check("ttft", ev.limits["ttft"] >= 1,
                         f"a p95 prompt ({ev.prompt_uncached:,} uncached tokens) prefills in {alone:.1f} ms "
                         f"with max_num_batched_tokens {ev.max_num_batched_tokens:,} vs the "
                         f"{slo.ttft_p95_ms:g} ms TTFT target"))
    return out


def _overrides(req: PlanRequest, ev: Evaluation) -> list[Check]:
    ov, slo, out = req.overrides, req.slo, []
    if ov.max_num_seqs is not None:
        for name, limit in ev.limits.items():
            if name != "target" and limit < ov.max_num_seqs:
                out.append(Check(name, False,
                                 f"pinned max_num_seqs {ov.max_num_seqs:,} exceeds the {name} limit of {limit:,}"))
    elif ov.replicas is not None and slo.concurrency is not None and ev.max_num_seqs < ev.target:
        name = min((n for n in ev.limits if n != "target"), key=lambda n: ev.limits[n])
        out.append(Check(name, False,
                         f"with {ov.replicas} pinned replica(s) each must run {ev.target:,} sequences; "
                         f"the {name} limit allows {ev.limits[name]:,}"))
    if ov.replicas is not None and ev.replicas_needed > ov.replicas and not out:
        out.append(Check("replicas", False,
                         f"{ov.replicas} pinned replica(s) but {ev.replicas_needed} are needed "
                         f"({ev.replicas_source})"))
    return out


def run_checks(req: PlanRequest, ev: Evaluation) -> tuple[Check, ...]:
    """All checks in binding order: model limit, memory, KV, LoRA, latency, overrides."""
    return tuple(_memory(req, ev) + _lora(req, ev) + _latency(req, ev) + _overrides(req, ev))
