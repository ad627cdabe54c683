"""Drafting with a model of its own (a draft model, an EAGLE head): its KV in the target's blocks.

The drafter's KV cache is its own tensor (its layers, KV heads and head size) indexed by
the target's block ids: a block of the KV cache manager holds the target's KV and the
drafter's for the same tokens, so preemption frees both, and a prefix-cache hit on a block
finds both valid (the pool's blocks cost the sum; ``KVLayout.extra_bytes_per_token``).

Each step, after verification, the drafter first catches up over the step's tokens that
the target now holds (``catch_up_arrays``): the chunks of prefills, and for a request that
got tokens its last token, the accepted drafts and the new token; that writes its KV for
them, and its logits at the new token give the first draft. Then it feeds its own drafts
back one step at a time (k - 1 steps of one token per request), writing its KV past the
request's tokens in the slots the scheduler allocated ahead (``num_lookahead_tokens``);
later steps write those slots again with the real tokens. Drafts are greedy (the
proposal distribution is one-hot: ``rejection_sampler``).

An EAGLE head reads, at position ``p``, the token at ``p + 1`` (``token_offset`` 1) with the
target's hidden state at ``p``: its catch-up ends one token earlier and its first draft
comes from its output at the last accepted position.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvpilot.engine.model.input_batch import InputBatch
from kvpilot.engine.model.step_inputs import StepInputBuilder, StepInputs


class DraftNet(Protocol):
    token_offset: int       # the input at position p is the token at p + token_offset

    def first(self, step: StepInputs, hidden_rows: np.ndarray, verified) -> torch.Tensor:
        """Forward the catch-up step; greedy drafts for its sampling rows. ``hidden_rows``:
        the target hidden-state rows of the step's tokens (EAGLE)."""

    def next(self, step: StepInputs, alive: np.ndarray) -> torch.Tensor:
        """Forward one token per ``alive`` row (indices into the first step's sampling
        rows); their next greedy drafts."""


def catch_up_arrays(batch: InputBatch, verified, token_offset: int):
    """The catch-up step over ``verified``'s entries: ``(rows, computed, lengths, sampling,
    width, hidden_rows)``; ``hidden_rows``: each of its tokens' row among the target step's
    tokens."""
    scheduled = verified.scheduled
    rows = verified.rows
    computed = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=len(scheduled))
    sampling = np.zeros(len(scheduled), dtype=bool)
    sampling[verified.sample_positions] = True
    end = np.where(sampling, batch.num_tokens[rows] - token_offset, computed + num_new)
    lengths = end - computed
    starts = np.cumsum(num_new) - num_new
    total = int(lengths.sum())
    hidden_rows = np.repeat(starts, lengths) + np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    width = max(batch.num_blocks[r] for r in rows.tolist())
    return rows, computed, lengths, sampling, width, hidden_rows


class ModelDrafter:
    """Args:
        net: the drafting model (``DraftNet``).
        num_speculative_tokens: drafts per request (k).
        batch: the runner's persistent batch (rows, tokens, block tables).
        builder: the drafter's own step-input buffers over ``batch``.
        max_model_len: no KV is written at or past it.
    """

    def __init__(self, net: DraftNet, num_speculative_tokens: int, batch: InputBatch,
                 builder: StepInputBuilder, max_model_len: int) -> None:
        self.net, self.k, self.batch, self.builder = net, num_speculative_tokens, batch, builder
        self.max_model_len = max_model_len

    @property
    def kv_bytes_per_token(self) -> int:
        return self.net.kv_bytes_per_token

    @property
    def needs_hidden(self) -> bool:
        return getattr(self.net, "needs_hidden", False)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.net.allocate(num_blocks, block_size)

    def propose(self, batch: InputBatch, verified, enabled: bool = True) -> dict[int, list[int]]:
        """Catch up on ``verified``'s tokens, then (``enabled``) draft for its sampling rows."""
        if not len(verified.rows):
            return {}
        offset = self.net.token_offset
        rows, computed, lengths, sampling, width, hidden_rows = catch_up_arrays(batch, verified, offset)
        step = self.builder.build_arrays(rows, computed, lengths, sampling, width, token_offset=offset)
        tokens = self.net.first(step, hidden_rows, verified)
        sample_rows = step.sample_rows
        if not enabled or not len(sample_rows):
            return {}
        drafts = [tokens.tolist()]
        position = batch.num_tokens[sample_rows] - offset   # where the first draft is fed
        capacity = np.minimum(np.asarray(batch.num_blocks)[sample_rows] * batch.block_size,
                              self.max_model_len)
        depth = np.ones(len(sample_rows), dtype=np.int64)
        alive = np.arange(len(sample_rows))
        for _ in range(self.k - 1):
            alive = alive[position[alive] < capacity[alive]]
            if not len(alive):
                break
            live_rows, live_pos = sample_rows[alive], position[alive]
            last = np.array([drafts[-1][i] for i in alive.tolist()], dtype=np.int32)
            batch.token_ids[live_rows, live_pos + offset] = last   # past num_tokens: scratch
            step = self.builder.build_arrays(live_rows, live_pos, np.ones(len(alive), dtype=np.int64),
                                             np.ones(len(alive), dtype=bool), width, token_offset=offset)
            new = np.array(drafts[-1])
            new[alive] = self.net.next(step, alive).cpu().numpy()
            drafts.append(new.tolist())
            depth[alive] += 1
            position[alive] += 1
        by_row = np.array(drafts).T
        return {row: by_row[i, :depth[i]].tolist() for i, row in enumerate(sample_rows.tolist())}
