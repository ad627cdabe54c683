"""The model-based proposers draft what their model says, computed independently by HF
transformers: a draft model's drafts are its greedy continuation of the request's tokens;
an EAGLE head's drafts are its own recurrence (fused target hidden state and next-token
embedding, one decoder layer, the target's LM head), recomputed over the whole sequence
with HF modules at every step. Their KV lives in the target's blocks and is caught up
step by step, so any slip there (a wrong slot, a stale position) changes the drafts.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from kvpilot.engine import LLM, SamplingParams

from support.eagle_heads import build_eagle_head

K = 3
ENGINE = dict(dtype="float32", num_gpu_blocks=32, max_model_len=128, max_num_batched_tokens=16)


def _steps(llm: LLM, prompt: list[int], num_tokens: int):
    """(tokens so far, the drafts proposed for the next step) after each engine step."""
    engine = llm.llm_engine
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get("r")
        if request is not None and request.output_token_ids:
            yield request.all_token_ids, list(request.spec_token_ids)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_draft_model_drafts_its_greedy_continuation(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    target, draft = tiny_checkpoint("qwen2"), tiny_checkpoint("qwen2", seed=5, num_hidden_layers=1)
    oracle = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    llm = LLM(str(target), **ENGINE, speculative_config={"method": "draft_model", "model": str(draft),
                                                         "num_speculative_tokens": K})
    prompt = [random.Random(1).randrange(3, 512) for _ in range(40)]   # chunked: 16-token steps
    checked = 0
    with torch.no_grad():
        for tokens, drafts in _steps(llm, prompt, 14):
            if len(drafts) == K:
                assert drafts == _greedy(oracle, tokens, K), len(tokens)
                checked += 1
    assert checked >= 5


def _hf_head(target_path, head_path):
    """The head as HF modules: a one-layer model of the target's family (no input norm, no
    final norm) holding the head's layer, its fc, and the target model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_path)
    config.num_hidden_layers = 1
    layer_model = AutoModelForCausalLM.from_config(config).model.float()
    weights = load_file(str(head_path / "model.safetensors"))
    layer = {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}
    layer_model.layers[0].load_state_dict(layer, strict=False)
    layer_model.layers[0].input_layernorm = torch.nn.Identity()
    layer_model.norm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data.copy_(weights["fc.weight"])
    return AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval(), layer_model.eval(), fc


def _eagle_drafts(target, layer_model, fc, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1's recurrence over the whole sequence: at position p, fc([embed(t[p+1]); h[p]])
    through the layer; h is the target's final hidden state, then the head's own output."""
    ids = torch.tensor([tokens])
    hidden = target.model(ids).last_hidden_state[0]            # normed final hidden states
    embed = target.get_input_embeddings()
    features = list(hidden[:-1])
    nexts = tokens[1:]
    drafts = []
    for _ in range(k):
        x = fc(torch.cat([embed(torch.tensor(nexts)), torch.stack(features)], dim=-1))
        out = layer_model(inputs_embeds=x[None], position_ids=torch.arange(len(nexts))[None]).last_hidden_state[0]
        token = int(target.lm_head(out[-1]).argmax())
        drafts.append(token)
        features.append(out[-1])
        nexts.append(token)
    return drafts


@pytest.mark.slow
def test_eagle_head_drafts_its_recurrence(tiny_checkpoint, tmp_path):
    target_path = tiny_checkpoint("llama")
    head = build_eagle_head(target_path, tmp_path / "head", seed=2, scale=0.5)
    target, layer_model, fc = _hf_head(target_path, head)
    llm = LLM(str(target_path), **ENGINE, speculative_config={"method": "eagle", "model": str(head),
                                                              "num_speculative_tokens": K})
    prompt = [random.Random(2).randrange(3, 512) for _ in range(40)]
    checked = 0
    with torch.no_grad():
        for tokens, drafts in _steps(llm, prompt, 14):
            if len(drafts) == K:
                assert drafts == _eagle_drafts(target, layer_model, fc, tokens, K), len(tokens)
                checked += 1
    assert checked >= 5
