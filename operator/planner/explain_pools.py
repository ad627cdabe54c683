"""The derivation of the prefill:decode ratio (``pools.plan_pools``), one line per step
with every figure it used, as ``explain`` writes a plan's: ``status.plan.disaggregation``."""

from __future__ import annotations

from kvpilot.operator.planner.latency import FLOPS_EFFICIENCY, HBM_EFFICIENCY, REPLICA_UTILIZATION
from kvpilot.operator.planner.pools import KV_TRANSFER_BYTES_PER_S, PoolFigures, PoolPlan


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _limits(limits: dict[str, int]) -> str:
    return ", ".join(f"{name} {value:,}" for name, value in limits.items())


def _utilization(fig: PoolFigures) -> str:
    service = fig.prompt_p50 / fig.tokens_per_s
    if fig.ttft_target_s is None:
        return f"Prefill utilization rho = {fig.utilization:.0%} ({fig.utilization_source}; no TTFT target)."
    slack = fig.ttft_target_s - fig.ttft_s
    bound = 2 * slack / (service + 2 * slack)
    return (f"Prefill utilization: TTFT slack = {_ms(fig.ttft_target_s)} target - {_ms(fig.ttft_s)} = {_ms(slack)}; "
            f"a p50 prompt takes s = {fig.prompt_p50:,} / {fig.tokens_per_s:,.0f} = {_ms(service)}; queued behind "
            f"others it waits rho x s / (2 (1 - rho)) (M/D/1), within the slack while rho <= 2 x slack / "
            f"(s + 2 x slack) = {bound:.1%} -> rho = {fig.utilization:.1%} ({fig.utilization_source}).")


def pool_derivation(pools: PoolPlan) -> list[str]:
    """Numbered lines: each pool's plan in brief, then the ratio step by step."""
    p, d, fig = pools.prefill, pools.decode, pools.figures
    lines = [
        f"Pools: each planned on its own, one node of {d.tensor_parallel_size}x {d.gpu} per replica, KV "
        f"{d.kv_cache_dtype} ({d.kv_bytes_per_token:,} B/token per GPU) on both. Prefill pool (prompts that "
        f"return one token): max_num_batched_tokens C = {p.max_num_batched_tokens:,}, max_num_seqs "
        f"{p.max_num_seqs:,} ({_limits(p.limits)}). Decode pool: max_num_seqs B = {d.max_num_seqs:,} "
        f"(min of {_limits(d.limits)}: {d.binding_constraint}).",
    ]
    if fig is None:
        lines.append(f"No ratio: {pools.binding_detail}.")
        return [f"{i}. {line}" for i, line in enumerate(lines, 1)]
    lines += [
        f"Prefill rate: a step of C = {fig.chunk:,} prompt tokens at {fig.flops_per_token / 1e9:,.4f} GFLOP/token "
        f"(a {fig.prompt_p95:,}-token prompt) takes max(memory {_ms(fig.chunk_memory_s)}, compute "
        f"{_ms(fig.chunk_compute_s)} at {FLOPS_EFFICIENCY:.0%} of peak) = {_ms(fig.chunk_s)} -> mu = "
        f"{fig.tokens_per_s:,.0f} tokens/s per replica.",
        f"Decode step at B = {fig.decode_batch:,}: max(memory {_ms(fig.decode_memory_s)} (weights + B p95 "
        f"sequences' KV at {HBM_EFFICIENCY:.0%} of peak bandwidth), compute {_ms(fig.decode_compute_s)}) = "
        f"t_decode {_ms(fig.decode_step_s)}.",
        f"TTFT without a queue: a p95 prompt ({fig.prompt_p95:,} uncached tokens, "
        f"{max(1.0, fig.prompt_p95 / fig.chunk):,.3f} step(s)) {_ms(fig.prefill_s)} + its KV to the decode pod "
        f"{fig.prompt_p95:,} x {d.kv_bytes_per_token:,} B / {KV_TRANSFER_BYTES_PER_S / 1e9:g} GB/s per GPU = "
        f"{_ms(fig.transfer_s)} + one decode step {_ms(fig.decode_step_s)} = {_ms(fig.ttft_s)}.",
        _utilization(fig),
        f"Request rate lambda = {fig.arrival_rps:,.2f} req/s ({fig.arrival_source}).",
        f"Prefill replicas = ceil(lambda x P50 {fig.prompt_p50:,} / (rho x mu)) = "
        f"ceil({fig.arrival_rps * fig.prompt_p50 / (fig.utilization * fig.tokens_per_s):,.2f}) = "
        f"{pools.prefill_replicas}.",
        f"Decode: sequences in flight = max(concurrency, lambda x O50 {fig.output_p50:,} x t_decode) = "
        f"{fig.in_flight:,.1f}; decode replicas = ceil({fig.in_flight:,.1f} / ({REPLICA_UTILIZATION:.0%} x B "
        f"{fig.decode_batch:,})) = ceil({fig.in_flight / (REPLICA_UTILIZATION * fig.decode_batch):,.2f}) = "
        f"{pools.decode_replicas}.",
        f"Ratio prefill:decode = {pools.ratio}.",
    ]
    return [f"{i}. {line}" for i, line in enumerate(lines, 1)]
