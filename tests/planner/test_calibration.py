"""The planner against public vLLM start-up logs (operator/planner/calibration/).

The oracle is what real engines allocated on real GPUs, copied with its source into
``vllm_startup_logs.yaml``: each case is planned as the operator would plan that engine
and the planned KV token capacity is compared with the reported one.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from kvpilot.operator.planner import reserve
from kvpilot.operator.planner.calibration.cases import GIB, load_cases
from kvpilot.operator.planner.calibration.fit import fit_constants, measured_terms
from kvpilot.operator.planner.calibration.replay import replay_all, summary, table
from kvpilot.operator.planner.gpu import get_gpu

ROOT = Path(__file__).resolve().parents[2]
# The four cases the calibration issue quotes (model, GPU, TP, utilization, context, what vLLM had).
ISSUE_CASES = {"rtx3090-llama-3.1-8b-20k": 1952 * 16, "a100-40gb-qwen3-14b": 42656,
               "a100-80gb-qwen2-7b-util0.50": 464848, "h100-llama-3.1-8b": None}


@pytest.fixture(scope="module")
def replays():
    return replay_all()


def test_replay_meets_the_calibration_targets(replays):
    print("\n" + table(replays))
    s = summary(replays)
    assert s.cases >= 14 and len({r.case.gpu for r in replays}) >= 5
    assert s.median_abs_error_after_margin <= 0.05
    for r in replays:
        assert r.ratio <= 1.02, f"{r.case.id} over-predicts by {r.ratio - 1:+.1%} after the margin"
        assert r.planned.kv_token_capacity <= r.estimate.kv_token_capacity


def test_the_issue_cases_are_replayed(replays):
    by_id = {r.case.id: r for r in replays}
    for case_id, tokens in ISSUE_CASES.items():
        assert case_id in by_id
        if tokens is not None:
            assert by_id[case_id].reported_tokens == tokens
    h100 = by_id["h100-llama-3.1-8b"]       # 51.38 GiB in 2 MiB blocks of 16 tokens
    assert h100.reported_tokens == int(51.38 * GIB) // (16 * 131072) * 16


def test_the_stated_fit_is_the_replays(replays):
    s = summary(replays)
    assert reserve.FIT.cases == s.cases
    for name in ("median_abs_error", "worst_over_prediction", "median_abs_error_after_margin",
                 "worst_over_prediction_after_margin"):
        assert getattr(reserve.FIT, name) == round(getattr(s, name), 3), name


def test_measured_terms_are_the_logs():
    terms = measured_terms(load_cases())
    assert round(terms.sampler_bytes_per_logit, 1) == reserve.SAMPLER_BYTES_PER_LOGIT
    assert terms.forward_values_per_token == reserve.FORWARD_VALUES_PER_TOKEN
    assert (terms.graph_bytes, terms.graph_tp_bytes) == (reserve.CUDA_GRAPH_BYTES, reserve.CUDA_GRAPH_TP_BYTES)


def test_fitted_terms_and_margin_are_the_fits(replays):
    fitted = fit_constants(replays)
    assert (fitted.cuda_runtime_bytes, fitted.nccl_bytes) == (reserve.CUDA_RUNTIME_BYTES, reserve.NCCL_BYTES)
    assert fitted.kv_safety_margin == reserve.DEFAULT_KV_SAFETY_MARGIN
    assert math.isclose(fitted.median_abs_error_after_margin, summary(replays).median_abs_error_after_margin)


def test_the_catalogue_never_exceeds_a_logged_cuda_total():
    for case in load_cases():
        logged = case.reported.get("cuda_total_gib")
        if logged is not None:
            assert get_gpu(case.gpu).memory_bytes <= logged * GIB, case.id


def test_every_case_names_its_source():
    text = (ROOT / reserve.CALIBRATION_FILE).read_text()
    assert text.count("- id: ") == len(load_cases())
    for case in load_cases():
        assert re.search(r"https://github\.com/\S+|llm-d/llm-d-benchmark \S+\.md", case.source), case.id
        assert {"kv_tokens", "kv_blocks", "kv_gib"} & set(case.reported), case.id
