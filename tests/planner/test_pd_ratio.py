"""The prefill:decode ratio of three SLO / traffic shapes, worked by hand (issue 44, point 4).

Qwen3-8B (36 layers, hidden 4,096, MLP 12,288, 32 heads and 8 KV heads of 128, vocabulary
151,936; 16,381,470,720 B of BF16 weights) on one H100 80GB per replica (989 TFLOP/s dense
BF16, 3.35 TB/s), at 50 % of peak compute and 80 % of peak bandwidth (``latency.py``), KV
transfer at 25 GB/s per GPU, replicas planned at 80 % (``pools.py``).

Shared figures:

- KV per token = 2 (K, V) x 36 x 8 x 128 x 2 B = 147,456 B.
- FLOPs per token of a P-token prompt (``step_cost``): the linear layers 2 x 36 x
  (4,096 x (4,096 + 2 x 1,024) + 4,096 x 4,096 + 3 x 4,096 x 12,288) = 2 x 6,945,767,424 =
  13,891,534,848; the LM head once per prompt 2 x 151,936 x 4,096 / P = 1,244,659,712 / P;
  attention 4 x 32 x 128 x 36 x (P + 1) / 2 = 294,912 x (P + 1). So P = 8,192:
  13,891,534,848 + 151,936 + 2,416,214,016 = 16,307,900,800; P = 1,024: 13,891,534,848 +
  1,215,488 + 302,284,800 = 14,195,035,136; P = 2,048: 13,891,534,848 + 607,744 +
  604,274,688 = 14,496,417,280.
- The prefill pool's chunk C = 8,192 (vLLM's default on an H100); a chunk is compute-bound
  (8,192 x 16.31 GFLOP / 494.5 TFLOP/s = 270.2 ms against 6.6 ms to read the weights), so
  a replica prefills mu = 494.5e12 / FLOPs-per-token tokens/s.
- A decode step at batch B reads the weights and B p95 sequences' KV:
  (16,381,470,720 + B x seq x 147,456) / 2.68e12 s; its compute (B tokens) is far below.
- The decode batch B is the KV limit (``kv_seq_limit``): (blocks - blocks of one max_context
  sequence) // blocks of a p95 sequence + 1, with the 22,039 blocks of 16 tokens the decode
  plan's memory budget leaves (that budget is checked in test_worked_numbers / the
  calibration tests); the ITL limit is larger in each case.

RAG, prefill-heavy (p95 / p50 prompt 8,192 / 6,144, output 256 / 128, 20 req/s, TTFT 500 ms,
ITL 50 ms, context 16,384):
  B = (22,039 - 1,024) // 528 + 1 = 40 (ITL would allow floor((0.05 x 2.68e12 - 16,381,470,720)
  / (8,448 x 147,456)) = 94). mu = 494.5e12 / 16,307,900,800 = 30,322.7 tokens/s.
  TTFT without a queue = prefill 8,192 x 16,307,900,800 / 494.5e12 = 270.16 ms + transfer
  8,192 x 147,456 / 25e9 = 48.32 ms + decode step (16,381,470,720 + 40 x 8,448 x 147,456) /
  2.68e12 = 24.71 ms = 343.18 ms. Slack 156.82 ms; a p50 prompt takes s = 6,144 / 30,322.7 =
  202.62 ms; M/D/1 keeps the wait within the slack while rho <= 2 x 156.82 / (202.62 +
  313.63) = 0.6075 (below 0.8: TTFT binds). Prefill = ceil(20 x 6,144 / (0.6075 x 30,322.7))
  = ceil(6.67) = 7. Decode: 20 x 128 x 24.71 ms = 63.25 in flight; ceil(63.25 / (0.8 x 40)) =
  ceil(1.98) = 2. Ratio 7:2.

Chat, decode-heavy (prompt 1,024 / 512, output 2,048 / 1,024, 20 req/s, TTFT 500 ms, ITL 30 ms,
context 8,192):
  B = (22,039 - 512) // 192 + 1 = 113. mu = 494.5e12 / 14,195,035,136 = 34,836.1 tokens/s.
  TTFT without a queue = 1,024 x 14,195,035,136 / 494.5e12 = 29.39 ms + 1,024 x 147,456 / 25e9
  = 6.04 ms + (16,381,470,720 + 113 x 3,072 x 147,456) / 2.68e12 = 25.21 ms = 60.65 ms; the
  slack allows rho <= 2 x 439.35 / (14.70 + 878.71) = 0.98, so rho = 0.8. Prefill =
  ceil(20 x 512 / (0.8 x 34,836.1)) = ceil(0.37) = 1. Decode: 20 x 1,024 x 25.21 ms = 516.35 in
  flight; ceil(516.35 / (0.8 x 113)) = ceil(5.71) = 6. Ratio 1:6.

Balanced (prompt 2,048 / 1,536, output 512 / 384, 20 req/s, TTFT 800 ms, ITL 40 ms, context 8,192):
  B = (22,039 - 512) // 160 + 1 = 135. mu = 494.5e12 / 14,496,417,280 = 34,111.9 tokens/s.
  TTFT without a queue = 60.04 + 12.08 + (16,381,470,720 + 135 x 2,560 x 147,456) / 2.68e12 =
  25.13 ms = 97.25 ms; rho = 0.8 (the slack allows 0.97). Prefill = ceil(20 x 1,536 / (0.8 x
  34,111.9)) = ceil(1.13) = 2. Decode: 20 x 384 x 25.13 ms = 192.98; ceil(192.98 / (0.8 x 135))
  = ceil(1.79) = 2. Ratio 2:2.
"""

