"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded per request.

Logprobs are those of the raw model distribution (after a structured-output mask, before
logit_bias, penalties and temperature), as vLLM reports by default. A request with a seed samples with its own
``torch.Generator`` (exponential-race sampling: argmax of p / Exp(1) noise), so its
output is reproducible whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None          # of the sampled token (raw distribution)
    rank: int | None = None               # 1 = most likely
    top_logprobs: list[tuple[int, float]] | None = None


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                0, ids, torch.ones(len(ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(row.params.logit_bias.values()), dtype=logits.dtype,
                                device=logits.device)
            logits[i].index_add_(0, ids, bias)


def _suppress_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens and row.params.all_stop_token_ids:
            ids = [t for t in row.params.all_stop_token_ids if t < logits.shape[1]]
            logits[i, ids] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf) on a copy."""
    temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], device=logits.device)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs        # mass strictly above this token
        drop |= before >= torch.tensor(top_p, device=logits.device)[:, None]
        drop[:, 0] = False                           # always keep the most likely token
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        noise[i].exponential_(generator=row.generator)
    return (probs / noise).argmax(dim=-1)


def _needs_logit_edits(row: SamplingRow) -> bool:
    p = row.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
            or bool(p.logit_bias)
            or (len(row.output_token_ids) < p.min_tokens and bool(p.all_stop_token_ids)))


def sample(logits: torch.Tensor, rows: list[SamplingRow], token_bitmask=None) -> list[SampleResult]:
    """Pick one token per row of ``logits`` ``[num_rows, vocab]`` (float32).

    ``token_bitmask`` (structured outputs; any object with ``apply(logits)``, see
    ``kvpilot.engine.structured_output.bitmask``) first sets the logits of tokens a row's
    grammar forbids to -inf, in place, so logprobs too are those of the allowed tokens
    (as in vLLM).
    """
    if token_bitmask is not None:
        token_bitmask.apply(logits)
    want_logprobs = [r.params.logprobs for r in rows]
    raw_logprobs = logits.log_softmax(dim=-1) if any(k is not None for k in want_logprobs) else None
    if any(_needs_logit_edits(r) for r in rows):
        logits = logits.clone()
        _apply_logit_bias(logits, rows)
        _apply_penalties(logits, rows)
        _suppress_stop_tokens(logits, rows)
    greedy = [r.params.is_greedy for r in rows]
    tokens = logits.argmax(dim=-1)
    if not all(greedy):
        idx = [i for i, g in enumerate(greedy) if not g]
        sub = [rows[i] for i in idx]
        sampled = _random_sample(_filter(logits[idx], sub), sub)
        tokens[torch.tensor(idx, device=logits.device)] = sampled
    token_list = tokens.tolist()
    results = [SampleResult(t) for t in token_list]
    if raw_logprobs is not None:
        for i, k in enumerate(want_logprobs):
            if k is None:
                continue
            lp = raw_logprobs[i]
            chosen = lp[token_list[i]]
            results[i].logprob = float(chosen)
            results[i].rank = int((lp > chosen).sum()) + 1
            if k > 0:
                top = lp.topk(k)
                results[i].top_logprobs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            else:
                results[i].top_logprobs = []
    return results
