"""Microbatches in flight through the pipeline stages (GPipe-style, within one step).

A step's batch is cut at request boundaries into ``M`` microbatches of about equal token
counts (``split_step``, run alike on every rank from the same step inputs, so nothing more
is sent). Every stage runs them in order and sends each one on without waiting for the
send to complete, so stage ``s`` works on microbatch ``i + 1`` while stage ``s + 1`` works
on microbatch ``i``: with ``P`` stages and ``M`` microbatches a step takes about
``(M + P - 1) / M`` stage-times instead of ``P``. The last stage's first TP rank sends each
microbatch's logits to the driver, which puts them back in the step's order (the logits
rows are ascending token indices, so microbatch order is row order) and samples once.

A request lies wholly in one microbatch, so its attention, its KV writes and its tokens
are those of the undivided step. A step of one request (or a calibration step) is not
cut. Schedulers' steps still run one after another (no step overlaps the next).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvpilot.engine.model.step_inputs import StepInputs
from kvpilot.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Microbatch:
    step: StepInputs          # this microbatch's inputs (token rows re-based to 0)
    num_logits: int           # sampling rows it holds


def request_bounds(query_lens: tuple[int, ...], num_microbatches: int) -> list[tuple[int, int]]:
    """``(first, end)`` request ranges of up to ``num_microbatches`` non-empty parts whose
    token counts are as even as request boundaries allow."""
    n = len(query_lens)
    m = max(1, min(num_microbatches, n))
    cum = list(itertools.accumulate(query_lens, initial=0))
    total = cum[-1]
    cuts = [0]
    for i in range(1, m):
        target = total * i / m
        lo = cuts[-1] + 1                      # each part keeps one request at least
        hi = n - (m - i)
        cuts.append(min(range(lo, hi + 1), key=lambda k: abs(cum[k] - target)))
    cuts.append(n)
    return list(itertools.pairwise(cuts))


def _slice_metadata(meta: AttentionMetadata, a: int, b: int, t0: int, t1: int) -> AttentionMetadata:
    seq_lens = meta.seq_lens_cpu[a:b]
    query_lens = meta.query_lens_cpu[a:b]
    return AttentionMetadata(
        num_actual_tokens=t1 - t0,
        query_start_loc=meta.query_start_loc[a:b + 1] - t0,
        seq_lens=meta.seq_lens[a:b],
        block_tables=meta.block_tables[a:b],
        slot_mapping=meta.slot_mapping[t0:t1],
        max_query_len=max(query_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        computes_prompt=meta.computes_prompt,
    )


def split_step(step: StepInputs, num_microbatches: int) -> list[Microbatch]:
    """``step`` cut into microbatches at request boundaries (see the module docstring)."""
    meta = step.metadata
    if step.group_metadata or step.padded_size is not None:
        raise ValueError("microbatches need one KV cache group and an unpadded step")
    logits_rows = step.logits_indices.cpu().numpy()
    cum = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
    out = []
    for a, b in request_bounds(meta.query_lens_cpu, num_microbatches):
        t0, t1 = cum[a], cum[b]
        lo, hi = np.searchsorted(logits_rows, [t0, t1])
        out.append(Microbatch(replace(
            step, input_ids=step.input_ids[t0:t1], positions=step.positions[t0:t1],
            metadata=_slice_metadata(meta, a, b, t0, t1),
            logits_indices=step.logits_indices[lo:hi] - t0), int(hi - lo)))
    return out


def pipelined_forward(forward, step: StepInputs, kv_caches, num_microbatches: int) -> torch.Tensor | None:
    """One step through this rank's stage (``forward``: its ``PipelineForward``), microbatch
    by microbatch; the step's logits on the driver, else None. Every rank of the pipeline
    calls it for the same step."""
    pp, model = forward.pp, forward.model
    pending = []               # sends still in flight: (work, tensor kept alive until done)
    microbatches = split_step(step, num_microbatches)
    trace = logger.isEnabledFor(logging.DEBUG)
    for i, mb in enumerate(microbatches):
        part = mb.step
        intermediate = None
        if not pp.is_first:
            intermediate = pp.recv_prev(part.input_ids.shape[0], forward.hidden_size, forward.dtype,
                                        forward.device, i)
        start = time.monotonic()
        out = model(part.input_ids, part.positions, kv_caches, part.metadata, forward.backend,
                    intermediate=intermediate)
        if trace:   # when each stage computed each microbatch (CLOCK_MONOTONIC: one host's clock)
            logger.debug("microbatch %d/%d (%d tokens) on stage %d rank %d: %.6f-%.6f", i,
                         len(microbatches), part.input_ids.shape[0], pp.stage, pp.world.rank, start,
                         time.monotonic())
        if not pp.is_last:
            pending.append(pp.isend_next(*out, microbatch=i))
        elif mb.num_logits:
            local = model.compute_logits(out[part.logits_indices], part.metadata)
            if local is not None:
                pending.append(pp.isend_logits(local, microbatch=i))
    for work, _ in pending:
        work.wait()
    if not pp.is_driver:
        return None
    logits = [pp.recv_logits(mb.num_logits, forward.vocab_size, forward.device, i)
              for i, mb in enumerate(microbatches) if mb.num_logits]
    return torch.cat(logits) if logits else None
