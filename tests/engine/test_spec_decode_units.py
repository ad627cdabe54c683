"""Speculative decoding's pieces against independent references: the config's checks, the
n-gram lookup against a brute-force search, the rejection sampler's output distribution
(chi-square against the target, with a draft distribution q that is not one-hot) and the
scheduler's bookkeeping of rejected drafts (computed tokens, prefix-cache hashes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvpilot.contract.speculative import SpeculativeConfig
from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.model.sampler import SamplingMetadata
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.spec_decode import rejection_sampler
from kvpilot.engine.spec_decode.ngram import NgramProposer
from kvpilot.engine.spec_decode.rejection_sampler import NO_DRAFT, ScoredDrafts, rejection_sample

from support.chi_square import chi_square_p


@pytest.mark.parametrize(("fields", "needle"), [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/some/model"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_min": 2}, "ngram method only"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ">= 2"),
    ({"num_speculative_tokens": 2}, "give `method`"),
])
def test_config_refuses_bad_fields_clearly(fields, needle):
    with pytest.raises(ValueError, match="speculative_config") as info:
        SpeculativeConfig(**fields)
    assert needle in str(info.value)


def test_config_fills_vllms_defaults_and_infers_the_method():
    assert SpeculativeConfig("ngram", 3).prompt_lookup_min == 5
    c = SpeculativeConfig("ngram", 3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.num_lookahead_tokens) == (4, 4, 0)
    assert SpeculativeConfig(model="ngram", num_speculative_tokens=2).method == "ngram"
    assert SpeculativeConfig(model="/m/EAGLE-llama", num_speculative_tokens=2).method == "eagle"
    d = SpeculativeConfig(model="/m/small", num_speculative_tokens=2)
    assert (d.method, d.num_lookahead_tokens) == ("draft_model", 2)
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "n": 1}')
    assert SpeculativeConfig.from_dict(c.to_dict()) == c


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule, one position at a time: the longest n-gram suffix that occurs earlier
    (and is followed by a token), at its earliest occurrence; the up to k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_ngram_lookup_matches_a_brute_force_search():
    rng = random.Random(0)
    proposer = NgramProposer(2, 4, 5)
    for _ in range(20):
        rows = [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
        width = max(map(len, rows)) + 7
        batch = np.full((len(rows), width), 99, dtype=np.int32)   # garbage past each row's end
        for i, r in enumerate(rows):
            batch[i, :len(r)] = r
        got = proposer.propose(batch, np.array([len(r) for r in rows]))
        assert [g.tolist() for g in got] == [_brute_force(r, 2, 4, 5) for r in rows]


def _sampled_metadata(num_rows: int) -> SamplingMetadata:
    return SamplingMetadata(num_rows, random_rows=torch.arange(num_rows), all_random=True,
                            temperature=torch.ones(num_rows))


def _first_tokens(target: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> list[int]:
    """``n`` independent requests, each with one draft drawn from ``q``, verified against
    ``target`` (logits of the first position; the bonus row is never reached by the check)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    logits = target.repeat(2 * n, 1)                        # [draft row, bonus row] per request
    ids = torch.full((2 * n,), NO_DRAFT, dtype=torch.long)
    ids[0::2] = drafts
    probs = torch.zeros(2 * n, q.shape[0])
    probs[0::2] = q
    scored = ScoredDrafts(np.ones(n, dtype=np.int64), ids, probs)
    verdict = rejection_sample(logits, _sampled_metadata(2 * n), scored)
    return [int(d) if a else t for d, a, t in zip(drafts.tolist(), verdict.num_accepted,
                                                   verdict.next_token_ids, strict=True)]


def test_rejection_sampling_keeps_the_target_distribution(monkeypatch):
    """20,000 first tokens, drafts from a q far from p: chi-square against p passes; with the
    residual step broken (drawing from p instead of max(0, p - q)) it fails."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(12, generator=gen) * 1.5
    q = torch.softmax(torch.randn(12, generator=gen) * 2.0, dim=0)
    p = torch.softmax(target, dim=0)
    good, df = chi_square_p(_first_tokens(target, q, 20_000, seed=2), p)
    print(f"chi-square p = {good:.3g} ({df} degrees of freedom)")
    assert good > 1e-3
    monkeypatch.setattr(rejection_sampler, "residual", lambda probs, ids, drafted, q: probs)
    broken, df = chi_square_p(_first_tokens(target, q, 20_000, seed=2), p)
    print(f"broken residual: chi-square p = {broken:.3g} ({df} degrees of freedom)")
    assert broken < 1e-6, (broken, df)


def test_greedy_verification_keeps_the_longest_agreeing_prefix():
    vocab = 8
    argmax = [3, 5, 1, 7, 2, 4, 6]           # the target's choice at each row
    logits = torch.full((7, vocab), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 1.0
    # rows 0-3: request 0, drafts [3, 5, 0] -> 2 accepted, then the target's 1;
    # rows 4-6: request 1, drafts [2, 4] -> both accepted, then the bonus row's 6
    ids = torch.tensor([3, 5, 0, NO_DRAFT, 2, 4, NO_DRAFT])
    counts = np.array([3, 2])
    verdict = rejection_sample(logits, SamplingMetadata(7), ScoredDrafts(counts, ids))
    assert verdict.num_accepted == [2, 2]
    assert verdict.next_token_ids == [1, 6]


def _request(rid: str, prompt: list[int], max_tokens: int = 50) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), max_tokens=max_tokens)


def test_rejected_drafts_roll_back_and_are_never_hashed():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True, hash_root=root_hash(None, "t"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv,
                      num_speculative_tokens=4)
    request = _request("a", [1, 2, 3, 4, 5, 6])
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"a": [7]})          # prefill -> 7 tokens
    sched.update_draft_token_ids({"a": [8, 9, 10, 11]})
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, list(s.spec_token_ids)) == (6, 5, [8, 9, 10, 11])
    assert out.num_spec_tokens == 4
    # blocks: [1 2 3 4] [5 6 7 8?] ...: only the first is full of the request's own tokens
    assert len(request.block_hashes) == 1
    sched.update_from_output(out, {"a": [8, 20]})                     # 1 draft accepted, then 20
    assert request.output_token_ids == [7, 8, 20] and request.num_computed_tokens == 8
    assert request.spec_token_ids == []
    assert len(request.block_hashes) == 2                             # [5 6 7 8] is accepted
    stats = sched.spec_stats.snapshot()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)
    assert stats.num_accepted_tokens_per_pos == (1, 0, 0, 0)
    # the next step recomputes from the bonus token's position: 9, 10, 11 are gone
    out = sched.schedule()
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (8, 1)


def test_drafts_are_trimmed_to_the_budget_max_tokens_and_context():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False, hash_root=root_hash(None, "t"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64), kv,
                      num_speculative_tokens=5)
    request = _request("a", [1, 2], max_tokens=4)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"a": [3]})
    sched.update_draft_token_ids({"a": [4, 5, 6, 7, 8]})
    assert request.spec_token_ids == [4, 5]            # 3 tokens left: at most 2 drafts + 1
    out = sched.schedule()                               # budget 3: the last token + 2 drafts
    assert list(out.scheduled[0].spec_token_ids) == [4, 5]
    sched.update_from_output(out, {"a": [4, 9]})
    sched.update_draft_token_ids({"a": [1, 1, 1]})
    assert request.spec_token_ids == []                 # one token left: no room for a draft
