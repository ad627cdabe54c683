"""``python -m kvpilot.operator.planner.calibration``: the replay table and the fit."""

from __future__ import annotations

from kvpilot.operator.planner import reserve
from kvpilot.operator.planner.calibration.cases import DATA_FILE, load_cases
from kvpilot.operator.planner.calibration.fit import fit_constants, measured_terms
from kvpilot.operator.planner.calibration.replay import replay_all, table

MIB = 1 << 20


def main() -> None:
    cases = load_cases()
    replays = replay_all(cases)
    print(f"Replay of {DATA_FILE.name} with the shipped constants "
          f"(planned = with the {reserve.DEFAULT_KV_SAFETY_MARGIN:.1%} margin):")
    print(table(replays))
    measured = measured_terms(cases)
    fitted = fit_constants(replays)
    print("\nMeasured terms (shipped value in brackets):")
    print(f"  sampler bytes per logit      {measured.sampler_bytes_per_logit:.2f} "
          f"[{reserve.SAMPLER_BYTES_PER_LOGIT}]")
    print(f"  forward values per token     {measured.forward_slope:.3f} -> {measured.forward_values_per_token} "
          f"[{reserve.FORWARD_VALUES_PER_TOKEN}]")
    print(f"  CUDA graph pool TP 1 / TP>1  {measured.graph_bytes / MIB:,.0f} / {measured.graph_tp_bytes / MIB:,.0f} MiB "
          f"[{reserve.CUDA_GRAPH_BYTES / MIB:,.0f} / {reserve.CUDA_GRAPH_TP_BYTES / MIB:,.0f}]")
    print("Fitted terms:")
    print(f"  cuda_runtime                 {fitted.cuda_runtime_bytes / MIB:,.0f} MiB "
          f"[{reserve.CUDA_RUNTIME_BYTES / MIB:,.0f}]")
    print(f"  nccl                         {fitted.nccl_bytes / MIB:,.0f} MiB [{reserve.NCCL_BYTES / MIB:,.0f}]")
    print(f"  nccl per rank beyond two     {fitted.nccl_per_rank_bytes / MIB:,.0f} MiB "
          f"[{reserve.NCCL_PER_RANK_BYTES / MIB:,.0f}]")
    print(f"  kv_safety_margin             {fitted.kv_safety_margin:.1%} [{reserve.DEFAULT_KV_SAFETY_MARGIN:.1%}]")


if __name__ == "__main__":
    main()
