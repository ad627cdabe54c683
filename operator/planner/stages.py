"""Pipeline stages: which layers each node of a replica holds, and its weights per GPU.

A replica of ``PP`` pipeline stages runs ``TP`` GPUs per stage (tensor parallelism within
a node, pipeline parallelism across nodes). The layers are split as vLLM splits them
(``vllm.distributed.utils.get_pp_indices``; the engine's own rule,
``kvpilot.contract.pipeline_stages.layer_split``): ``num_layers // PP`` each, the remainder one
extra layer apiece to the stages just before the last (the last holds the LM head and the
sampler, the first the embedding). Weights per GPU of a stage:

    (its layers x bytes per layer + the embedding on the first stage
     + the LM head and final norm on the last stage) / TP

A tied LM head is the embedding matrix: with more than one stage the last stage holds its
own copy of it (vLLM loads the tied weight into the last stage's LM head). The bytes of
one layer are the checkpoint's bytes less the embedding and LM head, over the layers (the
final norm, ``hidden`` values, rides with them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.contract.pipeline_stages import layer_split
from kvpilot.operator.planner.model_spec import ModelSpec

__all__ = ["StageShape", "layer_split", "stage_shapes"]


@dataclass(frozen=True, slots=True)
class StageShape:
    """One pipeline stage's share of the model (per GPU of the stage)."""

    index: int
    first_layer: int
    num_layers: int
    weight_bytes: int          # per GPU
    embedding: bool            # holds the input embedding (first stage)
    lm_head: bool              # holds the LM head and samples (last stage)

    @property
    def role(self) -> str:
        parts = (["embedding"] if self.embedding else []) + (["LM head"] if self.lm_head else [])
        return " + ".join(parts) if parts else "layers only"


def stage_shapes(model: ModelSpec, weight_bytes_total: int, tp: int, pp: int) -> tuple[StageShape, ...]:
    """Every stage's layers and weights per GPU (see module docstring)."""
    split = layer_split(model.num_layers, pp)
    if pp == 1:
        return (StageShape(0, 0, model.num_layers, math.ceil(weight_bytes_total / tp), True, True),)
    matrix = model.vocab_size * model.hidden_size * model.dtype_bytes
    stored_head = 0 if model.tied_embeddings else matrix
    per_layer = max(0, weight_bytes_total - matrix - stored_head) / model.num_layers
    out, first = [], 0
    for i, layers in enumerate(split):
        head = i == pp - 1
        total = layers * per_layer + (matrix if i == 0 else 0) + (matrix if head else 0)
        out.append(StageShape(i, first, layers, math.ceil(total / tp), i == 0, head))
        first += layers
    return tuple(out)
