"""Tensor x pipeline parallel shapes: TP within a node, stages across nodes only when one
node cannot hold the weights and the SLO's KV, per-stage weights and KV."""

from __future__ import annotations

import pytest

from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner.model_spec import model_from_config
from kvpilot.operator.planner.stages import layer_split, stage_shapes

GIB = 1 << 30
# the 405B example's SLO (crds/examples/llama-405b-fp8-two-nodes.yaml)
SLO_405B = {"max_context": 131072, "p95_prompt_tokens": 8192, "p95_output_tokens": 1024}


def _plan(concurrency: int, model: str = "llama-3.1-405b-fp8", gpu: object = "h100-80gb", **overrides):
    return make_plan(PlanRequest.from_dict({"model": model, "gpu": gpu,
                                            "slo": {**SLO_405B, "concurrency": concurrency},
                                            "overrides": overrides}))


@pytest.mark.parametrize("layers, pp, split", [
    (126, 2, (63, 63)), (80, 3, (27, 27, 26)), (32, 1, (32,)), (10, 4, (2, 3, 3, 2)), (7, 7, (1,) * 7)])
def test_layer_split_is_vllms(layers, pp, split):
    # vllm.distributed.utils.get_pp_indices: num_layers // pp each, the remainder to the
    # stages just before the last
    assert layer_split(layers, pp) == split


def test_the_405b_example_is_two_nodes_of_eight():
    plan = _plan(64)
    assert plan.feasible, plan.binding_detail
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.replicas) == (8, 2, 1)
    assert plan.serve_args()[-4:] == ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
    first, last = plan.stages
    assert (first["first_layer"], first["num_layers"], first["holds"]) == (0, 63, "embedding")
    assert (last["first_layer"], last["num_layers"], last["holds"]) == (63, 63, "LM head")
    # every GPU gets the same KV bytes, within what every stage has room for; the blocks are
    # those of one stage's 63 layers (the engine's round trip)
    assert all(plan.kv_cache_memory_bytes <= s["kv_available_bytes_per_gpu"] for s in plan.stages)
    assert plan.kv_layout.num_layers == 63
    assert plan.kv_layout.num_blocks(plan.kv_cache_memory_bytes) == plan.num_gpu_blocks
    assert plan.kv_bytes_per_token == 2 * 63 * 1 * 128 * 2
    text = "\n".join(plan.derivation)
    assert "KV for only 25 of the 64 sequences" in text and "2 nodes x 8 -> 1 replica(s) = 16 GPUs" in text
    assert "8 -> 3 replica(s) = 24 GPUs" in text


def test_one_node_is_kept_while_it_holds_the_slos_kv():
    plan = _plan(16)
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.replicas) == (8, 1, 1)
    assert plan.stages == () and "--pipeline-parallel-size" not in plan.serve_args()
    assert "one node holds the weights and the SLO's KV" in plan.derivation[-1]


def test_bf16_405b_does_not_fit_one_node_and_takes_the_fewest_nodes_that_hold_it():
    plan = _plan(8, model="llama-3.1-405b")
    assert plan.feasible, plan.binding_detail
    # 756 GiB of bf16 weights: 8 x 71.2 GiB budget per node cannot hold them, 2 nodes can
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (8, 2)
    assert "cannot hold the weights and one max_context sequence" in plan.derivation[-1]


def test_gpus_per_node_caps_tensor_parallelism():
    plan = _plan(64, gpu={"name": "h100-80gb", "gpus_per_node": 4})
    assert plan.tensor_parallel_size == 4 and plan.pipeline_parallel_size >= 3
    same = _plan(64, gpus_per_node=4)
    assert (same.tensor_parallel_size, same.pipeline_parallel_size) == (
        plan.tensor_parallel_size, plan.pipeline_parallel_size)
    assert same.gpus_per_node == 4


def test_a_pinned_tp_below_a_node_grows_within_the_node_first():
    plan = _plan(64, tensor_parallel_size=4)
    assert plan.pipeline_parallel_size == 1
    assert "do not fill a node of 8" in plan.derivation[-1]


def test_pinned_stages_and_their_errors():
    plan = _plan(16, pipeline_parallel_size=2)
    # two stages pinned: the fewest GPUs per stage that hold them (4 + 4 of 8 x 80 GB)
    assert (plan.pipeline_parallel_size, plan.tensor_parallel_size) == (2, 4)
    assert _plan(16, pipeline_parallel_size=2, tensor_parallel_size=8).tensor_parallel_size == 8
    with pytest.raises(ValueError, match="sliding-window KV pool"):
        make_plan(PlanRequest.from_dict({"model": "gemma-2-9b", "gpu": "l4",
                                         "slo": {"max_context": 8192, "p95_prompt_tokens": 1024,
                                                 "p95_output_tokens": 512, "concurrency": 4},
                                         "overrides": {"pipeline_parallel_size": 2}}))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be in"):
        _plan(16, pipeline_parallel_size=9)


def test_stage_weights_are_the_checkpoints_parameters_by_stage():
    """Oracle: transformers' own Llama and Qwen3 modules, their parameters assigned to stages
    the way vLLM's pipeline-parallel models hold them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for tied in (False, True):
        cfg = {"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 160,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
               "max_position_embeddings": 512, "torch_dtype": "bfloat16", "tie_word_embeddings": tied}
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")})
        with torch.device("meta"):
            hf = transformers.LlamaForCausalLM(hf_cfg)
        pp, tp = 3, 1
        split = layer_split(6, pp)
        starts = [sum(split[:i]) for i in range(pp)]
        held = [0] * pp
        for name, param in hf.named_parameters(remove_duplicate=False):
            if name.startswith("model.layers."):
                i = int(name.split(".")[2])
                stage = max(s for s in range(pp) if starts[s] <= i)
            elif name.startswith("model.embed_tokens"):
                stage = 0
            else:                       # model.norm, lm_head (the tied one too)
                stage = pp - 1
            held[stage] += param.numel() * 2
        model = model_from_config(cfg, "tiny")
        stored = sum(p.numel() for p in hf.parameters()) * 2      # tied: the matrix once
        assert model.total_weight_bytes == stored
        shapes = stage_shapes(model, stored, tp, pp)
        # the final norm (hidden values) rides with the layers: within 2 x hidden bytes per stage
        assert all(abs(s.weight_bytes - h) <= 2 * 64 * 2 for s, h in zip(shapes, held, strict=True)), (
            [s.weight_bytes for s in shapes], held)
