"""Where the reserve constants come from: measured terms and the grid fit.

Measured terms are computed from the figures the logs report for that term alone:

- ``SAMPLER_BYTES_PER_LOGIT``: the mean of ``activation / (max_num_seqs x vocab)`` over the
  cases whose peak the sampler set;
- ``FORWARD_VALUES_PER_TOKEN``: the least-squares slope of the reported activation peak
  against ``max_num_batched_tokens x (hidden + intermediate / TP) x dtype bytes`` over the
  cases whose peak the forward pass set, rounded up to a whole number;
- ``CUDA_GRAPH_BYTES`` / ``CUDA_GRAPH_TP_BYTES``: the largest graph pool logged at TP 1 / TP > 1.

The fitted terms, ``CUDA_RUNTIME_BYTES``, ``NCCL_BYTES`` and ``NCCL_PER_RANK_BYTES`` (the
TP-dependent share: ``nccl = NCCL_BYTES + NCCL_PER_RANK_BYTES x (TP - 2)`` at TP > 1), are
chosen on a grid (32, 64 and 32 MiB steps) to minimise the median absolute error of planned
vs reported KV capacity after the smallest safety margin (0.5% steps) that keeps every case
within +2%; medians within 0.25 points of the best count as equal, and among those the
smaller margin wins (more KV for every plan), then the smaller worst over-prediction before
the margin, then the smaller constants. The KV estimate is
linear in the constants, so each case is planned once and the grid only subtracts; the
smallest margin a case allows is solved for directly (``_Line.margin_needed``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvpilot.operator.planner.calibration.cases import GIB, Case
from kvpilot.operator.planner.calibration.replay import Replay
from kvpilot.operator.planner.plan_request import model_from_dict
from kvpilot.operator.planner.reserve import nccl_reserve_bytes

MIB = 1 << 20
MAX_OVER_PREDICTION = 0.02
MARGIN_STEP = 0.005
MAX_MARGIN = 0.10
MEDIAN_TOLERANCE = 0.0025                    # medians this close count as equal
RUNTIME_GRID = range(0, 1024 + 1, 32)        # MiB
NCCL_GRID = range(0, 2048 + 1, 64)           # MiB
NCCL_PER_RANK_GRID = range(0, 1024 + 1, 32)  # MiB


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
    """One case's KV tokens as a function of the fitted constants and the margin."""

    base_bytes: int           # the estimate with the fitted constants at 0
    tp: int
    bytes_per_block: int
    block_size: int
    reported_tokens: int

    def estimate(self, runtime: int, nccl: int, per_rank: int) -> int:
        return self.base_bytes - runtime - nccl_reserve_bytes(self.tp, nccl, per_rank)

    def ratio(self, runtime: int, nccl: int, per_rank: int, margin: float) -> float:
        estimate = self.estimate(runtime, nccl, per_rank)
        kv = int(estimate * (1 - margin)) if estimate > 0 else 0
        return kv // self.bytes_per_block * self.block_size / self.reported_tokens

    def margin_needed(self, runtime: int, nccl: int, per_rank: int) -> float:
        """The smallest margin step that keeps this case within +MAX_OVER_PREDICTION."""
        estimate = self.estimate(runtime, nccl, per_rank)
        allowed = math.floor((1 + MAX_OVER_PREDICTION) * self.reported_tokens / self.block_size)
        if estimate <= 0 or estimate < (allowed + 1) * self.bytes_per_block:
            return 0.0
        # int(estimate x (1 - m)) < (allowed + 1) x bytes_per_block
        m = 1 - (allowed + 1) * self.bytes_per_block / estimate
        step = math.floor(m / MARGIN_STEP + 1e-9) + 1
        while step > 0 and self.ratio(runtime, nccl, per_rank, round((step - 1) * MARGIN_STEP, 4)) \
                <= 1 + MAX_OVER_PREDICTION:
            step -= 1
        return round(step * MARGIN_STEP, 4)


def _line(replay: Replay) -> _Line:
    m = replay.estimate.memory
    base = m["kv_estimate_bytes"] + m["reserve_cuda_runtime_bytes"] + m["reserve_nccl_bytes"]
    return _Line(base, replay.case.tensor_parallel_size, m["bytes_per_block"], replay.estimate.block_size,
                 replay.reported_tokens)


@dataclass(frozen=True, slots=True)
class FittedTerms:
    cuda_runtime_bytes: int
    nccl_bytes: int
    nccl_per_rank_bytes: int
    kv_safety_margin: float
    median_abs_error_after_margin: float


def fit_constants(replays: list[Replay]) -> FittedTerms:
    """The grid fit of the module docstring over the replayed cases."""
    lines = [_line(r) for r in replays]
    found = []
    for runtime_mib in RUNTIME_GRID:
        for nccl_mib in NCCL_GRID:
            for rank_mib in NCCL_PER_RANK_GRID:
                runtime, nccl, per_rank = runtime_mib * MIB, nccl_mib * MIB, rank_mib * MIB
                margin = max(line.margin_needed(runtime, nccl, per_rank) for line in lines)
                if margin > MAX_MARGIN:
                    continue
                median = statistics.median(abs(line.ratio(runtime, nccl, per_rank, margin) - 1)
                                           for line in lines)
                worst = max(line.ratio(runtime, nccl, per_rank, 0.0) for line in lines)
                found.append((median, margin, worst, runtime + nccl + per_rank, runtime, nccl,
                              FittedTerms(runtime, nccl, per_rank, margin, median)))
    if not found:
        raise ValueError(f"no constants on the grid keep every case within +{MAX_OVER_PREDICTION:.0%} "
                         f"with a margin up to {MAX_MARGIN:.0%}")
    # medians within MEDIAN_TOLERANCE of the best are equally good: the smaller margin wins
    best = min(f[0] for f in found)
    near = [f for f in found if f[0] <= best + MEDIAN_TOLERANCE]
    return min(near, key=lambda f: (f[1], round(f[2], 6), f[3], f[4], f[5]))[-1]
