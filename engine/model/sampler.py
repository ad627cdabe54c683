"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded per request.

Every parameter arrives as a tensor over the batch (``SamplingMetadata``, built by the
persistent batch from its per-request rows), so mixed parameters cost no per-request
Python; only seeded requests and the rows that asked for logprobs are visited one by
one. Parts nobody in the batch uses are skipped whole (``None`` fields).

Logprobs are those of the raw model distribution (after a structured-output mask, before
logit_bias, penalties and temperature), as vLLM reports by default. A request with a seed samples with its own
``torch.Generator`` (exponential-race sampling: argmax of p / Exp(1) noise), so its
output is reproducible whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Penalties:
    """Repetition / presence / frequency penalties of the rows in ``rows``.

    ``token_ids`` ``[len(rows), L]`` holds each row's prompt then output tokens, padded
    with ``vocab_size``; ``is_output`` marks the output positions.
    """

    rows: torch.Tensor              # [p] long, row indices into the logits
    token_ids: torch.Tensor         # [p, L] long
    is_output: torch.Tensor         # [p, L] bool
    repetition: torch.Tensor        # [p] float32, 1.0 = off
    presence: torch.Tensor          # [p] float32
    frequency: torch.Tensor         # [p] float32


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling parameters for the ``num_rows`` rows of the logits.

    ``random_rows`` are the rows that sample (temperature > 0); the remaining rows are
    greedy. ``temperature`` / ``top_k`` / ``top_p`` / ``min_p`` are over the random rows
    only and ``None`` when no random row uses them (top-k: 0 = off).
    """

    num_rows: int
    random_rows: torch.Tensor | None = None       # [r] long; None: every row is greedy
    all_random: bool = False                      # random_rows covers every row, in order
    temperature: torch.Tensor | None = None       # [r] float32
    top_k: torch.Tensor | None = None             # [r] long
    top_p: torch.Tensor | None = None             # [r] float32
    min_p: torch.Tensor | None = None             # [r] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # random-row position -> generator
    penalties: Penalties | None = None
    # (row, token ids, values) of rows with a logit_bias: added to their logits.
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (row, stop token ids) of rows still under min_tokens: their stop tokens are masked.
    suppress: list[tuple[int, list[int]]] = field(default_factory=list)
    logprobs: list[tuple[int, int]] = field(default_factory=list)  # (row, top-k) to report

    @property
    def all_greedy(self) -> bool:
        return self.random_rows is None


@dataclass(slots=True)
class SampleResult:
    """Logprobs of one row's sampled token (rows that asked for them)."""

    token_id: int
    logprob: float | None = None          # of the sampled token (raw distribution)
    rank: int | None = None               # 1 = most likely
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]                  # one per row
    logprobs: dict[int, SampleResult]     # row -> logprobs, for the rows that asked


def _apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    vocab = logits.shape[1]
    sub = logits[pen.rows]
    width = vocab + 1   # the padding id lands in the extra column, dropped below
    seen = torch.zeros(sub.shape[0], width, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, pen.token_ids, True)
    seen = seen[:, :vocab]
    rep = pen.repetition[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    out_ids = torch.where(pen.is_output, pen.token_ids, vocab)
    counts = torch.zeros(sub.shape[0], width, dtype=sub.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=sub.dtype))
    counts = counts[:, :vocab]
    sub -= pen.frequency[:, None] * counts + pen.presence[:, None] * (counts > 0).to(sub.dtype)
    logits[pen.rows] = sub


def filter_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf) on the random rows' logits."""
    logits = logits / meta.temperature.clamp(min=1e-5)[:, None]
    vocab = logits.shape[1]
    if meta.top_k is not None or meta.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if meta.top_k is not None:
            k = torch.where((meta.top_k > 0) & (meta.top_k < vocab), meta.top_k, vocab)
            drop = ranks >= k[:, None]
        if meta.top_p is not None:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs        # mass strictly above this token
            drop |= before >= meta.top_p[:, None]
        drop[:, 0] = False                               # always keep the most likely token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _random_sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, generator in meta.generators.items():
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, meta: SamplingMetadata) -> dict[int, SampleResult]:
    """Logprobs of ``tokens`` (one per row of ``raw``) in the rows ``meta.logprobs`` names."""
    rows = torch.tensor([r for r, _ in meta.logprobs], device=raw.device)
    lp = raw[rows].log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[rows][:, None])
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    max_k = max(k for _, k in meta.logprobs)
    top = lp.topk(max_k) if max_k > 0 else None
    top_ids = top.indices.tolist() if top is not None else None
    top_vals = top.values.tolist() if top is not None else None
    chosen_list = chosen[:, 0].tolist()
    token_list = tokens[rows].tolist()
    results = {}
    for i, (row, k) in enumerate(meta.logprobs):
        top_pairs = list(zip(top_ids[i][:k], top_vals[i][:k], strict=True)) if k > 0 else []
        results[row] = SampleResult(token_list[i], chosen_list[i], ranks[i], top_pairs)
    return results


def process_logits(logits: torch.Tensor, meta: SamplingMetadata,
                   token_bitmask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw, processed)``: the logits after the structured-output mask (in place: the
    logprobs' distribution), then those with logit_bias, penalties and min_tokens'
    suppressed stop tokens (a copy when any applies) — what greedy takes the argmax of
    and temperature and the filters act on."""
    if token_bitmask is not None:
        token_bitmask.apply(logits)
    raw = logits
    if meta.penalties is not None or meta.suppress or meta.logit_bias:
        logits = logits.clone()
        for row, ids, values in meta.logit_bias:
            logits[row].index_add_(0, ids, values)
        if meta.penalties is not None:
            _apply_penalties(logits, meta.penalties)
        for row, ids in meta.suppress:
            logits[row, ids] = float("-inf")
    return raw, logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; a NaN counts as the maximum): NumPy's
    on contiguous float32 CPU logits (vectorized: about a tenth of torch's CPU argmax time
    over a 262k vocabulary, same indices), else torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, meta: SamplingMetadata, token_bitmask=None) -> SamplerOutput:
    """Pick one token per row of ``logits`` ``[num_rows, vocab]`` (float32).

    ``token_bitmask`` (structured outputs; any object with ``apply(logits)``, see
    ``kvpilot.engine.structured_output.bitmask``) first sets the logits of tokens a row's
    grammar forbids to -inf, in place, so logprobs too are those of the allowed tokens
    (as in vLLM).
    """
    raw, logits = process_logits(logits, meta, token_bitmask)
    if meta.all_greedy:
        tokens = greedy_tokens(logits)
    elif meta.all_random:
        tokens = _random_sample(filter_logits(logits, meta), meta)
    else:
        tokens = greedy_tokens(logits)
        sub = logits[meta.random_rows]
        tokens[meta.random_rows] = _random_sample(filter_logits(sub, meta), meta)
    logprobs = token_logprobs(raw, tokens, meta) if meta.logprobs else {}
    return SamplerOutput(tokens.tolist(), logprobs)
