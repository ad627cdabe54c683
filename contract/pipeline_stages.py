"""Pipeline stages: which decoder layers each stage holds, and where a rank sits (torch-free).

One rule for the engine and the planner (``operator/planner/stages.py``): the layers are
split as vLLM splits them (``vllm.distributed.utils.get_pp_indices``), ``num_layers // PP``
each, the remainder one extra layer apiece to the stages just before the last (the last
stage holds the final norm, the LM head and computes the logits; the first the embedding).

Ranks: a replica of ``PP`` stages of ``TP`` ranks has ``TP x PP`` ranks, numbered
``rank = stage * TP + tp_rank``: the ranks of one stage are consecutive (one node, or one
LeaderWorkerSet pod, per stage), rank 0 (the driver) is stage 0's first rank.
"""

from __future__ import annotations

from dataclasses import dataclass


def layer_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, vLLM's partition (``get_pp_indices``)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} must be in [1, {num_layers}] (the model's layers)")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class StageLayers:
    """The decoder layers ``[first_layer, end_layer)`` of stage ``stage`` of ``num_stages``."""

    stage: int = 0
    num_stages: int = 1
    first_layer: int = 0
    end_layer: int | None = None      # None: to the model's last layer (one stage)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        return range(self.first_layer, num_layers if self.end_layer is None else self.end_layer)


def stage_layers(num_layers: int, pp: int, stage: int) -> StageLayers:
    """Stage ``stage``'s layers under ``layer_split``."""
    split = layer_split(num_layers, pp)
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} must be in [0, {pp})")
    first = sum(split[:stage])
    return StageLayers(stage, pp, first, first + split[stage])


def stage_of_rank(rank: int, tp: int) -> tuple[int, int]:
    """``(stage, tp_rank)`` of global ``rank`` (``rank = stage * tp + tp_rank``)."""
    return divmod(rank, tp)
