"""One cost model of a step for the engine's MFU metrics and the planner's latency.

Oracles: counting (query, key) pairs one by one, and the engine itself: a real engine run
with ``enable_mfu_metrics`` counts the FLOPs of its steps, and the planner's model of the
same checkpoint (read from the same config.json by the planner's own parser) must give
the same figure.
"""

from __future__ import annotations

import pytest

from kvpilot.contract.step_cost import StepCostModel
from kvpilot.engine import LLM
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner.latency import step_cost_model


def _model(num_sliding_layers: int = 0, sliding_window: int | None = None) -> StepCostModel:
    return StepCostModel(num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                         head_dim=16, vocab_size=100, weight_bytes=2, kv_bytes_per_token=4 * 2 * 2 * 16 * 2,
                         num_sliding_layers=num_sliding_layers, sliding_window=sliding_window)


@pytest.mark.parametrize("num_new,context_len,window", [(1, 10, None), (10, 10, None), (7, 30, None),
                                                         (1, 10, 4), (10, 10, 4), (7, 30, 4), (3, 5, 8),
                                                         (20, 64, 16), (16, 16, 16)])
def test_attention_pairs_are_counted_as_each_query_sees_its_keys(num_new, context_len, window):
    full, sliding = _model(), _model(num_sliding_layers=3, sliding_window=window or 1 << 20)
    def brute(w):
        return sum(min(p + 1, w) for p in range(context_len - num_new, context_len))
    per_pair = 4 * 4 * 16
    linear_and_head = full.flops(num_new, context_len) - 4 * per_pair * brute(1 << 30)
    assert linear_and_head == 2 * num_new * 4 * full.layer_linear_params + 2 * 100 * 64
    assert sliding.flops(num_new, context_len) - linear_and_head == \
        per_pair * (brute(1 << 30) + 3 * brute(window or 1 << 20))


def test_a_sliding_window_bounds_the_kv_a_step_reads():
    model = _model(num_sliding_layers=2, sliding_window=8)
    assert model.kv_tokens_read(4) == 4
    assert model.kv_tokens_read(100) == (2 * 100 + 2 * 8) // 4 == 54
    assert model.step([(1, 100)]).read_bytes == model.weight_read_bytes + 54 * model.kv_bytes_per_token


def test_the_planner_times_the_flops_the_engine_counts(demo_model_dir):
    """A prefill of P tokens: the engine's MFU counter and the planner's roofline FLOPs/token."""
    request = PlanRequest.from_dict({
        "model": str(demo_model_dir / "config.json"), "gpu": {"name": "l4", "memory_gib": 1.25},
        "slo": {"max_context": 512, "p95_prompt_tokens": 64, "p95_output_tokens": 16, "concurrency": 2}})
    plan = make_plan(request)
    cost = step_cost_model(request.model, plan.kv_bytes_per_token, 1, plan.memory["weight_bytes_total"])
    llm = LLM(str(demo_model_dir), dtype="bfloat16", kv_cache_memory_bytes=plan.kv_cache_memory_bytes,
              max_model_len=512, enable_mfu_metrics=True)
    prompt = list(range(10, 10 + 37))
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    stats = llm.get_stats()
    assert stats.estimated_flops == round(cost.flops_per_token(len(prompt)) * len(prompt))
    assert stats.estimated_write_bytes == len(prompt) * plan.kv_bytes_per_token
