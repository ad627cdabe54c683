"""Greedy outputs under speculative decoding are token-identical to decoding without it,
and so to HF transformers (and PEFT for LoRA adapters).

For each model of the HF-parity set and each proposer (n-gram lookup, a draft model, an
EAGLE-style head), one batch mixes prompts under the
base model, the same prompts under a random LoRA adapter, and a request constrained by a
JSON schema; the engine runs it with chunked prefill under a small token budget and a KV
pool so small that requests are preempted and recomputed, twice (the second pass hits the
prefix cache). Prompts repeat segments of themselves, so n-gram drafts are often right;
random models fall into loops, so drafts are accepted and rejected alike. Oracles: HF
greedy for the base rows, transformers + PEFT for the adapter rows, the engine without
speculation for the constrained row (HF has no grammar).
"""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.lora.config import LoRAModule
from kvpilot.engine.sampling_params import StructuredOutputsParams

from support.eagle_heads import build_eagle_head
from support.hf_oracle import hf_greedy
from support.lora_adapters import build_adapter, peft_greedy

KINDS = ["llama", "qwen2", "qwen3"]
MAX_NEW = 20
# min_tokens: EOS is banned as the oracles' generate(min_new_tokens=...) bans it (and the
# ban applies at every scored position of a speculative step)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
JSON = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks=28, max_num_batched_tokens=64,
              max_num_seqs=16, enable_lora=True, max_loras=1, max_lora_rank=8)


def prompts_for(seed: int) -> list[list[int]]:
    """Prompts that copy from themselves: a segment and its repeat, some sharing a prefix."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    shared = rand(48)
    out = []
    for n in (6, 20, 40, 70):
        seg = rand(n)
        out.append(seg + rand(5) + seg[: n // 2])
    out += [shared + rand(9), shared + rand(30) + shared[:12]]
    return out


@pytest.fixture(scope="module", params=KINDS)
def case(request, tiny_checkpoint, tmp_path_factory):
    kind = request.param
    base = tiny_checkpoint(kind)
    adapter = build_adapter(base, tmp_path_factory.mktemp(f"spec-lora-{kind}"), 8, seed=7)
    prompts = prompts_for(KINDS.index(kind))
    expected = {None: hf_greedy(base, prompts, MAX_NEW), "ad": peft_greedy(base, adapter, prompts, MAX_NEW)}
    reference = LLM(str(base), **ENGINE, lora_modules=(LoRAModule("ad", str(adapter)),))
    expected["json"] = reference.generate([prompts[1]], JSON)[0].outputs[0].token_ids
    return kind, base, adapter, prompts, expected


def run_batch(llm: LLM, prompts: list[list[int]]) -> dict:
    """Every prompt under the base model and the adapter, and one constrained request."""
    batch = [(None, p, GREEDY) for p in prompts] + [("ad", p, GREEDY) for p in prompts]
    batch.insert(3, ("json", prompts[1], JSON))
    outs = llm.generate([p for _, p, _ in batch], [s for _, _, s in batch],
                        lora_name=[None if n == "json" else n for n, _, _ in batch])
    got: dict = {None: [], "ad": []}
    for (name, _, _), out in zip(batch, outs, strict=True):
        if name == "json":
            got["json"] = out.outputs[0].token_ids
        else:
            got[name].append(out.outputs[0].token_ids)
    return got


def spec_config(proposer: str, kind: str, base, tiny_checkpoint, tmp_path_factory) -> dict:
    """n-gram lookup; a draft model (the target itself for llama: every draft of the base
    rows is right; a one-layer model of another seed otherwise); an EAGLE head."""
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    if proposer == "draft_model":
        draft = base if kind == "llama" else tiny_checkpoint(kind, seed=9, num_hidden_layers=1)
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    head = build_eagle_head(base, tmp_path_factory.mktemp(f"eagle-{kind}"))
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "eagle"])
def test_greedy_is_token_identical_with_everything_in_one_batch(case, proposer, tiny_checkpoint,
                                                                tmp_path_factory):
    kind, base, adapter, prompts, expected = case
    llm = LLM(str(base), **ENGINE, lora_modules=(LoRAModule("ad", str(adapter)),),
              speculative_config=spec_config(proposer, kind, base, tiny_checkpoint, tmp_path_factory))
    assert run_batch(llm, prompts) == expected
    first = llm.get_stats()
    assert run_batch(llm, prompts) == expected          # again: prefix hits this time
    stats = llm.get_stats()
    spec = stats.spec_decoding
    print(f"{proposer}: {spec}, preemptions {stats.num_preemptions}, prefix hits "
          f"{stats.prefix_cache_hits}, steps {stats.num_steps}")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > first.prefix_cache_hits
    assert stats.num_steps > sum(map(len, prompts)) * 2 // 64     # prefills were chunked
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens <= spec.num_draft_tokens
    if proposer != "eagle" and not (proposer == "draft_model" and kind != "llama"):
        assert spec.num_accepted_tokens > 0     # runs of accepted drafts were verified too
    assert stats.kv_cache_usage == 0.0
