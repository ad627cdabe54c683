"""N-gram prompt lookup: drafts copied from the request's own earlier tokens.

For each request, the last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up among its earlier tokens, prompt and output alike;
the first size that matches wins, at its earliest occurrence (vLLM's rule), and the up to
``k`` tokens that followed it there are the drafts. Text that copies from the context
(editing a passage, extracting fields, code that repeats names) continues as it did.

Vectorised with numpy over the requests and every candidate position at once: per ``n``,
``n`` column-shifted comparisons of a ``[requests, length]`` window against each row's
suffix (no Python loop over positions or requests).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Args:
        min_n / max_n: n-gram sizes tried, longest first.
        num_speculative_tokens: drafts proposed at most (k).
    """

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n or num_speculative_tokens < 1:
            raise ValueError(f"bad n-gram sizes {min_n}..{max_n} or k {num_speculative_tokens}")
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[np.ndarray]:
        """Drafts for each row of ``token_ids`` ``[rows, width]`` whose first
        ``num_tokens[row]`` entries are its tokens (the rest is ignored); an empty array
        where nothing matches."""
        num_rows = len(num_tokens)
        lengths = num_tokens.astype(np.int64)
        width = int(lengths.max()) if num_rows else 0
        context = token_ids[:, :width]
        starts = np.full(num_rows, -1, dtype=np.int64)     # where the drafts start, per row
        pending = lengths > self.min_n
        for n in range(self.max_n, self.min_n - 1, -1):
            rows = np.flatnonzero(pending & (lengths > n))
            if not len(rows):
                continue
            found = self._earliest(context[rows], lengths[rows], n)
            hit = found >= 0
            starts[rows[hit]] = found[hit] + n
            pending[rows[hit]] = False
        drafts = []
        for row in range(num_rows):
            start = starts[row]
            if start < 0:
                drafts.append(np.empty(0, dtype=token_ids.dtype))
            else:
                drafts.append(context[row, start:min(start + self.k, lengths[row])])
        return drafts

    @staticmethod
    def _earliest(context: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
        """Per row, the earliest start ``s`` with ``context[s:s + n]`` equal to the row's
        last ``n`` tokens and ``s + n < length`` (at least one token follows), else -1."""
        num_candidates = context.shape[1] - n      # starts 0 .. width - n - 1
        suffix_at = lengths[:, None] - n + np.arange(n)[None, :]
        suffix = np.take_along_axis(context, suffix_at, axis=1)
        match = np.arange(num_candidates)[None, :] < (lengths - n)[:, None]
        for j in range(n):
            match &= context[:, j:j + num_candidates] == suffix[:, j:j + 1]
        first = match.argmax(axis=1)
        return np.where(match[np.arange(len(lengths)), first], first, -1)


class NgramDrafter:
    """The runner's n-gram proposer: drafts for the batch rows that just got tokens."""

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self.lookup = NgramProposer(min_n, max_n, num_speculative_tokens)

    def propose(self, batch, verified, enabled: bool = True) -> dict[int, list[int]]:
        rows = verified.step.sample_rows
        if not enabled or not len(rows):
            return {}
        lengths = batch.num_tokens[rows]
        drafts = self.lookup.propose(batch.token_ids[rows, :int(lengths.max())], lengths)
        return {row: d.tolist() for row, d in zip(rows.tolist(), drafts, strict=True) if len(d)}
