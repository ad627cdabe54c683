"""The derivation: ordered sentences with the numbers of every step, checkable by hand.

Units: GiB (2^30 bytes) with two decimals, bytes with thousands separators, tokens,
milliseconds. Each line is one step of ``evaluate`` in the order it happens.
"""

from __future__ import annotations

from kvpilot.contract.kv_layout import HybridKVLayout
from kvpilot.operator.planner import kv_dtype
from kvpilot.operator.planner.evaluate import Evaluation
from kvpilot.operator.planner.latency import FLOPS_EFFICIENCY, HBM_EFFICIENCY, REPLICA_UTILIZATION
from kvpilot.operator.planner.lora import lora_slots
from kvpilot.operator.planner.memory import (
    HOST_BASE_GIB,
    HOST_PER_RANK_GIB,
    SHM_BASE_GIB,
    SHM_PER_EXTRA_RANK_GIB,
    gib,
    host_memory_gib,
    offload_tiers_gib,
)
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.reserve import CALIBRATION_FILE, FIT, Reserve
from kvpilot.operator.planner.speculative import drafter


def _g(num_bytes: float) -> str:
    return f"{gib(num_bytes):,.2f} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _model_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    m = req.model
    sliding = (f" ({m.num_sliding_layers} of them sliding-window layers of {m.sliding_window:,} tokens)"
               if m.num_sliding_layers else "")
    lines = [f"Model {m.name}: {m.num_layers} layers{sliding}, {m.num_attention_heads} query / "
             f"{m.num_kv_heads} KV heads, head_dim {m.head_dim}, hidden {m.hidden_size:,}, {m.dtype}; "
             f"{m.num_params / 1e9:,.2f} B parameters; up to {m.max_position_embeddings:,} positions."]
    quant = req.overrides.weight_quantization or (m.weight_quantization if m.weight_bytes is None else None)
    if quant:
        emb = m.embedding_params
        lines.append(f"Weights: {m.num_params - emb:,} parameters in {quant} + {emb:,} embedding / LM-head "
                     f"parameters x {m.dtype_bytes} B = {ev.weight_bytes_total:,} B = "
                     f"{_g(ev.weight_bytes_total)} ({ev.weight_source}).")
    elif m.weight_bytes is None:
        per = ev.weight_bytes_total / m.num_params
        lines.append(f"Weights: {m.num_params:,} parameters x {per:g} B = {ev.weight_bytes_total:,} B "
                     f"= {_g(ev.weight_bytes_total)} ({ev.weight_source}).")
    else:
        lines.append(f"Weights: {ev.weight_bytes_total:,} B = {_g(ev.weight_bytes_total)} ({ev.weight_source}).")
    if ev.pp > 1:
        lines[-1] += (f" Over {ev.pp} pipeline stages of {ev.tp} GPU(s): {ev.gpus} GPUs, per GPU by stage "
                      + ", ".join(f"{_g(s.shape.weight_bytes)} (stage {s.shape.index})" for s in ev.stages) + ".")
    else:
        lines[-1] += f" Over {ev.tp} GPU(s): {_g(ev.budget.weight_bytes)} per GPU."
    return lines


