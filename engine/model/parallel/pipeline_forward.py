"""One step's forward pass through the pipeline's stages (``runner.LocalForward``'s counterpart).

Every rank of the pipeline runs it for the same step: a stage after the first takes its
input from the previous stage, a stage before the last sends its output on, the last
stage's first rank sends the logits to the driver, which samples. With microbatches
(``num_microbatches`` > 1) a step of several requests goes through the stages in pieces
(``microbatch.pipelined_forward``); a step of one request, or a calibrating step, does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvpilot.engine.model.parallel.microbatch import pipelined_forward

if TYPE_CHECKING:
    from kvpilot.engine.model.attention import AttentionBackend
    from kvpilot.engine.model.parallel.pipeline import PipelineGroup
    from kvpilot.engine.model.step_inputs import StepInputs


class PipelineForward:
    """This rank's stage of the model, and how it talks to the other stages."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pp: PipelineGroup,
                 dtype: torch.dtype, device: torch.device, num_microbatches: int) -> None:
        self.model = model
        self.backend = backend
        self.pp = pp
        self.dtype = dtype
        self.device = device
        self.num_microbatches = num_microbatches
        self.hidden_size = model.cfg.hidden_size
        self.vocab_size = model.cfg.vocab_size

    def step(self, step: StepInputs, kv_caches, metadata, graphs, calibrate: bool) -> torch.Tensor | None:
        """The step's logits on the driver, else None (``graphs``: never captured here)."""
        num_logits = step.logits_indices.shape[0]
        if self.num_microbatches > 1 and len(step.metadata.query_lens_cpu) > 1 and not calibrate:
            return pipelined_forward(self, step, kv_caches, self.num_microbatches)
        return self._run(step.input_ids, step.positions, kv_caches, metadata, step.logits_indices,
                         num_logits)

    def rows(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, metadata,
             rows: torch.Tensor) -> torch.Tensor | None:
        """The profile's logits rows (see ``LocalForward.rows``), on the driver."""
        return self._run(input_ids, positions, kv_caches, metadata, rows, rows.shape[0], wrap=True)

    def _run(self, input_ids, positions, kv_caches, metadata, logits_indices, num_logits,
             wrap: bool = False) -> torch.Tensor | None:
        pp = self.pp
        intermediate = None
        if not pp.is_first:
            intermediate = pp.recv_prev(input_ids.shape[0], self.hidden_size, self.dtype, self.device)
        out = self.model(input_ids, positions, kv_caches, metadata, self.backend,
                         intermediate=intermediate)
        if not pp.is_last:
            pp.send_next(*out)
            if pp.is_driver and num_logits:
                return pp.recv_logits(num_logits, self.vocab_size, self.device)
            return None
        if num_logits == 0:
            return None
        rows = logits_indices % out.shape[0] if wrap else logits_indices
        logits = self.model.compute_logits(out[rows], metadata)
        if logits is not None:   # the last stage's first rank; the driver is on stage 0
            pp.send_logits(logits)
        return None
