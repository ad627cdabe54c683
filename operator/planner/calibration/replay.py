"""Replay the calibration cases through the planner: planned / reported KV capacity.

Each case becomes the ``PlanRequest`` of the engine that logged it (model, GPU from the
catalogue, TP, utilization, max_num_batched_tokens, max_num_seqs pinned) and is planned
twice: with no safety margin (the calibrated estimate) and with the default margin (what
the operator would pin). The ratio compares the plan's KV token capacity with what vLLM
allocated; above 1 is an over-prediction, the dangerous side.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvpilot.operator.planner.calibration.cases import Case, load_cases
from kvpilot.operator.planner.plan import solve
from kvpilot.operator.planner.plan_request import PlanRequest
from kvpilot.operator.planner.reserve import FitSummary
from kvpilot.operator.planner.result import Plan


@dataclass(frozen=True, slots=True)
class Replay:
    """One case planned without and with the safety margin."""

    case: Case
    reported_tokens: int
    estimate: Plan            # kv_safety_margin 0
    planned: Plan             # the default margin

    @property
    def ratio_before_margin(self) -> float:
        return self.estimate.kv_token_capacity / self.reported_tokens

    @property
    def ratio(self) -> float:
        return self.planned.kv_token_capacity / self.reported_tokens


def replay_case(case: Case) -> Replay:
    estimate = solve(PlanRequest.from_dict(case.plan_request(kv_safety_margin=0.0)))
    planned = solve(PlanRequest.from_dict(case.plan_request()))
    return Replay(case, case.reported_tokens(estimate.memory["bytes_per_block"]), estimate, planned)


def replay_all(cases: tuple[Case, ...] | None = None) -> list[Replay]:
    return [replay_case(c) for c in (cases if cases is not None else load_cases())]


def summarize(ratios_before: list[float], ratios_after: list[float]) -> FitSummary:
    """Median absolute error and worst over-prediction, before and after the margin."""

    def stats(ratios: list[float]) -> tuple[float, float]:
        return statistics.median(abs(r - 1) for r in ratios), max(r - 1 for r in ratios)

    before, after = stats(ratios_before), stats(ratios_after)
    return FitSummary(len(ratios_before), *before, *after)


def summary(replays: list[Replay]) -> FitSummary:
    return summarize([r.ratio_before_margin for r in replays], [r.ratio for r in replays])


def table(replays: list[Replay]) -> str:
    """A plain-text table: one row per case, then the summary."""
    head = (f"{'case':<42} {'GPU':<10} {'TP':>2} {'util':>5} {'reported':>10} {'estimate':>10} "
            f"{'ratio':>6} {'planned':>10} {'ratio':>6}")
    rows = [head, "-" * len(head)]
    for r in replays:
        c = r.case
        rows.append(f"{c.id:<42} {c.gpu:<10} {c.tensor_parallel_size:>2} {c.gpu_memory_utilization:>5.2f} "
                    f"{r.reported_tokens:>10,} {r.estimate.kv_token_capacity:>10,} {r.ratio_before_margin:>6.3f} "
                    f"{r.planned.kv_token_capacity:>10,} {r.ratio:>6.3f}")
    s = summary(replays)
    rows.append(f"{s.cases} cases; before the margin: median |error| {s.median_abs_error:.1%}, worst "
                f"over-prediction {s.worst_over_prediction:+.1%}; after it: {s.median_abs_error_after_margin:.1%}, "
                f"{s.worst_over_prediction_after_margin:+.1%}")
    return "\n".join(rows)