def _stage_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    """Per pipeline stage: layers, what else it holds, its GPUs' weights, reserve and KV."""
    if ev.pp == 1:
        return []
    lay, binding = ev.layout, min(ev.stages, key=lambda s: s.budget.kv_bytes)
    lines = []
    for s in ev.stages:
        sh, b = s.shape, s.budget
        per_token = lay.bytes_per_token * sh.num_layers // lay.num_layers
        lines.append(
            f"Stage {sh.index} (node {sh.index + 1} of {ev.pp}): layers {sh.first_layer}-"
            f"{sh.first_layer + sh.num_layers - 1} ({sh.num_layers}; {sh.role}); per GPU weights "
            f"{_g(sh.weight_bytes)} + reserve {_g(b.reserve.total_bytes)}"
            f"{'' if sh.lm_head else ' (no sampler)'}; KV room {_g(b.budget_bytes)} - those = "
            f"{_g(b.kv_estimate_bytes)}, less the margin {_g(b.kv_available_bytes)}; KV "
            f"{per_token:,} B/token per GPU ({sh.num_layers} layers) -> {s.num_blocks:,} blocks alone.")
    lines.append(
        f"Stages together: every GPU gets the same KV bytes, the least room of any stage (stage "
        f"{binding.shape.index}: {_g(max(0, binding.budget.kv_bytes))}); the engine's blocks are the minimum "
        f"over its ranks, those of a stage of {lay.num_layers} layers: {ev.num_blocks:,} blocks "
        f"({ev.num_blocks * lay.block_size:,} tokens) = {_g(lay.memory_for_blocks(ev.num_blocks))} of KV per GPU.")
    return lines


def _reserve_lines(r: Reserve) -> list[str]:
    """One line per reserve term (value, how computed, source), then the total and the fit."""
    act = r.activation_term
    lines = [f"Reserve term {t.name}: {t.formula} ({t.source})." for t in (r.cuda_runtime, r.nccl)]
    lines.append(f"Reserve term activation peak = max(forward, sampler) = {act.name} {_g(act.num_bytes)}: "
                 f"forward {r.forward.formula} ({r.forward.source}); sampler {r.sampler.formula} "
                 f"({r.sampler.source}).")
    lines.append(f"Reserve term {r.cuda_graphs.name}: {r.cuda_graphs.formula} ({r.cuda_graphs.source}).")
    share = r.dominant.num_bytes / r.total_bytes if r.total_bytes else 0
    parts = " + ".join(f"{t.name} {_g(t.num_bytes)}" for t in r.counted if t.num_bytes)
    lines.append(f"Reserve = {parts} = {_g(r.total_bytes)}; {r.dominant.name} dominates ({share:.0%}). "
                 f"Fit on {FIT.cases} public vLLM start-up logs ({CALIBRATION_FILE}): planned / reported KV "
                 f"capacity median |error| {FIT.median_abs_error:.1%}, worst over-prediction "
                 f"{FIT.worst_over_prediction:+.1%} before the safety margin; "
                 f"{FIT.median_abs_error_after_margin:.1%} and {FIT.worst_over_prediction_after_margin:+.1%} "
                 f"after it.")
    return lines


def _memory_lines(req: PlanRequest, ev: Evaluation, dtype_notes: list[str]) -> list[str]:
    g, b, lay, m = req.gpu, ev.budget, ev.layout, req.model
    heads = (f"; {m.num_kv_heads} KV heads over {ev.tp} GPUs = {lay.num_kv_heads} per GPU"
             if ev.tp > 1 else "")
    source = f" ({g.memory_source})" if g.memory_source else ""
    return [
        f"GPU {g.description or g.name}: {_g(g.memory_bytes)} as CUDA reports it{source}; "
        f"{g.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
        f"{g.bf16_flops / 1e12:,.0f} TFLOP/s dense BF16. Budget = {b.gpu_memory_utilization:.2f} x "
        f"{_g(g.memory_bytes)} = {_g(b.budget_bytes)} per GPU.",
        *_reserve_lines(b.reserve),
        *_lora_lines(req, ev),
        f"KV estimate per GPU = {_g(b.budget_bytes)} - {_g(b.weight_bytes)} weights - "
        f"{_g(b.reserve.total_bytes)} reserve"
        + (f" - {b.lora_bytes:,} B LoRA slots" if b.lora_bytes else "")
        + f" = {_g(b.kv_estimate_bytes)}; less the "
        f"{b.kv_safety_margin:.1%} safety margin = {_g(b.kv_available_bytes)}"
        + (f"; pinned to {b.kv_bytes:,} B (kv_cache_memory_bytes)." if b.kv_pinned_bytes is not None else "."),
        f"KV dtype {kv_dtype.dtype_label(m, ev.kv_cache_dtype)}: {'; '.join(dtype_notes)}.",
        *_speculative_lines(req, lay),
        f"KV bytes/token per GPU = 2 (K,V) x {lay.num_layers} layers x {lay.num_kv_heads} KV heads x "
        f"{lay.head_dim} head_dim x {lay.dtype_bytes} B"
        + (f" + {lay.extra_bytes_per_token:,} B of the drafter" if getattr(lay, "extra_bytes_per_token", 0) else "")
        + f" = {lay.bytes_per_token:,} B ({lay.bytes_per_token / 1024:,.1f} KiB){heads}.",
        _blocks_line(lay, max(0, b.kv_bytes), ev.num_blocks),
    ]


