"""The planner's LoRA term: the bytes it takes from the KV budget are the bytes the engine
allocates for its adapter slots (one shared torch-free formula), and the plan's KV shrinks
by exactly them."""

from __future__ import annotations

from kvpilot.engine import LLM
from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner.catalog import model_from_path
from kvpilot.operator.planner.lora import lora_slots


def _request(model_dir, **lora):
    return PlanRequest.from_dict({
        "model": str(model_dir / "config.json"),
        "gpu": {"name": "l4", "memory_gib": 1.25},
        "slo": {"max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256, "concurrency": 4},
        "overrides": lora,
    })


def test_planner_lora_bytes_equal_the_engines_slots(demo_model_dir):
    model = model_from_path(str(demo_model_dir / "config.json"))
    slots = lora_slots(model, 4, 16)
    # The demo checkpoint is bfloat16: compute in bfloat16 so "auto" is the same slot dtype.
    llm = LLM(str(demo_model_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=1 << 22,
              enable_lora=True, max_loras=4, max_lora_rank=16)
    engine_bytes = llm.llm_engine.runner.lora.slots.num_bytes
    assert slots.num_bytes == engine_bytes
    # independently: A [rank, in] + B [rank, out] for the 7 projections, each layer, 2 bytes
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    per_layer = 2 * (h + q) + 2 * (h + kv) + 2 * (h + inter) + (inter + h)
    assert engine_bytes == 4 * 16 * per_layer * model.num_layers * 2


def test_the_plans_kv_budget_shrinks_by_the_lora_slots(demo_model_dir):
    plain = make_plan(_request(demo_model_dir))
    lora = make_plan(_request(demo_model_dir, max_loras=4, max_lora_rank=16))
    slots = lora_slots(model_from_path(str(demo_model_dir / "config.json")), 4, 16)
    assert plain.feasible and lora.feasible
    assert plain.memory["kv_estimate_bytes"] - lora.memory["kv_estimate_bytes"] == slots.num_bytes
    assert lora.num_gpu_blocks <= plain.num_gpu_blocks
    line = next(s for s in lora.derivation if "LoRA slots per GPU =" in s)
    assert f"{slots.num_bytes:,} B" in line and "4 max_loras x rank 16" in line
    assert f"{slots.num_bytes:,} B LoRA slots" in next(s for s in lora.derivation if "KV estimate per GPU" in s)


def test_lora_needs_one_gpu_per_replica(demo_model_dir):
    plan = make_plan(_request(demo_model_dir, max_loras=2, tensor_parallel_size=2))
    assert not plan.feasible and plan.binding_constraint == "lora"
