"""Sampled outputs keep the target's distribution under speculative decoding.

A prompt ``[a, b, ...]`` is chosen (by HF transformers, the oracle) so that the model's
first token is almost always ``a`` and its second token, after ``a``, is ``b`` with a
moderate probability (at temperature 0.2): n-gram lookup then drafts ``b`` (what followed ``a`` in the prompt)
for the second position, and rejection sampling decides. The second tokens of the
requests whose first token was ``a`` (at least 2,000 of them) are tested against HF's
probabilities at that position with a chi-square test: it passes with speculation, and
fails when the residual step of the rejection sampler is deliberately broken.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.spec_decode import rejection_sampler

from support.chi_square import chi_square_p

NUM_REQUESTS = 2400
TEMPERATURE = 0.2   # the tiny random models' distributions are nearly flat at 1.0
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 1}


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    """(checkpoint, prompt, a, b, HF's distribution of the second token after ``a``)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dist = lambda ids: (model(torch.tensor([ids])).logits[0, -1] / TEMPERATURE).softmax(-1)  # noqa: E731
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(300):
            rest = [rng.randrange(3, 512) for _ in range(14)]
            a = int(dist(rest).argmax())
            for b in dist(rest + [a]).topk(4).indices.tolist():
                prompt = [a, b] + rest
                first = dist(prompt)
                if first.argmax() != a or first[a] < 0.95:
                    continue
                second = dist(prompt + [a])
                if 0.15 <= second[b] <= 0.65 and int((second * 2000 >= 5).sum()) >= 8:
                    return path, prompt, a, b, second
    pytest.fail("no prompt of the wanted shape found")


def _second_tokens(path, prompt, a) -> list[int]:
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=1024, max_model_len=64, max_num_seqs=256,
              speculative_config=SPEC)
    outs = llm.generate([prompt] * NUM_REQUESTS, SamplingParams(temperature=TEMPERATURE, max_tokens=3,
                                                                 ignore_eos=True))
    stats = llm.get_stats().spec_decoding
    assert stats.num_drafts >= 2000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    return [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == a]


@pytest.mark.slow
def test_second_tokens_follow_the_target_distribution(case):
    path, prompt, a, b, target = case
    samples = _second_tokens(path, prompt, a)
    assert len(samples) >= 2000
    p, df = chi_square_p(samples, target)
    print(f"{len(samples)} samples, P(b) = {target[b]:.3f}, observed {samples.count(b) / len(samples):.3f}; "
          f"chi-square p = {p:.3g} ({df} degrees of freedom)")
    assert p > 1e-3


@pytest.mark.slow
def test_a_broken_rejection_step_is_caught(case, monkeypatch):
    """The residual drawn from p instead of max(0, p - q): the draft b gets extra mass."""
    path, prompt, a, b, target = case
    monkeypatch.setattr(rejection_sampler, "residual", lambda probs, ids, drafted, q: probs)
    samples = _second_tokens(path, prompt, a)
    p, df = chi_square_p(samples, target)
    print(f"broken: {len(samples)} samples, P(b) = {target[b]:.3f}, observed "
          f"{samples.count(b) / len(samples):.3f}; chi-square p = {p:.3g} ({df} degrees of freedom)")
    assert p < 1e-6
