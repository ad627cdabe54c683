"""Where the reserve constants come from: measured terms and the grid fit.

Measured terms are computed from the figures the logs report for that term alone:

- ``SAMPLER_BYTES_PER_LOGIT``: the mean of ``activation / (max_num_seqs x vocab)`` over the
  cases whose peak the sampler set;
- ``FORWARD_VALUES_PER_TOKEN``: the least-squares slope of the reported activation peak
  against ``max_num_batched_tokens x (hidden + intermediate / TP) x dtype bytes`` over the
  cases whose peak the forward pass set, rounded up to a whole number;
- ``CUDA_GRAPH_BYTES`` / ``CUDA_GRAPH_TP_BYTES``: the largest graph pool logged at TP 1 / TP > 1.

The fitted terms, ``CUDA_RUNTIME_BYTES`` and ``NCCL_BYTES``, are chosen on a grid (16 MiB and
32 MiB steps) to minimise the median absolute error of planned vs reported KV capacity
after the smallest safety margin (0.5% steps) that keeps every case within +2%; ties go to
the smaller margin, then to the smaller constants. The KV estimate is linear in both
constants, so each case is planned once and the grid only subtracts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvpilot.operator.planner.calibration.cases import GIB, Case
from kvpilot.operator.planner.calibration.replay import Replay
from kvpilot.operator.planner.plan_request import model_from_dict

MIB = 1 << 20
MAX_OVER_PREDICTION = 0.02
MARGIN_STEP = 0.005
MAX_MARGIN = 0.10
RUNTIME_GRID = range(0, 1024 + 1, 16)        # MiB
NCCL_GRID = range(0, 2048 + 1, 32)           # MiB


@dataclass(frozen=True, slots=True)
class MeasuredTerms:
    sampler_bytes_per_logit: float
    forward_slope: float                      # values per token x (hidden + intermediate / TP)
    graph_bytes: int                          # largest pool at TP 1
    graph_tp_bytes: int                       # ... at TP > 1

    @property
    def forward_values_per_token(self) -> int:
        return math.ceil(self.forward_slope)


def measured_terms(cases: tuple[Case, ...]) -> MeasuredTerms:
    per_logit, xs, ys = [], [], []
    for case in cases:
        activation = case.reported.get("activation_gib")
        if activation is None or case.activation_peak is None:
            continue
        model = model_from_dict(case.model)
        if case.activation_peak == "sampler":
            per_logit.append(activation * GIB / (case.max_num_seqs * model.vocab_size))
        else:
            inter = math.ceil(model.intermediate_size / case.tensor_parallel_size)
            xs.append(case.max_num_batched_tokens * (model.hidden_size + inter) * model.dtype_bytes)
            ys.append(activation * GIB)
    slope = statistics.linear_regression(xs, ys).slope
    graphs = [(c.tensor_parallel_size > 1, c.reported["graph_gib"]) for c in cases if "graph_gib" in c.reported]
    return MeasuredTerms(statistics.fmean(per_logit), slope,
                         int(max(g for tp, g in graphs if not tp) * GIB),
                         int(max(g for tp, g in graphs if tp) * GIB))


@dataclass(frozen=True, slots=True)
class _Line:
    """One case's KV tokens as a function of the two fitted constants and the margin."""

    base_bytes: int           # the estimate with both fitted constants at 0
    tp: int
    bytes_per_block: int
    block_size: int
    reported_tokens: int

    def ratio(self, runtime: int, nccl: int, margin: float) -> float:
        estimate = self.base_bytes - runtime - (nccl if self.tp > 1 else 0)
        kv = int(estimate * (1 - margin)) if estimate > 0 else 0
        return kv // self.bytes_per_block * self.block_size / self.reported_tokens


def _line(replay: Replay) -> _Line:
    m = replay.estimate.memory
    base = m["kv_estimate_bytes"] + m["reserve_cuda_runtime_bytes"] + m["reserve_nccl_bytes"]
    return _Line(base, replay.case.tensor_parallel_size, m["bytes_per_block"], replay.estimate.block_size,
                 replay.reported_tokens)


@dataclass(frozen=True, slots=True)
class FittedTerms:
    cuda_runtime_bytes: int
    nccl_bytes: int
    kv_safety_margin: float
    median_abs_error_after_margin: float


def _margin_for(lines: list[_Line], runtime: int, nccl: int) -> float | None:
    steps = round(MAX_MARGIN / MARGIN_STEP)
    for i in range(steps + 1):
        margin = round(i * MARGIN_STEP, 4)
        if all(line.ratio(runtime, nccl, margin) <= 1 + MAX_OVER_PREDICTION for line in lines):
            return margin
    return None


def fit_constants(replays: list[Replay]) -> FittedTerms:
    """The grid fit of the module docstring over the replayed cases."""
    lines = [_line(r) for r in replays]
    best: tuple | None = None
    for runtime_mib in RUNTIME_GRID:
        for nccl_mib in NCCL_GRID:
            runtime, nccl = runtime_mib * MIB, nccl_mib * MIB
            margin = _margin_for(lines, runtime, nccl)
            if margin is None:
                continue
            median = statistics.median(abs(line.ratio(runtime, nccl, margin) - 1) for line in lines)
            key = (round(median, 6), margin, runtime + nccl, runtime)
            if best is None or key < best[0]:
                best = (key, FittedTerms(runtime, nccl, margin, median))
    if best is None:
        raise ValueError(f"no constants on the grid keep every case within +{MAX_OVER_PREDICTION:.0%} "
                         f"with a margin up to {MAX_MARGIN:.0%}")
    return best[1]
