"""One step's forward pass on a single device: the model over the step's tokens, then the
logits of its sampling rows (tensor parallelism happens inside the model's layers).

Pipeline parallelism has its own executor with the same two calls
(``parallel.pipeline_forward.PipelineForward``); the runner picks one when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpilot.engine.model.attention import AttentionBackend
    from kvpilot.engine.model.cuda_graphs import DecodeGraphs
    from kvpilot.engine.model.step_inputs import StepInputs


class LocalForward:
    """The whole model on this device."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend

    def step(self, step: StepInputs, kv_caches, metadata, graphs: DecodeGraphs | None,
             calibrate: bool) -> torch.Tensor | None:
        """The logits of ``step``'s sampling rows (None if it samples nothing); a padded
        decode step replays its captured CUDA graph."""
        if step.padded_size is not None:
            hidden = graphs.run(step, step.padded_size)
        else:
            hidden = self.model(step.input_ids, step.positions, kv_caches, metadata, self.backend)
        if step.logits_indices.shape[0] == 0:
            return None
        return self.model.compute_logits(hidden[step.logits_indices])

    def rows(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, metadata,
             rows: torch.Tensor) -> torch.Tensor | None:
        """The logits of the hidden rows ``rows`` (repeats allowed) after a forward pass over
        the given tokens: the memory profile's worst case."""
        hidden = self.model(input_ids, positions, kv_caches, metadata, self.backend)
        return self.model.compute_logits(hidden[rows % hidden.shape[0]])
