"""Sampling behaviour, checked against HF transformers where it has the same concept."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

PROMPT = [17, 99, 240, 311, 45, 8, 77, 150, 402, 33, 21]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), dtype="float32", num_gpu_blocks=128, max_model_len=256)


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_step_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def test_logprobs_match_hf(llm, hf):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    ids = list(PROMPT)
    total = 0.0
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        ref = hf_step_logprobs(hf, ids)
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
        top = ref.topk(3)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
        total += float(ref[token])
        ids.append(token)
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_repetition_penalty_matches_hf(llm, hf):
    params = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8, ignore_eos=True)
    ours = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          repetition_penalty=1.8, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == ref


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate([[5, 6, 7], PROMPT, [9, 9, 9, 9]], [noisy, params, noisy])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_children_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    second = llm.generate([PROMPT], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_top_k_and_top_p_stay_inside_hf_support(llm, hf):
    ref = hf_step_logprobs(hf, PROMPT)
    top5 = set(ref.topk(5).indices.tolist())
    probs, order = ref.exp().sort(descending=True)
    nucleus = set(order[: int((probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    seen_k, seen_p = set(), set()
    for seed in range(40):
        k = llm.generate([PROMPT], SamplingParams(temperature=1.5, top_k=5, max_tokens=1, seed=seed))[0]
        p = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.5, max_tokens=1, seed=seed))[0]
        seen_k.add(k.outputs[0].token_ids[0])
        seen_p.add(p.outputs[0].token_ids[0])
    assert seen_k <= top5 and len(seen_k) > 1
    assert seen_p <= nucleus
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    top1 = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_k=1, max_tokens=1, seed=3))[0]
    assert top1.outputs[0].token_ids == greedy


def test_min_p_filters_unlikely_tokens(llm, hf):
    ref = hf_step_logprobs(hf, PROMPT).exp()
    allowed = set((ref >= 0.3 * ref.max()).nonzero().flatten().tolist())
    seen = {llm.generate([PROMPT], SamplingParams(temperature=1.0, min_p=0.3, max_tokens=1, seed=s))[0]
            .outputs[0].token_ids[0] for s in range(30)}
    assert seen <= allowed


def test_presence_penalty_prevents_repeats(llm):
    plain = llm.generate([[7, 7, 7, 7]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    pen = llm.generate([[7, 7, 7, 7]], SamplingParams(temperature=0, max_tokens=30, presence_penalty=2.0,
                                                      frequency_penalty=2.0, ignore_eos=True))[0]
    ids = pen.outputs[0].token_ids
    assert len(set(plain.outputs[0].token_ids)) < len(ids)      # unpenalised greedy loops
    assert len(set(ids)) >= len(ids) - 2


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[3]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))[0]
    comp = out.outputs[0]
    first = ids.index(stop_id)
    assert comp.token_ids == ids[: first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_id
    # min_tokens suppresses the stop token until enough tokens exist
    later = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=first + 2,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert len(later.token_ids) >= first + 2
    assert stop_id not in later.token_ids[: first + 1]


def test_stop_strings_truncate_text(llm):
    base = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = base.outputs[0].text
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.index(stop)
    out = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                                          include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[: cut + len(stop)]


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "The quick brown fox"}]
    expected = tok.encode("<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_token_ids == expected


def test_priority_policy_admits_high_priority_first(path):
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [5, 6], p, priority=5)
    engine.add_request("high", [5, 7], p, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_mixed_parameters_in_one_batch_match_each_request_alone(llm):
    """Vectorised sampling: every row gets its own parameters. Oracle: the same request run
    alone (greedy rows are deterministic, seeded rows reproducible whatever the batch)."""
    mixed = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, presence_penalty=1.5, frequency_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=8, seed=11, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, max_tokens=8, seed=12,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
    ]
    prompts = [PROMPT, PROMPT[:5], [7, 7, 7, 7], PROMPT[3:], PROMPT, [9, 8, 7]]
    together = llm.generate(prompts, mixed)
    for prompt, params, out in zip(prompts, mixed, together, strict=True):
        alone = llm.generate([prompt], params)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        if params.logprobs:   # batched matmuls round differently: compare to 1e-4
            for got, ref in zip(out.outputs[0].logprobs, alone.logprobs, strict=True):
                assert got.keys() == ref.keys()
                assert all(got[t].logprob == pytest.approx(ref[t].logprob, abs=1e-4)
                           and got[t].rank == ref[t].rank for t in got)


def test_greedy_tokens_are_torchs_argmax():
    """NumPy's argmax on CPU float32 logits picks torch's index: the first of equal maxima,
    the first NaN, the first +inf; other dtypes and layouts take torch's own."""
    from kvpilot.engine.model.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 262144, generator=gen)
    logits[1, [10, 20]] = float("nan")
    logits[2] = 3.0
    logits[3, [7, 9]] = float("inf")
    logits[4, [5, 50]] = logits[4].max() + 1
    logits[5] = float("-inf")
    for x in (logits, logits[:, ::2], logits.to(torch.bfloat16)):
        got = greedy_tokens(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
