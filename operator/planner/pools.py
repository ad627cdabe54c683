"""Disaggregated prefill and decode: each pool's plan and the prefill:decode ratio (pure).

A disaggregated service runs prompts on prefill replicas and streams on decode replicas;
the decode side pulls each prompt's KV blocks from the prefill side (NIXL). Each pool is
planned by ``make_plan`` as a service of its own (``pool_request``): the prefill pool for
prompts that produce one token (no ITL target, no decoding batch; its TTFT is judged
here, with the queue in front of it), the decode pool for the service's streams (the ITL
target and the KV formula bound its batch; no prompt is prefilled in its steps). Then the
pools are sized against each other, on the roofline of ``latency.py`` and the engine's
step cost (``kvpilot.contract.step_cost``)::

    prefill:  C = the prefill pool's max_num_batched_tokens (its chunk)
              t_chunk = max(memory, compute) of a step of C prompt tokens
              mu = C / t_chunk                         tokens/s one replica prefills
              t_prefill = max(1, P95 / C) x step(min(C, P95))   a p95 prompt alone
              t_transfer = P95 x KV bytes/token per GPU / KV_TRANSFER_BYTES_PER_S
              t_decode = step of the decode batch B (decode only: B tokens, B sequences' KV)
              slack = TTFT target - (t_prefill + t_transfer + t_decode)  (<= 0: infeasible)
              rho = min(REPLICA_UTILIZATION, 2 slack / (s + 2 slack)),  s = P50 / mu
                    (M/D/1: a prompt waits rho s / (2 (1 - rho)) behind others; at rho the
                    wait is the slack)
              prefill replicas = ceil(lambda x P50 / (rho x mu))
    decode:   B = the decode pool's max_num_seqs (min of its targets, KV capacity, ITL)
              in flight = max(concurrency, lambda x O50 x t_decode)   (Little's law)
              decode replicas = ceil(in flight / (REPLICA_UTILIZATION x B))

P50 / P95 are the uncached prompt tokens (a shared prefix cached on both sides is neither
prefilled nor moved), O50 the p50 output tokens, lambda the request rate
(``requests_per_second``, else ``concurrency / (O50 x t_decode)``). Not modelled: the
router's hop, the decode side's own prefill of a prompt's last partial block, and a TTFT
that a slower transfer link than ``KV_TRANSFER_BYTES_PER_S`` stretches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.planner.latency import REPLICA_UTILIZATION, Roofline, step_cost_model
from kvpilot.operator.planner.plan import make_plan
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.result import Plan

PREFILL, DECODE = "prefill", "decode"
POOLS = (PREFILL, DECODE)
# KV bytes one GPU sends per second to its peer on the decode side: a 200 Gb/s RDMA NIC per
# GPU (the common cloud H100/H200 node; DGX nodes have 400 Gb/s), NIXL's UCX transport near
# line rate. An estimate: the planner has no figure of the cluster's network.
KV_TRANSFER_BYTES_PER_S = 25e9


def pool_request(req: PlanRequest, role: str, pinned: Mapping[str, Any] | None = None) -> PlanRequest:
    """The request ``make_plan`` sizes one replica of pool ``role`` from.

    Args:
        req: the service's request (its SLO, the service-wide overrides).
        role: ``prefill``: prompts that return one token (no ITL target, no streams, no
            concurrency target; the ratio judges TTFT); ``decode``: the service's streams
            (no TTFT target: no prompt is prefilled there).
        pinned: the pool's own overrides (``spec.disaggregation.<pool>.engine``), over the
            service's.
    """
    slo = req.slo
    if role == PREFILL:
        slo = dataclasses.replace(slo, p95_output_tokens=1, p50_output_tokens=1, itl_p95_ms=None,
                                  ttft_p95_ms=None, concurrency=None, requests_per_second=None)
    elif role == DECODE:
        slo = dataclasses.replace(slo, ttft_p95_ms=None)
    else:
        raise ValueError(f"a pool is {' or '.join(POOLS)}, not {role!r}")
    # one node per replica; the ratio below decides the replicas
    overrides = dataclasses.replace(req.overrides, **{**(pinned or {}), "replicas": None,
                                                      "pipeline_parallel_size": 1})
    return dataclasses.replace(req, slo=slo, overrides=overrides)


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """The quantities of the ratio (seconds, tokens, requests/s); see the module docstring."""

    chunk: int                 # C
    prompt_p50: int            # P50 (uncached)
    prompt_p95: int            # P95 (uncached)
    output_p50: int            # O50
    flops_per_token: float     # at a p95 prompt
    chunk_memory_s: float      # reading the weights (and one prompt's KV) for a chunk
    chunk_compute_s: float     # C x flops_per_token at FLOPS_EFFICIENCY of peak
    chunk_s: float             # t_chunk = the larger
    tokens_per_s: float        # mu
    prefill_s: float           # t_prefill
    transfer_s: float          # t_transfer
    decode_batch: int          # B
    decode_memory_s: float     # weights + B sequences' KV at p95 length
    decode_compute_s: float    # B tokens
    decode_step_s: float       # t_decode = the larger
    ttft_s: float              # t_prefill + t_transfer + t_decode (no queue)
    ttft_target_s: float | None
    utilization: float         # rho
    utilization_source: str
    arrival_rps: float         # lambda
    arrival_source: str
    in_flight: float           # sequences decoding at once across the pool


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Both pools planned and sized against each other.

    Args:
        prefill / decode: each pool's own plan (flags, KV sizing, its derivation).
        prefill_replicas / decode_replicas: the replicas the ratio asks for.
        feasible: both plans feasible and the TTFT target reachable.
        binding_constraint / binding_detail: what failed, or what set the ratio.
        figures: the numbers of the derivation (None when a pool's plan is infeasible).
    """

    prefill: Plan
    decode: Plan
    prefill_replicas: int
    decode_replicas: int
    feasible: bool
    binding_constraint: str
    binding_detail: str
    figures: PoolFigures | None

    @property
    def ratio(self) -> str:
        return f"{self.prefill_replicas}:{self.decode_replicas}"


