"""Speculative decoding in the plan: the drafter's weights and KV counted, one GPU, the
engine flag, and the round trip (an engine given the plan's flags allocates its blocks)."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM
from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner.catalog import preset_model

from support.eagle_heads import build_eagle_head

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
DRAFT = {"method": "draft_model", "model": "/models/Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}
EAGLE = {"method": "eagle", "model": "/models/eagle-head", "num_speculative_tokens": 4}


def test_the_drafters_weights_and_kv_are_in_the_budget(plan_for):
    plain = plan_for(model="qwen3-8b", gpu="l4", max_context=8192, p95_prompt_tokens=2000, concurrency=16,
                     overrides={"tensor_parallel_size": 1})   # what speculation is planned on

    def plan(spec):
        return plan_for(model="qwen3-8b", gpu="l4", max_context=8192, p95_prompt_tokens=2000, concurrency=16,
                        overrides={"speculative": spec})

    ngram, draft, eagle = plan(NGRAM), plan(DRAFT), plan(EAGLE)
    assert ngram.memory["weight_bytes_total"] == plain.memory["weight_bytes_total"]
    assert ngram.kv_bytes_per_token == plain.kv_bytes_per_token and ngram.num_gpu_blocks == plain.num_gpu_blocks
    small = preset_model("qwen3-0.6b")
    assert draft.memory["weight_bytes_total"] == plain.memory["weight_bytes_total"] + small.total_weight_bytes
    draft_kv = 2 * small.num_layers * small.num_kv_heads * small.head_dim * 2
    assert draft.kv_bytes_per_token == plain.kv_bytes_per_token + draft_kv
    assert draft.num_gpu_blocks < plain.num_gpu_blocks and draft.max_num_seqs <= plain.max_num_seqs
    assert eagle.kv_bytes_per_token == plain.kv_bytes_per_token + 2 * 8 * 128 * 2   # one layer
    for p in (ngram, draft, eagle):
        assert p.tensor_parallel_size == 1
        assert p.kv_layout.num_blocks(p.kv_cache_memory_bytes) == p.num_gpu_blocks
        assert p.serve_args()[-2] == "--speculative-config"
        assert any("Speculative decoding" in line for line in p.derivation)
    assert any("draft model Qwen3-0.6B" in line and "GiB of weights" in line for line in draft.derivation)


def test_speculation_runs_on_one_gpu_and_the_draft_must_be_known(req_dict):
    with pytest.raises(ValueError, match="one GPU"):
        PlanRequest.from_dict(req_dict(overrides={"speculative": NGRAM, "tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match="catalogue preset"):
        make_plan(PlanRequest.from_dict(req_dict(overrides={"speculative": {**DRAFT, "model": "/m/mystery"}})))
    with pytest.raises(ValueError, match="same vocabulary"):
        make_plan(PlanRequest.from_dict(req_dict(model="llama-3.1-8b", overrides={"speculative": DRAFT})))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PlanRequest.from_dict(req_dict(overrides={"speculative": {"method": "ngram"}}))


def _demo_request(demo_model_dir, spec: dict) -> PlanRequest:
    return PlanRequest.from_dict({
        "model": str(demo_model_dir / "config.json"), "gpu": {"name": "l4", "memory_gib": 0.6},   # a small KV pool to allocate
        "slo": {"max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256, "concurrency": 4},
        "overrides": {"speculative": spec}})


@pytest.mark.slow
def test_engine_allocates_the_planned_blocks_with_a_drafter(demo_model_dir, tmp_path):
    """The demo model with an EAGLE head, and with itself as its draft model (named by its
    catalogue preset): the engine's KV blocks are the plan's, the drafter's KV included."""
    head = build_eagle_head(demo_model_dir, tmp_path / "head")
    (tmp_path / "kvpilot-demo").symlink_to(demo_model_dir)
    for spec in ({**EAGLE, "model": str(head)},
                 {**DRAFT, "model": str(tmp_path / "kvpilot-demo")}):
        plan = make_plan(_demo_request(demo_model_dir, spec))
        assert plan.feasible and plan.draft_kv_bytes_per_token > 0, plan.binding_constraint
        llm = LLM(str(demo_model_dir), dtype="bfloat16", kv_cache_memory_bytes=plan.kv_cache_memory_bytes,
                  block_size=plan.block_size, max_model_len=plan.max_model_len, speculative_config=spec)
        info = llm.llm_engine.cache_info
        assert info.num_gpu_blocks == plan.num_gpu_blocks, spec["method"]
        assert info.bytes_per_block == plan.kv_bytes_per_token * plan.block_size
