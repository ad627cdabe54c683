"""Planned vs observed KV capacity: ``status.observed`` and the ``SizingDrift`` condition.

Pure: from ``status.plan`` and the engines' samples (``engine_observer``). Two comparisons:

- **blocks**: each engine's ``num_gpu_blocks`` against the plan's. While the operator pins
  ``--kv-cache-memory-bytes`` they are equal by construction, so a difference means the
  engine did not run what it was told (another image, extra flags, a KV budget cut at
  start-up);
- **profiled memory**: where an engine exports what start-up profiling left for its KV
  cache (``kvpilot:kv_cache_profiled_available_bytes``, on GPUs), that figure against the
  planner's estimate of it (``status.plan.kvEstimateBytes``): this is what drifts when the
  GPU really had less (or more) memory than planned.

``SizingDrift`` is True when either comparison is off by more than the threshold (default
2 %). ``status.observed`` describes one pod, the one furthest from the plan on the
comparison that decides (``comparedOn``): the blocks when they drift, else the profiled
memory where engines export it, else the blocks; ``relativeError`` is observed / planned - 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.engine_observer import EngineSample
from kvpilot.operator.status import Condition

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class SizingObservation:
    """What one pass found.

    Args:
        observed: ``status.observed`` (None: nothing observed; the key is removed).
        condition: the ``SizingDrift`` condition.
        planned_blocks / observed_blocks: for the operator's gauges (None: unknown).
        unread: engine pods running the plan whose figures are not read yet (a later pass).
    """

    observed: dict[str, Any] | None
    condition: Condition
    planned_blocks: int | None = None
    observed_blocks: int | None = None
    unread: int = 0


def _error(observed: float, planned: float) -> float:
    return observed / planned - 1.0


def _worst(samples: Sequence[EngineSample], error) -> tuple[EngineSample, float]:
    return max(((s, error(s)) for s in samples), key=lambda pair: abs(pair[1]))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _pct(error: float) -> str:
    return f"{round(error, 4) + 0.0:+.1%}"  # no "-0.0%"


def _as_planned(samples: Sequence[EngineSample], planned: int, block_error: float, memory: str,
                limit: str) -> Condition:
    blocks = sorted({s.cache.num_gpu_blocks for s in samples})
    return Condition(c.SIZING_DRIFT, "False", "AsPlanned",
                     f"{len(samples)} engine pod(s) report {'/'.join(f'{b:,}' for b in blocks)} KV blocks, "
                     f"the plan {planned:,} ({_pct(block_error)}{memory}; {limit})")


def _blocks_differ(pod: EngineSample, error: float, planned: int, plan: Mapping[str, Any],
                   limit: str) -> Condition:
    cache = pod.cache
    planned_tokens = planned * (plan.get("blockSize") or cache.block_size)
    return Condition(
        c.SIZING_DRIFT, "True", "BlocksDiffer",
        f"engine pod {pod.pod} reports {cache.num_gpu_blocks:,} KV blocks ({cache.token_capacity:,} tokens), "
        f"the plan {planned:,} ({planned_tokens:,} tokens): {_pct(error)} ({limit}). The engine did not "
        "allocate what it was told: a different engine image or extra flags, or a KV budget cut at "
        "start-up because the GPU had less free memory than planned (another process on it)")


def _profiled_differs(pod: EngineSample, error: float, estimate: int, limit: str) -> Condition:
    held = pod.cache.profiled_kv_bytes
    cause = ("the GPU had less memory for the KV cache than planned: more profiling headroom "
             "(activations, CUDA graphs, non-torch memory) than the planner reserves, another process "
             "on the GPU, or a different image" if error < 0 else
             "the GPU had more memory for the KV cache than planned: the plan leaves capacity unused "
             "(a different image or GPU variant)")
    return Condition(
        c.SIZING_DRIFT, "True", "ProfiledMemoryDiffers",
        f"on engine pod {pod.pod} start-up profiling left {_gib(held)} ({held:,} B) for the KV cache, the "
        f"plan expected {_gib(estimate)} ({estimate:,} B): {_pct(error)} ({limit}); {cause}")


def sizing_observation(plan: Mapping[str, Any] | None, samples: Sequence[EngineSample],
                       threshold: float) -> SizingObservation:
    """``status.observed`` and ``SizingDrift`` for ``samples`` against ``plan`` (``status.plan``).

    Args:
        plan: what the running pods were given (None: no plan yet).
        samples: the engines observed (pods running this plan).
        threshold: the largest relative error that is not drift (0.02 = 2 %).
    """
    planned = (plan or {}).get("numGpuBlocks")
    if not planned:
        return SizingObservation(None, Condition(c.SIZING_DRIFT, "Unknown", "NotPlanned",
                                                 "no plan to compare the engines with"))
    if not samples:
        return SizingObservation(None, Condition(c.SIZING_DRIFT, "Unknown", "NotObserved",
                                                 "no ready engine pod running this plan has been read yet"),
                                 planned_blocks=planned)
    block_pod, block_error = _worst(samples, lambda s: _error(s.cache.num_gpu_blocks, planned))
    estimate = plan.get("kvEstimateBytes")
    profiled = [s for s in samples if s.cache.profiled_kv_bytes is not None]
    limit = f"threshold {threshold:.0%}"
    if abs(block_error) > threshold or not (profiled and estimate):
        shown, compared_on, error = block_pod, "numGpuBlocks", block_error
        condition = (_blocks_differ(block_pod, block_error, planned, plan, limit)
                     if abs(block_error) > threshold else _as_planned(samples, planned, block_error, "", limit))
    else:
        shown, error = _worst(profiled, lambda s: _error(s.cache.profiled_kv_bytes, estimate))
        compared_on = "profiledKvBytes"
        condition = (_profiled_differs(shown, error, estimate, limit) if abs(error) > threshold else
                     _as_planned(samples, planned, block_error,
                                 f"; profiled KV memory {_pct(error)} against the plan's estimate", limit))
    cache = shown.cache
    observed: dict[str, Any] = {
        "pods": len(samples), "pod": shown.pod, "numGpuBlocks": cache.num_gpu_blocks,
        "blockSize": cache.block_size, "cacheDtype": cache.cache_dtype, "tokenCapacity": cache.token_capacity,
        "comparedOn": compared_on, "relativeError": round(error, 4) + 0.0,
    }
    if cache.profiled_kv_bytes is not None:
        observed["profiledKvBytes"] = cache.profiled_kv_bytes
    result = {"observed": observed, "planned_blocks": planned, "observed_blocks": block_pod.cache.num_gpu_blocks}
    return SizingObservation(condition=condition, **result)
