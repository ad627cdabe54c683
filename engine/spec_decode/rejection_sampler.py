"""Verification of a step's drafts, vectorised over the batch.

A sampling request with ``k`` drafts ``d_0 .. d_{k-1}`` has ``k + 1`` scored rows of logits:
row ``j`` is the target's distribution ``p_j`` for the token after ``d_{j-1}`` (row 0: after
its last real token), so row ``j`` verifies ``d_j`` and the last row gives a token past all
drafts (the bonus). Rows are laid out request after request.

- Greedy rows: ``d_j`` is accepted while it equals the argmax of ``p_j``; the first row
  that disagrees (or the bonus row) gives the argmax itself. The output is exactly what
  decoding token by token would give.
- Sampled rows (rejection sampling, Leviathan et al. / Chen et al.): ``d_j`` is accepted
  with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is
  drawn from the normalised residual ``max(0, p_j - q_j)``; after all ``k`` acceptances the
  bonus row is drawn from ``p_k``. Every token then follows the target distribution
  exactly, whatever the drafts. ``q`` is the proposer's distribution; proposers that pick
  one token (n-gram lookup, greedy drafting) have a one-hot ``q``: accept with ``p(d)``,
  else draw from ``p`` without ``d``.

``p`` is the distribution the ordinary sampler samples from: the step's logits after the
structured-output mask, logit_bias, penalties and min_tokens (``process_logits``, with the
drafts before each row counted as the request's tokens), then temperature, top-k, top-p
and min-p (``filter_logits``). A seeded request draws its uniforms and exponentials from
its own generator, row after row (see ``_randoms``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.model.sampler import SamplingMetadata, filter_logits

NO_DRAFT = -1   # draft id of a request's last scored row (nothing to verify there)


@dataclass(slots=True)
class ScoredDrafts:
    """The drafts of a step's sampling requests, row by row of its scored logits."""

    num_drafts: np.ndarray                  # [n] drafts of each sampling request
    draft_ids: torch.Tensor                 # [R] long: the draft each row verifies; NO_DRAFT on last rows
    draft_probs: torch.Tensor | None = None  # [R, V] the proposer's q; None: one-hot at the draft

    @property
    def row_starts(self) -> np.ndarray:
        """Each request's first row."""
        counts = self.num_drafts + 1
        return np.cumsum(counts) - counts


@dataclass(slots=True)
class Verdict:
    """Per sampling request: how many drafts held and the token after them."""

    num_accepted: list[int]
    next_token_ids: list[int]
    # [R] the token each row would contribute: its draft where accepted, else the target's
    row_token_ids: torch.Tensor


def residual(probs: torch.Tensor, draft_ids: torch.Tensor, is_draft: torch.Tensor,
             draft_probs: torch.Tensor | None) -> torch.Tensor:
    """What a rejected row draws from (unnormalised): ``max(0, p - q)``; ``p`` on rows
    without a draft. A row whose residual is empty (``p`` = ``q``: a rejection there has
    probability 0, up to rounding) falls back to ``p``."""
    if draft_probs is None:   # one-hot q: p without the draft's mass
        kept = torch.where(is_draft, torch.zeros_like(draft_ids, dtype=probs.dtype),
                           probs.gather(1, draft_ids[:, None])[:, 0])
        out = probs.scatter(1, draft_ids[:, None], kept[:, None])
    else:
        out = torch.where(is_draft[:, None], (probs - draft_probs).clamp(min=0), probs)
    empty = out.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, probs, out)


def _randoms(probs: torch.Tensor, meta: SamplingMetadata,
             drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform per random row and a row of Exp(1) noise. A seeded row draws from its
    generator: its uniform only where it has a draft, then its noise, so that a request
    without drafts draws exactly what the ordinary sampler draws (its output then does not
    depend on whether others in its batch had drafts)."""
    uniform = torch.rand(probs.shape[0], device=probs.device)
    noise = torch.empty_like(probs).exponential_()
    if meta.generators:
        has_draft = drafted.tolist()
        for i, generator in meta.generators.items():
            if has_draft[i]:
                uniform[i] = torch.rand(1, generator=generator, device=probs.device)[0]
            noise[i].exponential_(generator=generator)
    return uniform, noise


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: ScoredDrafts) -> Verdict:
    """Verify ``drafts`` against ``logits`` ``[R, V]`` (processed, see the module
    docstring; ``meta`` over the same rows)."""
    draft_ids = drafts.draft_ids
    is_draft = draft_ids >= 0
    safe_ids = draft_ids.clamp(min=0)
    if meta.all_random:
        accept = torch.zeros_like(is_draft)
        token = torch.zeros_like(draft_ids)
    else:
        token = logits.argmax(dim=-1)
        accept = is_draft & (token == draft_ids)
    if meta.random_rows is not None:
        rows = meta.random_rows
        probs = filter_logits(logits[rows], meta).softmax(dim=-1)
        ids, drafted = safe_ids[rows], is_draft[rows]
        q = drafts.draft_probs[rows] if drafts.draft_probs is not None else None
        p_d = probs.gather(1, ids[:, None])[:, 0]
        q_d = q.gather(1, ids[:, None])[:, 0] if q is not None else torch.ones_like(p_d)
        uniform, noise = _randoms(probs, meta, drafted)
        accept[rows] = drafted & (uniform * q_d < p_d)          # u < p / q
        token[rows] = (residual(probs, ids, drafted, q) / noise).argmax(dim=-1)
    counts = drafts.num_drafts + 1
    starts = drafts.row_starts
    width = int(counts.max())
    index = starts[:, None] + np.arange(width)[None, :]
    valid = np.arange(width)[None, :] < counts[:, None]
    index_t = torch.from_numpy(np.where(valid, index, 0)).to(logits.device)
    held = accept[index_t] & torch.from_numpy(valid).to(logits.device)
    num_accepted = held.to(torch.int32).cumprod(dim=1).sum(dim=1)
    next_rows = torch.from_numpy(starts).to(logits.device) + num_accepted
    row_tokens = torch.where(accept, draft_ids, token)
    return Verdict(num_accepted.tolist(), token[next_rows].tolist(), row_tokens)