def _roofline(req: PlanRequest, plan: Plan, seq_tokens: int, prompt_tokens: int) -> Roofline:
    """The roofline of ``plan``'s replica (its KV layout, weights and GPUs)."""
    cost = step_cost_model(req.model, plan.kv_bytes_per_token, plan.tensor_parallel_size,
                           plan.memory["weight_bytes_total"])
    return Roofline.of(cost, req.gpu.memory_bandwidth_bytes_per_s, req.gpu.bf16_flops * plan.tensor_parallel_size,
                       seq_tokens, prompt_tokens)


def _uncached(req: PlanRequest, plan: Plan, tokens: int) -> int:
    cached = req.slo.shared_prefix_tokens // plan.block_size * plan.block_size if plan.enable_prefix_caching else 0
    return max(1, tokens - cached)


def figures(req: PlanRequest, prefill: Plan, decode: Plan) -> PoolFigures:
    """The ratio's quantities for the service ``req`` whose pools are planned as given."""
    slo = req.slo
    p95, p50 = _uncached(req, prefill, slo.p95_prompt_tokens), _uncached(req, prefill, slo.prompt_tokens_p50)
    roof_p = _roofline(req, prefill, slo.p95_prompt_tokens + 1, slo.p95_prompt_tokens)
    chunk = prefill.max_num_batched_tokens
    chunk_s = roof_p.step_s(1, chunk)
    mu = chunk / chunk_s
    prefill_s = max(1.0, p95 / chunk) * roof_p.step_s(1, min(chunk, p95))
    transfer_s = p95 * decode.kv_bytes_per_token / KV_TRANSFER_BYTES_PER_S
    batch = max(1, decode.max_num_seqs)
    roof_d = _roofline(req, decode, slo.seq_tokens_p95, slo.p95_prompt_tokens)
    decode_s = roof_d.step_s(batch, batch)
    ttft_s = prefill_s + transfer_s + decode_s
    target = slo.ttft_p95_ms / 1000 if slo.ttft_p95_ms is not None else None
    rho, rho_source = REPLICA_UTILIZATION, f"the planner's replica utilization {REPLICA_UTILIZATION:.0%}"
    if target is not None:
        slack = target - ttft_s
        by_ttft = 2 * slack / (p50 / mu + 2 * slack) if slack > 0 else 0.0
        if by_ttft < rho:
            rho, rho_source = by_ttft, "the TTFT target's queueing slack (M/D/1)"
    out50 = slo.output_tokens_p50
    if slo.requests_per_second is not None:
        rate, rate_source = slo.requests_per_second, "slo.requests_per_second"
    else:
        rate, rate_source = slo.concurrency / (out50 * decode_s), "concurrency / (O50 x t_decode)"
    in_flight = max(float(slo.concurrency or 0), rate * out50 * decode_s)
    return PoolFigures(chunk, p50, p95, out50, roof_p.flops_per_token, roof_p.memory_s(1), roof_p.compute_s(chunk),
                       chunk_s, mu, prefill_s, transfer_s, batch, roof_d.memory_s(batch), roof_d.compute_s(batch),
                       decode_s, ttft_s, target, rho, rho_source, rate, rate_source, in_flight)


def plan_pools(req: PlanRequest, prefill_pinned: Mapping[str, Any] | None = None,
               decode_pinned: Mapping[str, Any] | None = None) -> PoolPlan:
    """Plan both pools of the service ``req`` and the replicas of each (pure).

    Args:
        req: the service's request: its SLO (the traffic shape and the latency targets) and
            the service-wide overrides.
        prefill_pinned / decode_pinned: each pool's own overrides (``Overrides`` fields).
    Raises:
        ValueError: for an override the planner refuses (as ``make_plan``).
    """
    prefill = make_plan(pool_request(req, PREFILL, prefill_pinned))
    decode = make_plan(pool_request(req, DECODE, decode_pinned))
    for role, plan in ((PREFILL, prefill), (DECODE, decode)):
        if not plan.feasible:
            return PoolPlan(prefill, decode, 1, 1, False, f"{role}_{plan.binding_constraint}",
                            f"the {role} pool: {plan.binding_detail}", None)
    fig = figures(req, prefill, decode)
    if fig.utilization <= 0:
        target = req.slo.ttft_p95_ms
        return PoolPlan(prefill, decode, 1, 1, False, "ttft",
                        f"a p95 prompt alone takes {fig.ttft_s * 1000:,.0f} ms to the first token "
                        f"(prefill {fig.prefill_s * 1000:,.0f} + transfer {fig.transfer_s * 1000:,.1f} + decode step "
                        f"{fig.decode_step_s * 1000:,.1f}), over the {target:g} ms TTFT target", fig)
    n_prefill = max(1, math.ceil(fig.arrival_rps * fig.prompt_p50 / (fig.utilization * fig.tokens_per_s)))
    n_decode = max(1, math.ceil(fig.in_flight / (REPLICA_UTILIZATION * fig.decode_batch)))
    heavier = "prefill" if n_prefill > n_decode else "decode" if n_decode > n_prefill else "neither"
    return PoolPlan(prefill, decode, n_prefill, n_decode, True, "ratio",
                    f"prefill:decode {n_prefill}:{n_decode} ({heavier} pool larger)", fig)
