"""Priority scheduling (a late high-priority request preempts and finishes first) and
``logit_bias`` (greedy outputs equal HF transformers' ``generate`` with the same
``sequence_bias``)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

LOW = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _finish_order(policy: str, tiny_checkpoint) -> tuple[list[str], int, int]:
    """Four low-priority requests fill a batch of two; a high-priority one arrives later.
    Returns (request ids in finishing order, preemptions, steps the late one waited)."""
    engine = LLMEngine(EngineArgs(str(tiny_checkpoint("qwen3")), dtype="float32", max_num_seqs=2,
                                  num_gpu_blocks=64, max_model_len=256,
                                  scheduling_policy=policy))
    for i in range(4):
        engine.add_request(f"low-{i}", [5 + i] * 20, LOW, priority=5)
    for _ in range(3):   # both slots busy decoding
        engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    engine.add_request("high", [9] * 20, HIGH, priority=-1)
    order, waited = [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if "high" not in order and not any(o.request_id == "high" for o in outputs):
            waited += 1
        order += [o.request_id for o in outputs if o.finished]
    return order, engine.get_stats().num_preemptions, waited


def test_late_high_priority_request_preempts_and_finishes_first(tiny_checkpoint):
    order, preemptions, waited = _finish_order("priority", tiny_checkpoint)
    assert order[0] == "high", order
    assert preemptions >= 1           # it took a running low-priority request's slot
    assert waited == 0                # admitted in the very step after it arrived
    # the control: first come, first served makes the same request wait for two others
    fcfs_order, fcfs_preemptions, fcfs_waited = _finish_order("fcfs", tiny_checkpoint)
    assert fcfs_order.index("high") >= 2 and fcfs_preemptions == 0 and fcfs_waited > 10


def test_preempted_low_priority_requests_still_complete_identically(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    alone = LLM(path, dtype="float32", num_gpu_blocks=64, max_model_len=256).generate([[5] * 20], LOW)
    engine = LLMEngine(EngineArgs(path, dtype="float32", max_num_seqs=1, num_gpu_blocks=64, max_model_len=256,
                                  scheduling_policy="priority"))
    engine.add_request("low", [5] * 20, LOW, priority=1)
    for _ in range(5):
        engine.step()
    engine.add_request("high", [9] * 20, HIGH, priority=0)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.get_stats().num_preemptions == 1
    assert final["low"].outputs[0].token_ids == alone[0].outputs[0].token_ids


def _hf_biased_greedy(path, prompt: list[int], bias: dict[int, float], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             sequence_bias={(t,): b for t, b in bias.items()})
    return out[0, len(prompt):].tolist()


def test_logit_bias_matches_hf_sequence_bias(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256)
    prompt = [11, 12, 13, 14, 15]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    plain_ids = plain[0].outputs[0].token_ids
    # push the plain greedy tokens down and two others up: a different greedy path
    bias = {plain_ids[0]: -8.0, plain_ids[1]: -8.0, 300: 3.0, 301: 6.5}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert got != plain_ids
    assert got == _hf_biased_greedy(path, prompt, bias, 8)
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True,
                            logit_bias={42: 100.0})
    assert llm.generate([prompt], forced)[0].outputs[0].token_ids == [42] * 5


def test_bad_logit_bias_is_rejected(tiny_checkpoint):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    llm = LLM(str(tiny_checkpoint("qwen3")), dtype="float32", num_gpu_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 512\)"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={512: 1.0}))
