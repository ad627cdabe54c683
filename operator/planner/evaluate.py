"""Evaluate one deployment shape (GPUs per replica, KV dtype) against the request.

``max_num_seqs`` is the smallest of these limits (each is documented where computed):

- ``target``: the per-replica concurrency target (``concurrency``, divided by pinned
  replicas), else vLLM's default for the GPU; a pinned ``max_num_seqs`` replaces it;
- ``kv_capacity``: sequences that fit in the KV blocks without preemption
  (``memory.kv_seq_limit``);
- ``itl``: the decode step must stay under the ITL target (``latency.Roofline``);
- ``ttft``: a p95 prompt must prefill under the TTFT target while the batch decodes;
- ``max_num_batched_tokens``: when pinned, a step cannot hold more sequences.

Every step keeps one block of its token budget for prefill (``max_num_seqs`` <=
``max_num_batched_tokens - block_size``), so new prompts progress even with a full
batch. ``max_num_batched_tokens`` is vLLM's default for the GPU (8192 on H100-class,
2048 elsewhere), lowered to the largest chunk whose compute fits the ITL target.

Each check that fails makes the plan infeasible; the first failing one is the
binding constraint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvpilot.contract.kv_layout import (
    HybridKVLayout,
    KVLayout,
    kv_heads_per_rank,
    sliding_pool_blocks,
)
from kvpilot.contract.step_cost import StepCostModel
from kvpilot.operator.planner import kv_dtype
from kvpilot.operator.planner.checks import Check, run_checks
from kvpilot.operator.planner.latency import (
    REPLICA_UTILIZATION,
    Roofline,
    largest_int,
    step_cost_model,
)
from kvpilot.operator.planner.lora import lora_slots
from kvpilot.operator.planner.memory import (
    Budget,
    PrefixTiers,
    blocks_for,
    kv_seq_limit,
    offload_allowed,
    place_prefixes,
)
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.reserve import DEFAULT_KV_SAFETY_MARGIN, ENGINE_CUDA_GRAPHS, reserve
from kvpilot.operator.planner.speculative import drafter
from kvpilot.operator.planner.stages import StageShape, stage_shapes
from kvpilot.operator.planner.weights import quantized_weight_bytes

DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
DEFAULT_BLOCK_SIZE = 16
LIMIT_ORDER = ("target", "kv_capacity", "itl", "ttft", "max_num_batched_tokens")


@dataclass(frozen=True, slots=True)
class Throughput:
    ttft_s: float
    decode_step_s: float
    request_s: float
    rps_by_concurrency: float
    rps_by_compute: float

    @property
    def rps(self) -> float:
        return min(self.rps_by_concurrency, self.rps_by_compute)


@dataclass(frozen=True, slots=True)
class StageBudget:
    """One pipeline stage: its layers and weights (``shape``), its GPUs' memory split and
    the KV blocks it could hold alone (its own layers only)."""

    shape: StageShape
    budget: Budget
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Everything computed for one (tensor_parallel_size, pipeline_parallel_size,
    kv_cache_dtype) candidate; ``budget`` is the stage with the least KV room."""

    tp: int
    kv_cache_dtype: str
    weight_bytes_total: int
    weight_source: str
    budget: Budget
    layout: KVLayout | HybridKVLayout
    num_blocks: int
    seq_blocks: int
    max_context_blocks: int
    target: int
    target_source: str
    limits: dict[str, int]
    max_num_seqs: int
    max_num_batched_tokens: int
    mnbt_source: str
    roofline: Roofline
    prompt_uncached: int
    ttft_factor: float
    enable_prefix_caching: bool
    prefixes: PrefixTiers | None
    throughput: Throughput | None
    replicas: int
    replicas_needed: int
    replicas_source: str
    checks: tuple[Check, ...] = field(default_factory=tuple)
    pp: int = 1
    stages: tuple[StageBudget, ...] = ()

    @property
    def gpus(self) -> int:
        """GPUs of one replica (all its stages)."""
        return self.tp * self.pp

    @property
    def feasible(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def binding(self) -> Check:
        """The first failing check, or (feasible) the limit that set max_num_seqs."""
        for check in self.checks:
            if not check.ok:
                return check
        name = min(LIMIT_ORDER, key=lambda n: (self.limits.get(n, math.inf), LIMIT_ORDER.index(n)))
        why = {"target": self.target_source, "kv_capacity": "the KV blocks that fit without preemption",
               "itl": "the ITL p95 target", "ttft": "the TTFT p95 target",
               "max_num_batched_tokens": "the pinned max_num_batched_tokens"}[name]
        return Check(name, True, f"max_num_seqs {self.max_num_seqs:,} is set by {why}")

    @property
    def itl_s(self) -> float:
        return self.roofline.step_s(max(1, self.max_num_seqs), self.max_num_batched_tokens)

    @property
    def ttft_s(self) -> float:
        b = max(1, self.max_num_seqs)
        return self.roofline.ttft_s(b, self.max_num_batched_tokens, self.prompt_uncached) * self.ttft_factor


def _weights(req: PlanRequest) -> tuple[int, str]:
    total, source = _model_weights(req)
    draft = drafter(req.overrides.speculative, req.model)
    if draft is None or not draft.weight_bytes:
        return total, source
    return total + draft.weight_bytes, f"{source}; plus the {draft.what} ({draft.weight_bytes:,} B)"


def _model_weights(req: PlanRequest) -> tuple[int, str]:
    model, quant = req.model, req.overrides.weight_quantization
    if quant is None or quant == model.weight_quantization:
        source = model.weight_source
        if model.weight_bytes is None and model.weight_quantization is not None:
            source += f"; the checkpoint's {model.weight_quantization} weights, embeddings and LM head in {model.dtype}"
        return model.total_weight_bytes, source
    return (quantized_weight_bytes(model.num_params, model.embedding_params, model.dtype_bytes, quant),
            f"{quant} weight quantization, embeddings and LM head in {model.dtype}")


def _target(req: PlanRequest) -> tuple[int, str]:
    slo, ov = req.slo, req.overrides
    if ov.max_num_seqs is not None:
        return ov.max_num_seqs, "max_num_seqs override"
    if slo.concurrency is not None:
        if ov.replicas:
            return math.ceil(slo.concurrency / ov.replicas), \
                f"concurrency {slo.concurrency:,} over {ov.replicas} pinned replica(s)"
        return slo.concurrency, f"target concurrency {slo.concurrency:,}"
    return req.gpu.default_max_num_seqs, f"vLLM's default max_num_seqs on {req.gpu.name}"


def kv_layout_for(req: PlanRequest, tp: int, kv_cache_dtype: str, block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int, num_layers: int | None = None) -> KVLayout | HybridKVLayout:
    """One GPU's KV layout as the engine builds it: a hybrid model's two pools (the sliding
    pool sized for ``max_num_seqs`` and ``max_num_batched_tokens``), else one; ``num_layers``
    is a pipeline stage's share of the layers (None: all of them)."""
    model = req.model
    heads, dtype_bytes = kv_heads_per_rank(model.num_kv_heads, tp), kv_dtype.dtype_bytes(model, kv_cache_dtype)
    draft = drafter(req.overrides.speculative, model)
    extra = draft.kv_bytes_per_token(dtype_bytes) if draft is not None else 0
    if extra and model.hybrid_kv(req.slo.max_context):
        raise ValueError(f"speculative decoding with a draft model or EAGLE head is not implemented for "
                         f"{model.name}'s sliding-window KV pool; use the ngram method")
    if num_layers is not None or not model.hybrid_kv(req.slo.max_context):
        return KVLayout(num_layers or model.num_layers, heads, model.head_dim, dtype_bytes, block_size,
                        extra_bytes_per_token=extra)
    return HybridKVLayout(
        KVLayout(model.num_full_layers, heads, model.head_dim, dtype_bytes, block_size),
        KVLayout(model.num_sliding_layers, heads, model.head_dim, dtype_bytes, block_size),
        model.sliding_window,
        sliding_pool_blocks(max(1, max_num_seqs), max_num_batched_tokens, req.slo.max_context, block_size,
                            model.sliding_window))


def _kv_capacity(req: PlanRequest, tp: int, kv_cache_dtype: str, block_size: int, kv_bytes: int, target: int,
                 max_num_batched_tokens: int, ctx_blocks: int, seq_blocks: int,
                 stage_layers: int | None = None) -> tuple[int, KVLayout | HybridKVLayout, int]:
    """(sequences that fit without preemption, layout, blocks). A hybrid model's windowed
    pool grows with ``max_num_seqs`` (and ``max_num_batched_tokens``, taken at the most the
    plan can pick), so its limit is the largest ``m <= target`` that still fits when the
    pool is sized for ``m`` sequences (the full pool only shrinks as ``m`` grows)."""

    def sized(num_seqs: int) -> tuple[int, KVLayout | HybridKVLayout, int]:
        layout = kv_layout_for(req, tp, kv_cache_dtype, block_size, num_seqs, max_num_batched_tokens,
                               stage_layers)
        num_blocks = layout.num_blocks(max(0, kv_bytes))
        return kv_seq_limit(num_blocks, ctx_blocks, seq_blocks), layout, num_blocks

    at_target = sized(target)
    if not isinstance(at_target[1], HybridKVLayout) or at_target[0] >= target:
        return at_target
    best = largest_int(1, target, lambda m: m <= sized(m)[0])
    if best is None:
        return at_target
    _, layout, num_blocks = sized(best)
    return best, layout, num_blocks


def _stage_budgets(req: PlanRequest, tp: int, pp: int, kv_cache_dtype: str, block_size: int,
                   weight_total: int, activation_tokens: int, target: int) -> tuple[StageBudget, ...]:
    """Each stage's memory split: its weights, its reserve (the sampler on the last stage
    only) and the KV blocks of its own layers that would fit."""
    gpu, ov = req.gpu, req.overrides
    graphs = ov.cuda_graphs if ov.cuda_graphs is not None else ENGINE_CUDA_GRAPHS
    margin = ov.kv_safety_margin if ov.kv_safety_margin is not None else DEFAULT_KV_SAFETY_MARGIN
    out = []
    for shape in stage_shapes(req.model, weight_total, tp, pp):
        slots = lora_slots(req.model, ov.max_loras, ov.max_lora_rank, shape.num_layers)
        budget = Budget(gpu.memory_bytes, ov.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
                        shape.weight_bytes,
                        reserve(req.model, tp, activation_tokens, target, graphs, samples=shape.lm_head),
                        margin, ov.kv_cache_memory_bytes, slots.num_bytes if slots else 0)
        layout = kv_layout_for(req, tp, kv_cache_dtype, block_size, 1, 1, shape.num_layers)
        out.append(StageBudget(shape, budget, layout.num_blocks(max(0, budget.kv_bytes))))
    return tuple(out)


def evaluate(req: PlanRequest, tp: int, kv_cache_dtype: str, pp: int = 1) -> Evaluation:
    """Size one replica of ``pp`` stages of ``tp`` GPUs with ``kv_cache_dtype`` KV; see the
    module docstring. With stages, every GPU is given the same KV bytes
    (``--kv-cache-memory-bytes``), the least any stage has room for, and the replica's blocks
    are those of the stage with the most layers (the engine takes the minimum over ranks)."""
    model, gpu, slo, ov = req.model, req.gpu, req.slo, req.overrides
    block_size = ov.block_size or DEFAULT_BLOCK_SIZE
    weight_total, weight_source = _weights(req)
    target, target_source = _target(req)
    mnbt_cap = ov.max_num_batched_tokens or gpu.default_max_num_batched_tokens
    stages = _stage_budgets(req, tp, pp, kv_cache_dtype, block_size, weight_total, mnbt_cap, target)
    budget = min(stages, key=lambda s: s.budget.kv_bytes).budget
    stage_layers = max(s.shape.num_layers for s in stages) if pp > 1 else None
    seq_blocks = blocks_for(model, slo.seq_tokens_p95, block_size)
    ctx_blocks = blocks_for(model, slo.max_context, block_size)
    kv_limit, layout, num_blocks = _kv_capacity(
        req, tp, kv_cache_dtype, block_size, budget.kv_bytes, target,
        ov.max_num_batched_tokens or max(mnbt_cap, target + block_size), ctx_blocks, seq_blocks, stage_layers)
    # the step's cost is one pass through every stage in turn: all the layers' KV per TP rank
    full_kv = layout.bytes_per_token * model.num_layers // stage_layers if stage_layers else layout.bytes_per_token
    cost = step_cost_model(model, full_kv, tp, weight_total)
    roof = Roofline.of(cost, gpu.memory_bandwidth_bytes_per_s, gpu.bf16_flops * tp, slo.seq_tokens_p95,
                       slo.p95_prompt_tokens)

    limits = {"target": target, "kv_capacity": kv_limit}
    itl_s = slo.itl_p95_ms / 1000 if slo.itl_p95_ms else None
    if itl_s is not None:
        limits["itl"] = max(0, min(roof.batch_limit(itl_s), roof.token_limit(itl_s) - block_size))
    if ov.max_num_batched_tokens is not None:
        limits["max_num_batched_tokens"] = max(0, ov.max_num_batched_tokens - block_size)
    pre = min(limits.values())
    if ov.max_num_batched_tokens is not None:
        mnbt, mnbt_source = ov.max_num_batched_tokens, "override"
    else:
        mnbt, mnbt_source = mnbt_cap, f"vLLM's default on {gpu.name}"
        if itl_s is not None and roof.token_limit(itl_s) < mnbt:
            mnbt = roof.token_limit(itl_s) // block_size * block_size
            mnbt_source = "largest prefill chunk within the ITL target"
        mnbt = max(mnbt, pre + block_size)

    caching = ov.enable_prefix_caching if ov.enable_prefix_caching is not None else True
    cached = slo.shared_prefix_tokens // block_size * block_size if caching else 0
    prompt_u = max(1, slo.p95_prompt_tokens - cached)
    factor = kv_dtype.ttft_factor(model, kv_cache_dtype)
    if slo.ttft_p95_ms is not None:
        limit_s = slo.ttft_p95_ms / 1000
        limits["ttft"] = largest_int(1, target, lambda b: roof.ttft_s(b, mnbt, prompt_u) * factor <= limit_s) or 0
    cap = min(limits.values())
    msq = ov.max_num_seqs if ov.max_num_seqs is not None else cap
    if isinstance(layout, HybridKVLayout):
        # The engine sizes the sliding pool for the final max_num_seqs and step: no larger
        # than above, so the full pool only grows and every limit still holds.
        layout = kv_layout_for(req, tp, kv_cache_dtype, block_size, msq, mnbt)
        num_blocks = layout.num_blocks(max(0, budget.kv_bytes))

    prefixes = None
    if caching and slo.shared_prefix_tokens:
        blocks_each = slo.shared_prefix_tokens // block_size
        free = num_blocks - ctx_blocks - max(0, msq - 1) * seq_blocks
        offloads = offload_allowed(tp, model.releases_kv_blocks(slo.max_context))
        prefixes = place_prefixes(
            blocks_each=blocks_each, bytes_each=blocks_each * block_size * layout.bytes_per_token * tp,
            distinct=slo.distinct_prefixes, free_blocks=free if msq >= 1 else 0,
            replica_gpu_memory_bytes=gpu.memory_bytes * tp,
            cpu_offload_gib=ov.cpu_offload_gib if offloads else 0,
            disk_offload_gib=ov.disk_offload_gib if offloads else 0)

    throughput = _throughput(req, tp, cost, msq, mnbt, cached, factor) if msq >= 1 else None
    replicas, need, replicas_source = _replicas(req, msq, throughput)
    ev = Evaluation(tp, kv_cache_dtype, weight_total, weight_source, budget, layout, num_blocks, seq_blocks,
                    ctx_blocks, target, target_source, limits, msq, mnbt, mnbt_source, roof, prompt_u,
                    factor, caching, prefixes, throughput, replicas, need, replicas_source, pp=pp, stages=stages)
    return replace(ev, checks=run_checks(req, ev))


def _throughput(req: PlanRequest, tp: int, cost: StepCostModel, msq: int, mnbt: int,
                cached: int, factor: float) -> Throughput:
    """Requests/s one replica sustains at p50 lengths (Little's law, capped by compute)."""
    slo = req.slo
    prompt, output = slo.prompt_tokens_p50, slo.output_tokens_p50
    prompt_u = max(1, prompt - cached)
    mid = prompt + output // 2
    roof = Roofline.of(cost, req.gpu.memory_bandwidth_bytes_per_s, req.gpu.bf16_flops * tp, mid, prompt)
    ttft = roof.ttft_s(msq, mnbt, prompt_u) * factor
    decode = roof.step_s(msq, msq)
    request_s = ttft + output * decode
    # a request's FLOPs: its uncached prompt, then one decode step per output token
    by_compute = roof.effective_flops / (prompt_u * roof.flops_per_token + output * cost.flops(1, mid))
    return Throughput(ttft, decode, request_s, msq / request_s, by_compute)


def _replicas(req: PlanRequest, msq: int, tput: Throughput | None) -> tuple[int, int, str]:
    """(replicas, replicas needed, why): the larger of concurrency / max_num_seqs and
    request rate / (REPLICA_UTILIZATION x per-replica throughput); a pinned value wins."""
    slo, pinned = req.slo, req.overrides.replicas
    if msq < 1:
        return pinned or 1, 1, "not computed: no sequence fits"
    needs: list[tuple[int, str]] = []
    if slo.concurrency is not None:
        needs.append((math.ceil(slo.concurrency / msq),
                      f"concurrency {slo.concurrency:,} / max_num_seqs {msq:,}"))
    if slo.requests_per_second is not None and tput is not None:
        needs.append((math.ceil(slo.requests_per_second / (REPLICA_UTILIZATION * tput.rps)),
                      f"{slo.requests_per_second:g} req/s / ({REPLICA_UTILIZATION:.0%} x "
                      f"{tput.rps:.2f} req/s per replica)"))
    need, why = max(needs, default=(1, "no concurrency or request-rate target"))
    need = max(1, need)
    if pinned is not None:
        return pinned, need, f"pinned by override; needed {need} from {why}"
    return need, need, why
