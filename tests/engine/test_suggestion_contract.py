"""The planner suggests only what the engine serves.

For every kind of suggestion the planner can make (``suggest.SUGGESTION_KINDS``, checked
against the kinds its source can emit), a request on a tiny bf16 Qwen3 checkpoint that
the planner finds infeasible and fixes with that kind: the suggestion's patch gives a
feasible plan, and the engine starts from that plan's ``kvpilot serve`` flags (parsed by
the server's own parser) on a checkpoint of the kind planned (the FP8 one for
``weight_quantization``) and serves a request. One liberty: the GPU-sized
``--kv-cache-memory-bytes`` is capped at 16 MiB (still more than a max_model_len
sequence needs) so that the CPU test machine can allocate it.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields, replace

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser
from kvpilot.operator.planner import PlanRequest, make_plan
from kvpilot.operator.planner import suggest as suggest_module

from support.fp8_checkpoints import quantize

SHAPE = dict(dtype="bfloat16", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
             max_position_embeddings=4096)
KV_CAP = 16 << 20
SLO = {"max_context": 1024, "p95_prompt_tokens": 256, "p95_output_tokens": 64, "concurrency": 1}
BIG = {"max_context": 4096, "p95_prompt_tokens": 1024, "p95_output_tokens": 256, "concurrency": 64}
# kind -> (GPU memory GiB, SLO, overrides) of a request the planner fixes with that kind (the
# memory sizes sit just past each kind's threshold under the fitted reserve constants)
SCENARIOS = {
    "fewer_sequences": (0.3625, BIG, {"replicas": 1}),
    "replicas": (0.8, {**BIG, "concurrency": 512}, {"replicas": 1, "pipeline_parallel_size": 1}),
    "drop_override": (0.3625, BIG, {"replicas": 1}),
    "gpu_memory_utilization": (0.315, SLO, {}),
    "fp8_kv": (0.3238, SLO, {}),
    "max_context": (0.3237, SLO, {}),
    "itl_target": (1.0, {**SLO, "itl_p95_ms": 0.001}, {}),
    "ttft_target": (1.0, {**BIG, "itl_p95_ms": 0.01, "ttft_p95_ms": 0.01}, {}),
    # one node: the engine serves no pipeline stages yet (issue 31's engine half)
    "tensor_parallel": (1.073, {**SLO, "concurrency": 512, "itl_p95_ms": 0.5},
                        {"tensor_parallel_size": 1, "replicas": 1, "pipeline_parallel_size": 1}),
    "gpu": (0.25, SLO, {}),
    "weight_quantization": (0.3236, SLO, {}),
    "combined": (0.3, {**BIG, "max_context": 32768}, {"max_num_seqs": 300}),
}


def test_every_kind_the_planner_can_suggest_is_listed():
    source = inspect.getsource(suggest_module)
    emitted = set(re.findall(r'yield "(\w+)"', source)) | set(re.findall(r'Suggestion\("(\w+)"', source))
    assert emitted == set(suggest_module.SUGGESTION_KINDS) == set(SCENARIOS)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    bf16 = tiny_checkpoint("qwen3", **SHAPE)
    fp8, _ = quantize(bf16, tmp_path_factory.mktemp("contract") / "fp8", "fp8-block")
    return {None: bf16, "fp8": fp8}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SCENARIOS))
def test_the_engine_serves_each_suggestion(kind, checkpoints):
    memory, slo, overrides = SCENARIOS[kind]
    request = PlanRequest.from_dict({"model": str(checkpoints[None]), "gpu": {"name": "l4", "memory_gib": memory},
                                     "slo": slo, "overrides": overrides})
    plan = make_plan(request)
    assert not plan.feasible
    suggestion = next(s for s in plan.suggestions if s.kind == kind)
    patched = request.apply(suggestion.apply)
    fixed = make_plan(patched)
    assert fixed.feasible, (kind, fixed.binding_detail)
    path = checkpoints[patched.overrides.weight_quantization]
    flags = fixed.serve_args()
    at = flags.index("--kv-cache-memory-bytes") + 1
    flags[at] = str(min(int(flags[at]), KV_CAP))
    args = engine_args_from_namespace(make_serve_parser().parse_args([str(path), "--dtype", "bfloat16", *flags]))
    llm = LLM(args.model, **{f.name: getattr(args, f.name) for f in fields(args) if f.name != "model"})
    engine = llm.llm_engine
    try:
        assert engine.cache_info.kv_cache_dtype == ("fp8_e4m3" if fixed.kv_cache_dtype.startswith("fp8")
                                                    else "bfloat16")
        assert engine.parallel_config.tensor_parallel_size == fixed.tensor_parallel_size
        assert engine.model_config.max_model_len == fixed.max_model_len
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        if engine.workers is not None:
            engine.close()


def test_every_weight_quantization_the_planner_plans_is_servable(checkpoints):
    """Each quantization the planner accepts or suggests has a checkpoint the engine loads,
    whose weight memory is what the planner counts for it (safetensors headers, and the
    config-only estimate within the per-block scales)."""
    from kvpilot.engine.model.layers.fp8_linear import fp8_weight_bytes
    from kvpilot.operator.planner.catalog import model_from_path
    from kvpilot.operator.planner.weights import WEIGHT_QUANT_BYTES

    for quant in WEIGHT_QUANT_BYTES:
        path = checkpoints[quant]
        model = model_from_path(path)
        assert model.weight_quantization == quant
        llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks=16, max_model_len=64)
        held = fp8_weight_bytes(llm.llm_engine.runner.model)
        assert model.total_weight_bytes == held
        config_only = replace(model, weight_bytes=None)     # as from config.json alone
        assert held * 0.97 < config_only.total_weight_bytes <= held
        bf16 = model_from_path(checkpoints[None]).total_weight_bytes
        print(f"\nA3/A4 {quant}: planner weight bytes {model.total_weight_bytes:,} (headers) / "
              f"{config_only.total_weight_bytes:,} (config.json only) vs engine {held:,}; 16-bit {bf16:,}")
