"""The reserve: what one GPU holds besides the weights and the KV cache, term by term.

An engine sizes its KV cache at start-up as ``gpu_memory_utilization x CUDA total -
weights - reserve``, the reserve being what its profile of one worst-case step measured
(vLLM and kvpilot both do this, from a baseline taken when the engine starts, so the
CUDA context and other processes' memory lie outside the budget). The planner predicts
the reserve from named terms whose constants come from public vLLM start-up logs
(``calibration/vllm_startup_logs.yaml``; ``python -m kvpilot.operator.planner.calibration``
prints the replay and the fit):

- ``cuda_runtime``: non-torch memory the engine adds after it starts (cuBLAS and
  attention workspaces, kernel modules) and the slack of loading weights. Fitted.
- ``nccl``: communicator and all-reduce buffers, only when TP > 1: a base for the first
  peer and a share for each further rank (NCCL keeps buffers per peer and channel, the
  custom all-reduce registers an IPC buffer per peer), ``NCCL_BYTES + NCCL_PER_RANK_BYTES x
  (TP - 2)``. Both fitted; the per-rank share is what the TP 8 logs add over TP 2.
- activation peak = max(``forward``, ``sampler``): the profile step's torch peak.
  The forward pass of ``max_num_batched_tokens`` tokens holds about
  ``3 x (hidden + intermediate / TP)`` values per token (the MLP's gate+up output and its
  activated product; the residual stream, normed input and attention output); the 3 is
  the slope of vLLM's reported peak between two RTX 3090 logs (+0.92 GiB for 9,000 more
  tokens of Llama-3.1-8B). The sampler holds float32 logits, probabilities and sort
  buffers for ``max_num_seqs`` rows: ``SAMPLER_BYTES_PER_LOGIT`` per row and vocabulary
  entry, the mean of the logs where vLLM's reported peak is the sampler's. The two
  happen one after the other in a step, so the peak is the larger, not the sum.
- ``cuda_graphs``: the graph pool when the engine captures CUDA graphs (the largest
  pool in the logs). kvpilot serve captures none yet, so it is off unless asked for.

The fit chooses ``cuda_runtime`` and the two ``nccl`` constants (the terms vLLM's logs report least
consistently across versions) to minimise the median absolute error of planned vs
reported KV capacity after the smallest safety margin that keeps every case within +2%
(``calibration.fit``); the other constants are measured terms, computed from the logs'
own figures. ``FIT`` records the replay's errors, which the derivation states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator.planner.model_spec import ModelSpec

GIB = 1 << 30
MIB = 1 << 20

CALIBRATION_FILE = "operator/planner/calibration/vllm_startup_logs.yaml"

# Fitted on the replay (calibration.fit); see the module docstring.
CUDA_RUNTIME_BYTES = 288 * MIB
NCCL_BYTES = 256 * MIB
NCCL_PER_RANK_BYTES = 0 * MIB         # each rank beyond the second
# Measured terms (calibration.measured_terms recomputes them from the logs).
FORWARD_VALUES_PER_TOKEN = 3          # x (hidden + intermediate / TP)
SAMPLER_BYTES_PER_LOGIT = 39.6        # per sampled row and vocabulary entry
CUDA_GRAPH_BYTES = int(0.50 * GIB)    # largest graph pool at TP 1 in the logs
CUDA_GRAPH_TP_BYTES = int(0.65 * GIB)  # ... and at TP > 1
# kvpilot serve captures no CUDA graphs yet (the engine-speed work adds them).
ENGINE_CUDA_GRAPHS = False
# Plan this fraction below the calibrated KV estimate.
DEFAULT_KV_SAFETY_MARGIN = 0.03


@dataclass(frozen=True, slots=True)
class FitSummary:
    """How the calibrated model did on the public cases (planned / reported KV tokens)."""

    cases: int
    median_abs_error: float            # before the safety margin
    worst_over_prediction: float       # largest planned / reported - 1, before the margin
    median_abs_error_after_margin: float
    worst_over_prediction_after_margin: float


FIT = FitSummary(cases=20, median_abs_error=0.029, worst_over_prediction=0.051,
                 median_abs_error_after_margin=0.047, worst_over_prediction_after_margin=0.019)


@dataclass(frozen=True, slots=True)
class ReserveTerm:
    """One named part of the reserve: bytes, how they were computed, and where the
    constant comes from."""

    name: str
    num_bytes: int
    formula: str
    source: str


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


@dataclass(frozen=True, slots=True)
class Reserve:
    """Per-GPU memory kept outside weights and KV (see module docstring)."""

    cuda_runtime: ReserveTerm
    nccl: ReserveTerm
    forward: ReserveTerm
    sampler: ReserveTerm
    cuda_graphs: ReserveTerm

    @property
    def activation_bytes(self) -> int:
        """The profile step's peak: the larger of the forward pass and the sampler."""
        return max(self.forward.num_bytes, self.sampler.num_bytes)

    @property
    def activation_term(self) -> ReserveTerm:
        return self.forward if self.forward.num_bytes >= self.sampler.num_bytes else self.sampler

    @property
    def counted(self) -> tuple[ReserveTerm, ...]:
        """The terms that add up to the total (the activation peak once)."""
        return self.cuda_runtime, self.nccl, self.activation_term, self.cuda_graphs

    @property
    def total_bytes(self) -> int:
        return sum(t.num_bytes for t in self.counted)

    @property
    def dominant(self) -> ReserveTerm:
        return max(self.counted, key=lambda t: t.num_bytes)

    def to_bytes(self) -> dict[str, int]:
        """Every term's bytes (the forward and sampler both, though only the larger counts)."""
        return {f"reserve_{t.name}_bytes": t.num_bytes
                for t in (self.cuda_runtime, self.nccl, self.forward, self.sampler, self.cuda_graphs)}


