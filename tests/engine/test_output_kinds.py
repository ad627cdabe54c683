"""``SamplingParams.output_kind``: cumulative, delta and final-only outputs tell the same story.

Oracle: the CUMULATIVE outputs (what the engine always returned): the deltas of a
DELTA request concatenate to its final cumulative output, step by step; a FINAL_ONLY
request returns exactly one output, equal to the final cumulative one. Stop strings
(whose held-back characters must not leak into a delta), n > 1 and logprobs included.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=128, max_model_len=256).llm_engine


def _run(engine, rid, params):
    engine.add_request(rid, "The quick brown fox", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("stop", [None, "ab"])
def test_deltas_and_final_only_agree_with_cumulative(engine, stop):
    base = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, logprobs=1, ignore_eos=True)
    cumulative = _run(engine, "c", base)
    final = cumulative[-1]
    if stop is not None:   # a stop string that really occurs: two chars from the middle
        stop = final.outputs[0].text[4:6]
        base = dataclasses.replace(base, stop=[stop])
        cumulative = _run(engine, "c2", base)
        final = cumulative[-1]
    deltas = _run(engine, "d", dataclasses.replace(base, output_kind=RequestOutputKind.DELTA))
    only = _run(engine, "f", dataclasses.replace(base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(only) == 1 and only[0].finished
    assert only[0].outputs == final.outputs
    assert len(deltas) == len(cumulative)
    for i, choice in enumerate(final.outputs):
        seen_text, seen_ids, seen_lp = "", [], []
        for d, c in zip(deltas, cumulative, strict=True):
            part = d.outputs[i]
            seen_text += part.text
            seen_ids += part.token_ids
            seen_lp += part.logprobs
            assert seen_ids == c.outputs[i].token_ids
            assert c.outputs[i].text.startswith(seen_text)   # never ahead of what is settled
        assert (seen_text, seen_ids, seen_lp) == (choice.text, choice.token_ids, choice.logprobs)
        assert deltas[-1].outputs[i].finish_reason == choice.finish_reason
    if stop is not None:
        assert final.outputs[0].finish_reason == "stop" and stop not in final.outputs[0].text


def test_llm_generate_builds_no_per_step_outputs(engine, monkeypatch):
    """LLM.generate asks for final outputs only: no output is built for a running request."""
    from kvpilot.engine.output_processor import RequestState
    from kvpilot.engine.runtime.core import EngineCore

    built = []
    real = RequestState.output
    monkeypatch.setattr(RequestState, "output", lambda self: built.append(self.finished) or real(self))
    llm = LLM.__new__(LLM)
    llm.llm_engine, llm._ids, llm._core = engine, iter(range(10**6)), EngineCore(engine)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert built == [True, True]
