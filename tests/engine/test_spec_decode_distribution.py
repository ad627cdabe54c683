"""Sampled outputs keep the target's distribution under speculative decoding.

A prompt ``[a, b, ...]`` is chosen (by HF transformers, the oracle) so that the model's
first token is ``a`` with probability at least 0.98 and its second token, after ``a``, is
``b`` with a moderate probability (at temperature 0.2): n-gram lookup then drafts ``b``
(what followed ``a`` in the prompt) for the second position, and rejection sampling
decides. The 2,100 samples run as parallel requests of one ``generate`` on a one-layer
model (each request is a one-token prefill past its cached prompt block, then one or two
verification steps); the second tokens
of the requests whose first token was ``a`` (at least 2,000 of them) are tested against
HF's probabilities at that position with Pearson's chi-square test.

Thresholds and power: with speculation the test passes when p > 1e-3 (a false alarm one
run in a thousand; the engine's sampling is seeded, so a given build always gives the same
p). With the residual step broken (drawing from ``p`` instead of ``p`` without the draft's
mass), a rejected draft can come back, so ``P(b)`` becomes ``p_b + (1 - p_b) p_b``: at
least 0.1275 above ``p_b`` for ``p_b`` in [0.15, 0.65]. Over n = 2,000 samples that bin
alone contributes a noncentrality of ``n * 0.1275**2 / 0.65 >= 50`` (above 150 at the low
end of the range); with at most ~30 degrees of freedom the statistic then lands near
df + 50 or above, and p < 1e-6 needs only about 60 (df 8) to 80 (df 30): the broken
sampler is caught with power close to 1.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.spec_decode import rejection_sampler

from support.chi_square import chi_square_p

NUM_REQUESTS = 2100
TEMPERATURE = 0.2   # the tiny random models' distributions are nearly flat at 1.0
# prompts of one block and a token: a first request caches the block, so the 2,100 prefills
# are one-token rows (batched like decode rows) and only the verification rows cost each a pass
BLOCK_SIZE = 8
# one draft, max_tokens 3: the scheduler leaves room for one draft plus the bonus token
SPEC = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1}


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    """(checkpoint, prompt, a, b, HF's distribution of the second token after ``a``)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama", num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dist = lambda ids: (model(torch.tensor([ids])).logits[0, -1] / TEMPERATURE).softmax(-1)  # noqa: E731
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(300):
            rest = [rng.randrange(3, 512) for _ in range(BLOCK_SIZE - 1)]
            a = int(dist(rest).argmax())
            for b in dist(rest + [a]).topk(4).indices.tolist():
                prompt = [a, b] + rest
                first = dist(prompt)
                if first.argmax() != a or first[a] < 0.98:
                    continue
                second = dist(prompt + [a])
                if 0.15 <= second[b] <= 0.65 and int((second * 2000 >= 5).sum()) >= 8:
                    return path, prompt, a, b, second
    pytest.fail("no prompt of the wanted shape found")


def _second_tokens(path, prompt, a) -> list[int]:
    llm = LLM(str(path), dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks=1024, max_model_len=32,
              max_num_seqs=1024, max_num_batched_tokens=8192, speculative_config=SPEC)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))   # caches the prompt's block
    outs = llm.generate([prompt] * NUM_REQUESTS, SamplingParams(temperature=TEMPERATURE, max_tokens=3,
                                                                 ignore_eos=True))
    stats = llm.get_stats().spec_decoding
    assert stats.num_drafts >= 2000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    return [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == a]


@pytest.mark.slow
def test_second_tokens_follow_the_target_distribution_and_a_broken_residual_does_not(case, monkeypatch):
    path, prompt, a, b, target = case
    samples = _second_tokens(path, prompt, a)
    assert len(samples) >= 2000
    p, df = chi_square_p(samples, target)
    print(f"{len(samples)} samples, P(b) = {target[b]:.3f}, observed {samples.count(b) / len(samples):.3f}; "
          f"chi-square p = {p:.3g} ({df} degrees of freedom)")
    assert p > 1e-3
    # broken: the residual drawn from p instead of max(0, p - q), so the draft b gets extra mass
    monkeypatch.setattr(rejection_sampler, "residual", lambda probs, ids, drafted, q: probs)
    samples = _second_tokens(path, prompt, a)
    assert len(samples) >= 2000
    p, df = chi_square_p(samples, target)
    print(f"broken: {len(samples)} samples, P(b) = {target[b]:.3f}, observed "
          f"{samples.count(b) / len(samples):.3f}; chi-square p = {p:.3g} ({df} degrees of freedom)")
    assert p < 1e-6