from __future__ import annotations

import pytest

from kvpilot.operator.planner import PlanRequest
from kvpilot.operator.planner.pools import plan_pools
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.spec_to_plan import plan_service

MS = 1e-3

# name -> (spec.slo, hand figures: B, mu, prefill, transfer, decode step, TTFT no queue (s),
#          rho, in flight, prefill replicas, decode replicas)
CASES = {
    "rag-prefill-heavy": (
        {"maxContext": 16384, "p95PromptTokens": 8192, "p50PromptTokens": 6144, "p95OutputTokens": 256,
         "p50OutputTokens": 128, "requestsPerSecond": 20, "ttftP95Ms": 500, "itlP95Ms": 50},
        (40, 30_322.7, 270.16 * MS, 48.32 * MS, 24.71 * MS, 343.18 * MS, 0.6075, 63.25, 7, 2)),
    "chat-decode-heavy": (
        {"maxContext": 8192, "p95PromptTokens": 1024, "p50PromptTokens": 512, "p95OutputTokens": 2048,
         "p50OutputTokens": 1024, "requestsPerSecond": 20, "ttftP95Ms": 500, "itlP95Ms": 30},
        (113, 34_836.1, 29.39 * MS, 6.04 * MS, 25.21 * MS, 60.65 * MS, 0.8, 516.35, 1, 6)),
    "balanced": (
        {"maxContext": 8192, "p95PromptTokens": 2048, "p50PromptTokens": 1536, "p95OutputTokens": 512,
         "p50OutputTokens": 384, "requestsPerSecond": 20, "ttftP95Ms": 800, "itlP95Ms": 40},
        (135, 34_111.9, 60.04 * MS, 12.08 * MS, 25.13 * MS, 97.25 * MS, 0.8, 192.98, 2, 2)),
}
MAX_CONTEXT_BLOCKS = {16384: 1024, 8192: 512}


def _spec(slo: dict) -> dict:
    return {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "gpu": {"type": "h100-80gb"}, "slo": slo,
            "routing": {"router": "vllm-router"}, "disaggregation": {"prefill": {}, "decode": {}}}


def _request(slo: dict) -> PlanRequest:
    return PlanRequest.from_dict({"model": "qwen3-8b", "gpu": "h100-80gb", "slo": slo,
                                  "overrides": {"tensor_parallel_size": 1}})