def _speculative_lines(req: PlanRequest, lay) -> list[str]:
    """The drafter's weights and KV (speculative decoding), when the plan has one."""
    draft = drafter(req.overrides.speculative, req.model)
    return [draft.derivation(lay.dtype_bytes)] if draft is not None else []


def _lora_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    """The LoRA slots' term (the engine serves LoRA on one GPU, so one stage of all layers)."""
    slots = lora_slots(req.model, req.overrides.max_loras, req.overrides.max_lora_rank)
    return [slots.derivation() + "."] if slots else []


def _blocks_line(lay, kv_bytes: int, num_blocks: int) -> str:
    if isinstance(lay, HybridKVLayout):
        sliding = lay.num_sliding_blocks(num_blocks)
        return (f"Blocks (hybrid: two pools): the sliding-window layers' pool takes {sliding:,} blocks x "
                f"{lay.sliding.bytes_per_block:,} B ({lay.sliding.num_layers} layers); the rest, "
                f"{kv_bytes - sliding * lay.sliding.bytes_per_block:,} B / ({lay.block_size} tokens x "
                f"{lay.full.bytes_per_token:,} B = {lay.full.bytes_per_block:,} B per block of the "
                f"{lay.full.num_layers} full-attention layers) = {num_blocks:,} blocks = kv_token_capacity "
                f"{num_blocks * lay.block_size:,} tokens; kv_cache_memory_bytes = "
                f"{lay.memory_for_blocks(num_blocks):,} B.")
    return (f"Blocks: {kv_bytes:,} B / ({lay.block_size} tokens x {lay.bytes_per_token:,} B = "
            f"{lay.bytes_per_block:,} B per block) = {num_blocks:,} blocks = kv_token_capacity "
            f"{num_blocks * lay.block_size:,} tokens; kv_cache_memory_bytes = {num_blocks:,} x "
            f"{lay.bytes_per_block:,} = {lay.memory_for_blocks(num_blocks):,} B.")


