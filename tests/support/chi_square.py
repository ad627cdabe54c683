"""Pearson's chi-square goodness-of-fit test (torch's regularised incomplete gamma for the
p-value; no scipy here)."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_p(samples: list[int], probs: dict[int, float] | torch.Tensor,
                 min_expected: float = 5.0) -> tuple[float, int]:
    """(p-value, degrees of freedom) of ``samples`` against the distribution ``probs``
    (token -> probability, or a probability vector): outcomes expected at least
    ``min_expected`` times are their own bins, the rest share one."""
    if isinstance(probs, torch.Tensor):
        probs = dict(enumerate(probs.tolist()))
    n = len(samples)
    counts = Counter(samples)
    big = [t for t, p in probs.items() if p * n >= min_expected]
    observed = [counts.get(t, 0) for t in big]
    expected = [probs[t] * n for t in big]
    rest_expected = n - sum(expected)
    if rest_expected >= min_expected:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                torch.tensor(stat / 2, dtype=torch.float64)).item()
    return p, df
