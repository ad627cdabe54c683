"""The model runner's side of speculative decoding: a step's drafts in, verified tokens and
the next drafts out.

Per step: ``write_drafts`` puts each scheduled request's drafts after its tokens in the
persistent batch (the step's inputs read them there); after the forward pass ``verify``
scores every sampling request's rows (its last token and its drafts) and returns the
tokens each keeps; once those are appended, ``propose`` asks the proposer for the next
drafts of the requests that got tokens, unless ``disable_by_batch_size`` or more requests
are running.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from kvpilot.contract.speculative import SpeculativeConfig
from kvpilot.engine.core.scheduler import ScheduledRequest
from kvpilot.engine.model.input_batch import InputBatch
from kvpilot.engine.model.sampler import SampleResult, process_logits, token_logprobs
from kvpilot.engine.model.step_inputs import StepInputs
from kvpilot.engine.spec_decode.rejection_sampler import (
    NO_DRAFT,
    ScoredDrafts,
    Verdict,
    rejection_sample,
)


@dataclasses.dataclass(slots=True)
class VerifiedStep:
    """What a step's verification gives the proposer and the runner's output."""

    step: StepInputs
    scheduled: list[ScheduledRequest]      # the step's entries, in order
    rows: np.ndarray                       # their batch rows
    sample_positions: np.ndarray           # indices into ``scheduled`` of the sampling entries
    num_drafts: np.ndarray                 # [len(scheduled)] drafts scored per entry
    num_accepted: np.ndarray               # [num sampling] drafts kept
    token_lists: list[list[int]]           # per sampling entry: its new tokens
    hidden: torch.Tensor | None = None     # the target's hidden states (EAGLE)


class Proposer(Protocol):
    def propose(self, batch: InputBatch, verified: VerifiedStep, enabled: bool) -> dict[int, list[int]]:
        """Drafts by batch row for (some of) the rows of ``verified.step.sample_rows``;
        none when not ``enabled`` (a drafter with its own KV still catches up on the step)."""


class SpecDecoder:
    """Args:
        config: the speculative config.
        batch: the runner's persistent batch.
        proposer: where drafts come from (``proposer.make_proposer``).
    """

    def __init__(self, config: SpeculativeConfig, batch: InputBatch, proposer: Proposer) -> None:
        self.config = config
        self.batch = batch
        self.proposer = proposer

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token the proposer keeps in the target's blocks (a model's own KV)."""
        return getattr(self.proposer, "kv_bytes_per_token", 0)

    @property
    def needs_hidden(self) -> bool:
        """Whether the proposer reads the target's hidden states (EAGLE)."""
        return getattr(self.proposer, "needs_hidden", False)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The proposer's KV cache beside the target's (same block ids), if it keeps one."""
        if self.kv_bytes_per_token:
            self.proposer.allocate(num_blocks, block_size)

    def write_drafts(self, scheduled: list[ScheduledRequest], rows: list[int]) -> np.ndarray:
        """Write each entry's drafts into its batch row; the number per entry."""
        num = np.zeros(len(scheduled), dtype=np.int64)
        for i, (s, row) in enumerate(zip(scheduled, rows, strict=True)):
            if s.spec_token_ids:
                self.batch.write_drafts(row, s.spec_token_ids)
                num[i] = len(s.spec_token_ids)
        return num

    def verify(self, logits: torch.Tensor, step: StepInputs, scheduled: list[ScheduledRequest],
               rows: list[int], num_drafts: np.ndarray, token_bitmask=None,
               hidden: torch.Tensor | None = None
               ) -> tuple[VerifiedStep, dict[int, list[SampleResult]]]:
        """Verify the drafts scored in ``logits`` (one row per scored position, see
        ``StepInputs.logits_indices``); ``token_bitmask`` has a row per scored position.
        Returns the verified step and the logprobs of the kept tokens, by sampling index."""
        positions = np.flatnonzero(np.fromiter((s.samples for s in scheduled), dtype=bool,
                                               count=len(scheduled)))
        drafts = [scheduled[i].spec_token_ids for i in positions]
        per_request = num_drafts[positions]
        counts = per_request + 1
        starts = np.cumsum(counts) - counts
        scored_rows = np.repeat(step.sample_rows, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        meta = self.batch.sampling_metadata(scored_rows, offsets)
        raw, processed = process_logits(logits, meta, token_bitmask)
        ids = np.full(len(scored_rows), NO_DRAFT, dtype=np.int64)
        for start, d in zip(starts.tolist(), drafts, strict=True):
            ids[start:start + len(d)] = d
        scored = ScoredDrafts(per_request, torch.from_numpy(ids).to(logits.device))
        verdict = rejection_sample(processed, meta, scored)
        token_lists = [[*d[:a], t] for d, a, t in
                       zip(drafts, verdict.num_accepted, verdict.next_token_ids, strict=True)]
        logprobs = _kept_logprobs(raw, meta, verdict, starts, offsets) if meta.logprobs else {}
        verified = VerifiedStep(step, scheduled, np.asarray(rows, dtype=np.int64), positions, num_drafts,
                                np.asarray(verdict.num_accepted, dtype=np.int64), token_lists, hidden)
        return verified, logprobs

    @staticmethod
    def unverified(step: StepInputs, scheduled: list[ScheduledRequest], rows: list[int],
                   token_lists: list[list[int]], hidden: torch.Tensor | None = None) -> VerifiedStep:
        """A step without drafts (each sampling request sampled one token), as the
        proposer reads steps."""
        positions = np.flatnonzero(np.fromiter((s.samples for s in scheduled), dtype=bool,
                                               count=len(scheduled)))
        return VerifiedStep(step, scheduled, np.asarray(rows, dtype=np.int64), positions,
                            np.zeros(len(scheduled), dtype=np.int64),
                            np.zeros(len(positions), dtype=np.int64), token_lists, hidden)

    def propose(self, verified: VerifiedStep) -> dict[int, list[int]]:
        """The next drafts by batch row (none while ``disable_by_batch_size`` or more
        requests run)."""
        limit = self.config.disable_by_batch_size
        return self.proposer.propose(self.batch, verified, limit is None or len(self.batch) < limit)


def _kept_logprobs(raw: torch.Tensor, meta, verdict: Verdict, starts: np.ndarray,
                   offsets: np.ndarray) -> dict[int, list[SampleResult]]:
    """Logprobs of each kept token (rows up to a request's first rejection), grouped by
    sampling index."""
    request_of = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(offsets))))
    kept = [(row, k) for row, k in meta.logprobs
            if offsets[row] <= verdict.num_accepted[request_of[row]]]
    results = token_logprobs(raw, verdict.row_token_ids, dataclasses.replace(meta, logprobs=kept))
    grouped: dict[int, list[SampleResult]] = {}
    for row, _ in kept:
        grouped.setdefault(int(request_of[row]), []).append(results[row])
    return grouped