@pytest.mark.parametrize("case", CASES)
def test_the_ratio_is_the_hand_worked_one(case):
    slo, (batch, mu, prefill_s, transfer_s, decode_s, ttft_s, rho, in_flight, n_prefill, n_decode) = CASES[case]
    pools = plan_pools(_request(slo))
    fig = pools.figures
    assert pools.feasible and pools.prefill.feasible and pools.decode.feasible
    # the decode batch is the KV formula's: one max_context sequence, the rest at p95 length
    seq_blocks = -(-(slo["p95PromptTokens"] + slo["p95OutputTokens"]) // 16)
    assert pools.decode.num_gpu_blocks == 22_039 and pools.decode.block_size == 16
    assert (22_039 - MAX_CONTEXT_BLOCKS[slo["maxContext"]]) // seq_blocks + 1 == batch == fig.decode_batch
    assert pools.decode.limits["kv_capacity"] == batch < pools.decode.limits["itl"]
    assert fig.chunk == pools.prefill.max_num_batched_tokens == 8192
    assert fig.tokens_per_s == pytest.approx(mu, rel=1e-5)
    for got, hand in ((fig.prefill_s, prefill_s), (fig.transfer_s, transfer_s), (fig.decode_step_s, decode_s),
                      (fig.ttft_s, ttft_s)):
        assert got == pytest.approx(hand, abs=0.006 * MS)     # the docstring's figures, to 0.01 ms
    assert fig.utilization == pytest.approx(rho, abs=5e-5)
    assert fig.in_flight == pytest.approx(in_flight, abs=0.006)
    assert (pools.prefill_replicas, pools.decode_replicas) == (n_prefill, n_decode)
    assert pools.ratio == f"{n_prefill}:{n_decode}"


def test_the_shapes_tilt_the_ratio_the_way_they_should():
    ratios = {case: plan_pools(_request(slo)) for case, (slo, _) in CASES.items()}
    rag, chat, balanced = (ratios[c] for c in CASES)
    assert rag.prefill_replicas > rag.decode_replicas            # long prompts, short answers
    assert chat.prefill_replicas < chat.decode_replicas          # short prompts, long answers
    assert balanced.prefill_replicas == balanced.decode_replicas
    assert rag.figures.utilization < 0.8 == chat.figures.utilization == balanced.figures.utilization


@pytest.mark.parametrize("case", CASES)
def test_the_ratio_and_its_derivation_reach_status(case):
    slo, (batch, _, _, _, _, ttft_s, _, _, n_prefill, n_decode) = CASES[case]
    outcome = plan_service(parse_spec(_spec(slo), "svc"))
    assert outcome.feasible, outcome.message
    status = outcome.sizing.status
    pools = status["disaggregation"]
    assert pools["ratio"] == f"{n_prefill}:{n_decode}" and f"prefill:decode {n_prefill}:{n_decode}" in outcome.message
    assert (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (n_prefill, n_decode)
    assert pools["decode"]["maxNumSeqs"] == status["maxNumSeqs"] == batch    # status.plan is the decode pool's
    assert pools["estimates"]["ttftP95NoQueueMs"] == pytest.approx(ttft_s / MS, abs=0.006)
    text = "\n".join(pools["derivation"])
    assert f"Ratio prefill:decode = {n_prefill}:{n_decode}." in text
    assert f"Prefill replicas = ceil(lambda x P50 {slo['p50PromptTokens']:,}" in text
    assert f"max_num_seqs B = {batch:,}" in text and f"= {ttft_s / MS:,.1f} ms." in text
    # each pool runs its role's KV transfer flag, after the planned flags
    assert pools["prefill"]["serveArgs"][-2:] == ["--kv-transfer-config",
                                                 '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}']
    assert status["serveArgs"][-1] == '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'


def test_an_unreachable_ttft_is_infeasible_with_the_figures():
    slo = {**CASES["rag-prefill-heavy"][0], "ttftP95Ms": 300}      # below the 343 ms without any queue
    pools = plan_pools(_request(slo))
    assert not pools.feasible and pools.binding_constraint == "ttft"
    assert "343 ms to the first token" in pools.binding_detail and "300 ms TTFT target" in pools.binding_detail
    outcome = plan_service(parse_spec(_spec(slo), "svc"))
    assert outcome.reason == "Infeasible" and outcome.sizing is None and "ttft" in outcome.message


def test_pinned_pools_keep_their_count_and_the_planned_one_is_reported():
    slo = CASES["chat-decode-heavy"][0]
    spec = {**_spec(slo), "disaggregation": {"prefill": {"replicas": 2},
                                             "decode": {"autoscaling": {"mode": "hpa", "minReplicas": 8,
                                                                        "maxReplicas": 12}}}}
    pools = plan_service(parse_spec(spec, "svc")).sizing.status["disaggregation"]
    assert (pools["prefill"]["replicas"], pools["prefill"]["plannedReplicas"]) == (2, 1)
    assert (pools["decode"]["replicas"], pools["decode"]["plannedReplicas"]) == (8, 6)   # the autoscaler's floor
    assert pools["ratio"] == "1:6"


def test_a_rate_is_derived_from_concurrency_when_none_is_given():
    slo = {**CASES["chat-decode-heavy"][0], "concurrency": 400}
    del slo["requestsPerSecond"]
    fig = plan_pools(_request(slo)).figures
    # lambda = concurrency / (O50 x t_decode): each sequence holds a slot for O50 decode steps
    assert fig.arrival_rps == pytest.approx(400 / (1024 * fig.decode_step_s))
    assert fig.arrival_source == "concurrency / (O50 x t_decode)" and fig.in_flight == pytest.approx(400)