def _sequence_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    slo, m, lay = req.slo, req.model, ev.layout
    seq = slo.seq_tokens_p95
    window = ""
    if m.kv_release_window is not None:
        window = (f"; every layer uses a {m.sliding_window:,}-token sliding window and the engine "
                  f"releases blocks outside it, so a sequence holds at most "
                  f"ceil(({m.sliding_window:,} - 1) / {lay.block_size}) + 1 blocks")
    elif isinstance(lay, HybridKVLayout):
        sliding = lay.num_sliding_blocks(ev.num_blocks)
        window = (f"; its {m.num_full_layers} full-attention layers keep every block, and its "
                  f"{m.num_sliding_layers} sliding-window layers ({m.sliding_window:,} tokens) have a "
                  f"pool of their own: min({lay.max_sliding_blocks:,} (max_num_seqs x "
                  f"(ceil(({m.sliding_window:,} - 2) / {lay.block_size}) + 2) + ceil(max_num_batched_tokens / "
                  f"{lay.block_size}), at most max_num_seqs x max_context blocks), the full pool's "
                  f"{ev.num_blocks:,}) = {sliding:,} blocks of {lay.sliding.bytes_per_block:,} B = "
                  f"{_g(sliding * lay.sliding.bytes_per_block)} per GPU, so the blocks counted here are the "
                  f"full-attention layers' ({lay.full.bytes_per_block:,} B each)")
    elif m.num_sliding_layers:
        window = (f"; its {m.num_sliding_layers} sliding-window layers share the block table of the "
                  f"full-attention layers, so every block is kept")
    return [
        f"Sequence: p95 {slo.p95_prompt_tokens:,} prompt + {slo.p95_output_tokens:,} output = {seq:,} tokens"
        f"{window} -> {ev.seq_blocks:,} blocks ({_g(lay.memory_for_blocks(ev.seq_blocks))} per GPU); "
        f"a max_context sequence ({slo.max_context:,} tokens) -> {ev.max_context_blocks:,} blocks.",
        f"KV limit (room for one max_context sequence, the rest at p95 length; the windowed pool "
        f"sized for that many sequences): {ev.limits['kv_capacity']:,} sequences; with the pool sized for "
        f"max_num_seqs {ev.max_num_seqs:,}: ({ev.num_blocks:,} - {ev.max_context_blocks:,}) // "
        f"{ev.seq_blocks:,} + 1 = {(ev.num_blocks - ev.max_context_blocks) // ev.seq_blocks + 1:,}."
        if ev.limits["kv_capacity"] and isinstance(lay, HybridKVLayout) else
        f"KV limit (room for one max_context sequence, the rest at p95 length): "
        f"({ev.num_blocks:,} - {ev.max_context_blocks:,}) // {ev.seq_blocks:,} + 1 = "
        f"{ev.limits['kv_capacity']:,} sequences." if ev.limits["kv_capacity"] else
        f"KV limit: 0 sequences (one max_context sequence needs {ev.max_context_blocks:,} blocks, "
        f"{ev.num_blocks:,} available).",
    ]


def _latency_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    slo, roof, out = req.slo, ev.roofline, []
    bw = f"{HBM_EFFICIENCY:.0%} x {req.gpu.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s"
    flops = f"{FLOPS_EFFICIENCY:.0%} x {roof.replica_flops / 1e12:,.0f} TFLOP/s"
    if slo.itl_p95_ms is not None:
        t = slo.itl_p95_ms / 1000
        out.append(f"ITL limit: a decode step reads {_g(roof.weight_bytes)} weights + B x "
                   f"{roof.seq_kv_bytes / 2**20:,.1f} MiB KV per GPU at {bw}; within {slo.itl_p95_ms:g} ms "
                   f"B <= {roof.batch_limit(t):,}; a step computes {roof.flops_per_token / 1e9:,.2f} GFLOP "
                   f"per token at {flops}: <= {roof.token_limit(t):,} tokens per step, less one block kept for "
                   f"prefill -> {ev.limits['itl']:,}.")
    out.append(f"max_num_batched_tokens = {ev.max_num_batched_tokens:,} ({ev.mnbt_source}).")
    if slo.ttft_p95_ms is not None:
        b = max(1, ev.max_num_seqs)
        share = ev.max_num_batched_tokens - b
        factor = f" x {ev.ttft_factor:g} (FP8 KV, head_dim {req.model.head_dim})" if ev.ttft_factor != 1 else ""
        steps = max(1.0, ev.prompt_uncached / share) if share > 0 else float("inf")
        step = roof.step_s(b, min(ev.max_num_batched_tokens, ev.prompt_uncached + b))
        out.append(f"TTFT: {ev.prompt_uncached:,} uncached prompt tokens in chunks of {share:,} "
                   f"(max_num_batched_tokens - {b:,} decoding) = {steps:,.2f} step(s) x {_ms(step)}{factor} "
                   f"= {_ms(ev.ttft_s)} at {b:,} sequences; largest batch (up to the target) within {slo.ttft_p95_ms:g} ms: "
                   f"{ev.limits['ttft']:,}.")
    parts = ", ".join(f"{n} {v:,}" for n, v in ev.limits.items())
    out.append(f"max_num_seqs = min({parts}) = {min(ev.limits.values()):,} (the target is the {ev.target_source})"
               + (f"; pinned to {ev.max_num_seqs:,}" if req.overrides.max_num_seqs is not None else "") + ".")
    if ev.max_num_seqs >= 1:
        b = ev.max_num_seqs
        out.append(f"Estimates at {b:,} sequences: ITL p95 ~ {_ms(ev.itl_s)} (a step with a full prefill "
                   f"chunk: memory {_ms(roof.memory_s(b))}, compute {_ms(roof.compute_s(ev.max_num_batched_tokens))}); "
                   f"TTFT p95 ~ {_ms(ev.ttft_s)}.")
    tp = ev.throughput
    if tp is not None:
        out.append(f"Throughput at p50 ({slo.prompt_tokens_p50:,} + {slo.output_tokens_p50:,} tokens): a request "
                   f"takes {_ms(tp.ttft_s)} prefill + {slo.output_tokens_p50:,} x {_ms(tp.decode_step_s)} = "
                   f"{tp.request_s:,.2f} s -> {ev.max_num_seqs:,} / {tp.request_s:,.2f} s = "
                   f"{tp.rps_by_concurrency:,.2f} req/s; compute allows {tp.rps_by_compute:,.2f} req/s -> "
                   f"{tp.rps:,.2f} req/s per replica (planned at {REPLICA_UTILIZATION:.0%}).")
    out.append(f"Replicas = {ev.replicas} ({ev.replicas_source}).")
    return out