def nccl_reserve_bytes(tp: int, base: int = NCCL_BYTES, per_rank: int = NCCL_PER_RANK_BYTES) -> int:
    """The ``nccl`` term at ``tp`` GPUs (0 on one GPU)."""
    return base + per_rank * (tp - 2) if tp > 1 else 0


def reserve(model: ModelSpec, tp: int, activation_tokens: int, sampled_seqs: int,
            cuda_graphs: bool = ENGINE_CUDA_GRAPHS, samples: bool = True) -> Reserve:
    """The reserve for ``activation_tokens`` per step and ``sampled_seqs`` sampled rows;
    ``samples`` false for a pipeline stage other than the last (no LM head, no sampler)."""
    fitted = f"fitted on the public vLLM logs in {CALIBRATION_FILE}"
    runtime = ReserveTerm("cuda_runtime", CUDA_RUNTIME_BYTES, _gib(CUDA_RUNTIME_BYTES),
                          f"non-torch memory and weight-load slack, {fitted}")
    nccl_bytes = nccl_reserve_bytes(tp)
    formula = (f"{_gib(NCCL_BYTES)} + {NCCL_PER_RANK_BYTES / MIB:,.0f} MiB x ({tp} - 2) further ranks = "
               f"{_gib(nccl_bytes)}" if tp > 2 else _gib(nccl_bytes) if tp > 1 else "0 (one GPU)")
    nccl = ReserveTerm("nccl", nccl_bytes, formula, f"NCCL and custom all-reduce buffers at TP > 1, {fitted}")
    inter = math.ceil(model.intermediate_size / tp)
    fwd_bytes = activation_tokens * FORWARD_VALUES_PER_TOKEN * (model.hidden_size + inter) * model.dtype_bytes
    forward = ReserveTerm(
        "forward", fwd_bytes,
        f"{activation_tokens:,} tokens x {FORWARD_VALUES_PER_TOKEN} x ({model.hidden_size:,} hidden + "
        f"{inter:,} intermediate/TP) x {model.dtype_bytes} B = {_gib(fwd_bytes)}",
        "slope of vLLM's reported activation peak over max_num_batched_tokens (RTX 3090 logs)")
    sampler_bytes = math.ceil(sampled_seqs * model.vocab_size * SAMPLER_BYTES_PER_LOGIT) if samples else 0
    sampler = ReserveTerm(
        "sampler", sampler_bytes,
        f"{sampled_seqs:,} seqs x {model.vocab_size:,} vocab x {SAMPLER_BYTES_PER_LOGIT:g} B = "
        f"{_gib(sampler_bytes)}" if samples else "0 (not the last pipeline stage: no sampler)",
        "mean of vLLM's reported activation peaks per sampled row and vocabulary entry "
        "where the sampler sets the peak (H100 logs)")
    graph_bytes = (CUDA_GRAPH_TP_BYTES if tp > 1 else CUDA_GRAPH_BYTES) if cuda_graphs else 0
    graphs = ReserveTerm("cuda_graphs", graph_bytes,
                         _gib(graph_bytes) if cuda_graphs else "0 (no CUDA graphs)",
                         "largest graph pool in the logs ('Graph capturing finished ... took')"
                         if cuda_graphs else "kvpilot serve captures no CUDA graphs")
    return Reserve(runtime, nccl, forward, sampler, graphs)
