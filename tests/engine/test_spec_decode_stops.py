"""A speculative step may accept several tokens; a stop among them (a stop string, a stop
token, EOS, max_tokens) ends the request exactly where decoding token by token ends it.

The reference is the same engine without speculation; each stop is taken from the
reference's own output, at a place where the speculative run accepts runs of drafts.
"""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2,
           "Prefix caching reuses the KV cache of shared prompt prefixes. Prefix caching"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    kwargs = dict(dtype="float32", num_gpu_blocks=64, max_model_len=128)
    return LLM(path, **kwargs), LLM(path, **kwargs, speculative_config=SPEC)


def _outputs(llm, prompts, params):
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in llm.generate(prompts, params)]


@pytest.mark.slow
def test_stops_in_accepted_runs_match_decoding_without_speculation(engines):
    """Every stop kind for every prompt in one batch per engine (greedy rows do not depend
    on what shares their batch)."""
    plain, spec = engines
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = plain.generate(PROMPTS, base)
    prompts, cases = [], []
    for prompt, out in zip(PROMPTS, reference, strict=True):
        tokens, text = out.outputs[0].token_ids, out.outputs[0].text
        cases += [
            base,
            SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[9]], ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=24, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
            SamplingParams(temperature=0.0, max_tokens=24, stop=[text[len(text) // 3:len(text) // 3 + 2]],
                           include_stop_str_in_output=True),
            SamplingParams(temperature=0.0, max_tokens=24, min_tokens=5, stop_token_ids=[tokens[2]],
                           ignore_eos=True),
        ]
        prompts += [prompt] * 6
    assert _outputs(spec, prompts, cases) == _outputs(plain, prompts, cases)
    assert spec.get_stats().spec_decoding.num_accepted_tokens > 0


@pytest.mark.slow
def test_logprobs_and_seeded_sampling(engines):
    plain, spec = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    for want, got in zip(plain.generate(PROMPTS, greedy), spec.generate(PROMPTS, greedy), strict=True):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 16
        for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
            assert lw.keys() == lg.keys()
            for t in lw:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)
                assert lg[t].rank == lw[t].rank
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    # a seeded request under speculation reproduces itself, whatever shares its batch
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=16,
                            ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.3)
    alone = spec.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    crowd = spec.generate(PROMPTS + [PROMPTS[0]], [SamplingParams(temperature=1.0, max_tokens=16)] * len(PROMPTS)
                          + [seeded])[-1].outputs[0].token_ids
    assert alone == crowd and len(alone) == 16