def _host_lines(req: PlanRequest, ev: Evaluation) -> list[str]:
    out, p, slo = [], ev.prefixes, req.slo
    if slo.shared_prefix_tokens and not ev.enable_prefix_caching:
        out.append("Shared prefixes: prefix caching is off, so every request prefills its prefix.")
    if p is not None:
        free = ev.num_blocks - ev.max_context_blocks - max(0, ev.max_num_seqs - 1) * ev.seq_blocks
        out.append(f"Shared prefixes: {p.distinct:,} distinct x {slo.shared_prefix_tokens:,} tokens = "
                   f"{p.blocks_each:,} full blocks each ({_g(p.bytes_each)} across the replica); "
                   f"{max(0, free):,} blocks are left after the sequences: {p.on_gpu:,} stay on the GPU, "
                   f"{p.on_cpu:,} go to the CPU tier ({p.cpu_offload_gib:g} GiB), {p.on_disk:,} to disk "
                   f"({p.disk_offload_gib:g} GiB)" + (f", {p.uncached:,} are not cached" if p.uncached else "")
                   + ".")
    cpu, _ = offload_tiers_gib(p, req.overrides.cpu_offload_gib, req.overrides.disk_offload_gib, ev.tp,
                               req.model.releases_kv_blocks(req.slo.max_context))
    pod, shm = host_memory_gib(ev.tp, cpu)
    nccl = (f" + {SHM_PER_EXTRA_RANK_GIB} GiB x {ev.tp - 1} further rank(s) for NCCL" if ev.tp > 1 else "")
    out.append(f"Host: /dev/shm {shm:g} GiB ({cpu:g} GiB CPU KV tier + {SHM_BASE_GIB} GiB IPC{nccl}); pod memory "
               f"{pod:g} GiB = {HOST_BASE_GIB} GiB base + {HOST_PER_RANK_GIB} GiB x {ev.tp} GPU worker(s) + "
               "/dev/shm (tmpfs counts against the pod's memory limit).")
    return out


def derivation(req: PlanRequest, ev: Evaluation, dtype_notes: list[str], shape_notes: list[str]) -> list[str]:
    """Numbered derivation lines for the chosen candidate."""
    lines = (_model_lines(req, ev) + _memory_lines(req, ev, dtype_notes) + _stage_lines(req, ev)
             + _sequence_lines(req, ev)
             + _latency_lines(req, ev) + _host_lines(req, ev) + shape_notes)
    return [f"{i}. {line}" for i, line in enumerate(lines, 1)]
