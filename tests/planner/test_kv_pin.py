"""A pinned KV cache (``kv_cache_memory_bytes``, the CRD's ``engine.kvCacheMemoryBytes``) and
the demo checkpoint as a catalogue model: what the closed-loop test plans a tiny engine with."""

from __future__ import annotations

from kvpilot.operator.planner.catalog import model_from_path, preset_model

MIB = 1 << 20
DEMO_SLO = {"max_context": 256, "p95_prompt_tokens": 224, "p95_output_tokens": 32, "concurrency": 4}


def test_a_pinned_kv_cache_sets_the_blocks_and_max_num_seqs(plan_for):
    free = plan_for(model="kvpilot-demo", gpu="l4", **DEMO_SLO)
    pinned = plan_for(model="kvpilot-demo", gpu="l4", overrides={"kv_cache_memory_bytes": 4 * MIB}, **DEMO_SLO)
    per_block = 16 * 2 * 8 * 2 * 64 * 2                   # 16 tokens x K,V x layers x KV heads x dim x bf16
    assert pinned.feasible and pinned.num_gpu_blocks == 4 * MIB // per_block == 64
    assert pinned.kv_cache_memory_bytes == 4 * MIB and pinned.kv_token_capacity == 1024
    assert pinned.limits["kv_capacity"] == (64 - 16) // 16 + 1 == pinned.max_num_seqs == 4
    # what the GPU leaves is planned as before; only the cache is smaller
    assert pinned.memory["kv_available_bytes"] == free.memory["kv_available_bytes"] > 1000 * MIB
    assert pinned.memory["kv_estimate_bytes"] == free.memory["kv_estimate_bytes"]
    assert "pinned to 4,194,304 B (kv_cache_memory_bytes)" in " ".join(pinned.derivation)
    assert "--kv-cache-memory-bytes" in pinned.serve_args() and str(4 * MIB) in pinned.serve_args()


def test_a_pinned_kv_cache_must_fit(plan_for):
    too_big = plan_for(model="qwen3-8b", gpu="l4", overrides={"kv_cache_memory_bytes": 64 << 30},
                       max_context=8192, p95_prompt_tokens=2048, p95_output_tokens=512, concurrency=8)
    assert not too_big.feasible and too_big.binding_constraint == "gpu_memory"
    assert "the pinned KV cache of 64.00 GiB must fit" in too_big.binding_detail


def test_the_demo_preset_is_the_demo_checkpoint(demo_model_dir):
    built, preset = model_from_path(demo_model_dir), preset_model("kvpilot-demo")
    for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "dtype", "num_params",
                  "sliding_window", "rope_theta"):
        assert getattr(built, field) == getattr(preset, field), field
    assert built.total_weight_bytes == preset.total_weight_bytes  # safetensors bytes = params x bf16
